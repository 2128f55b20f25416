"""Every method of every gRPC service a worker serves, called with hostile payloads: random bytes,
random field values built from the message descriptors, and out-of-range ids and block lists.

Each call ends with a status within its deadline (a KvEvents subscription and an output stream
are cancelled after their first batch); an error's details are bounded; and afterwards each
worker is alive, its KV bookkeeping intact with the blocks in use at baseline, and a normal request gets the same tokens
as before the fuzzing.
"""
import math
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.rpc.gen import kv_events_pb2, kv_transfer_pb2, request_pb2, worker_pb2, worker_pb2_grpc
from pdserve.rpc.status import MAX_DETAILS_CHARS
from tests.fuzz.worker_calls import MAX_TOKENS, PROMPT, FuzzStack, assert_worker_sound, call_raw

pytestmark = pytest.mark.integration
MAX_EXAMPLES = 50  # per method and kind of payload: with the HTTP run, about a minute on 2 cores
CALL_TIMEOUT_S = 30.0  # a call still running after this is a hung worker (DEADLINE_EXCEEDED fails the test)
MAX_STREAM_MESSAGES = 1000  # more than any answer within the stack's 128-token context
ENDLESS_STREAMS = {"pdserve.v1.KvEvents.Subscribe", "pdserve.v1.Worker.StreamOutputs"}  # read one batch, then cancel
ROLE_SERVICES = {  # which worker of the stack serves which services
    "worker": ("Worker", "KvEvents", "LoraAdapters"),
    "prefill_worker": ("Worker", "KvEvents", "KvTransfer"),
    "decode_worker": ("Worker", "KvEvents"),
}
_FILES = (worker_pb2, kv_events_pb2, kv_transfer_pb2)
SERVICES = {service.name: service for file in _FILES for service in file.DESCRIPTOR.services_by_name.values()}
METHODS = [(role, method) for role, names in ROLE_SERVICES.items() for name in names
           for method in SERVICES[name].methods]
METHOD_IDS = [f"{role}-{method.containing_service.name}.{method.name}" for role, method in METHODS]


def path_of(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


@pytest.fixture(scope="module")
def channels(fuzz_stack: FuzzStack) -> Iterator[dict[str, grpc.Channel]]:
    roles = {role: grpc.insecure_channel(getattr(fuzz_stack, role)) for role in ROLE_SERVICES}
    yield roles
    for channel in roles.values():
        channel.close()


def assert_ends_with_a_status(channel: grpc.Channel, method: MethodDescriptor,
                              payload: bytes) -> tuple[grpc.StatusCode, str]:
    """The call ends within its deadline with a status the worker chose (UNKNOWN: an exception its
    servicer let escape), or, for bytes that are no message of the method's type, with grpc's own
    error; returns that status."""
    max_messages = 1 if method.full_name in ENDLESS_STREAMS else MAX_STREAM_MESSAGES
    code, details = call_raw(channel, path_of(method), payload, method.server_streaming, CALL_TIMEOUT_S, max_messages)
    assert code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), (method.full_name, details)
    assert len(details) <= MAX_DETAILS_CHARS, (method.full_name, details[:200])
    if is_message(method.input_type, payload):
        assert code != grpc.StatusCode.UNKNOWN, (method.full_name, details[:500])
    else:
        assert code != grpc.StatusCode.OK, method.full_name
    return code, details


def is_message(descriptor: Descriptor, payload: bytes) -> bool:
    try:
        GetMessageClass(descriptor).FromString(payload)
    except DecodeError:
        return False
    return True


# --- random values for any message, from its descriptor ---------------------------------------

_INT_BOUNDS = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_HOSTILE_TEXT = ["", "#", "~", "a#b", "x~1", "\x00", "baseline", "é" * 3, "x" * 100_000]


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Mostly small values (valid token and block ids, counts), and the edges of the type."""
    edges = sorted({v for v in (low, high, 0, 1, high // 2, 2**31 - 1, 2**32 - 1) if low <= v <= high})
    return st.one_of(st.integers(max(low, 0), min(high, 600)), st.sampled_from(edges), st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[object]:
    cpp = field.cpp_type
    if cpp in _INT_BOUNDS:
        return _integers(*_INT_BOUNDS[cpp])
    if cpp == FieldDescriptor.CPPTYPE_DOUBLE:
        return st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 1e-300, math.inf, -math.inf, math.nan]))
    if cpp == FieldDescriptor.CPPTYPE_FLOAT:
        return st.floats(width=32)
    if cpp == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if cpp == FieldDescriptor.CPPTYPE_ENUM:  # proto3 enums are open: unknown numbers reach the server too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _integers(-(2**31), 2**31 - 1))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00" * 32, b"\xff" * 70_000]))
    return st.one_of(st.text(max_size=24), st.sampled_from(_HOSTILE_TEXT))


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Instances of `descriptor`'s message with any subset of fields set to random values."""
    message_class = GetMessageClass(descriptor)

    def field_values(field: FieldDescriptor) -> st.SearchStrategy[object]:
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            one = messages(field.message_type, depth + 1) if depth < 3 else st.just(GetMessageClass(field.message_type)())
        else:
            one = _scalar(field)
        return st.lists(one, max_size=8) if field.is_repeated else one

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = message_class()
        for field in descriptor.fields:
            if not draw(st.booleans()):
                continue
            value = draw(field_values(field))
            if field.is_repeated:
                getattr(message, field.name).extend(value)
            elif field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                getattr(message, field.name).CopyFrom(value)
            else:
                setattr(message, field.name, value)
        return message

    return build()


# --- the fuzz runs ------------------------------------------------------------------------------

FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize(("role", "method"), METHODS, ids=METHOD_IDS)
def test_random_bytes(channels: dict[str, grpc.Channel], role: str, method: MethodDescriptor) -> None:
    @FUZZ_SETTINGS
    @given(payload=st.one_of(st.binary(max_size=256), st.just(b"\xff" * 4096)))
    def ends_with_a_status(payload: bytes) -> None:
        assert_ends_with_a_status(channels[role], method, payload)

    ends_with_a_status()


@pytest.mark.parametrize(("role", "method"), METHODS, ids=METHOD_IDS)
def test_random_field_values(channels: dict[str, grpc.Channel], role: str, method: MethodDescriptor) -> None:
    @FUZZ_SETTINGS
    @given(message=messages(method.input_type))
    def ends_with_a_status(message: Message) -> None:
        assert_ends_with_a_status(channels[role], method, message.SerializeToString())

    ends_with_a_status()


VOCAB_SIZE = 49152  # the tiny checkpoint's (SmolLM2's tokenizer)


@st.composite
def admissible_generate_requests(draw: st.DrawFn) -> request_pb2.GenerateRequest:
    """Random field values around a prompt and length the engine admits, so sampling, stop
    strings, priorities, salts and spans reach the engine's steps."""
    message = draw(messages(request_pb2.GenerateRequest.DESCRIPTOR))
    message.request_id = f"fuzz-{draw(st.integers(0, 2**64))}"
    message.prompt_token_ids[:] = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=80))
    message.sampling.max_tokens = draw(st.integers(1, 24))
    message.sampling.n = draw(st.one_of(st.just(1), st.integers(1, 4)))  # n > 1 is prefilled locally
    message.sampling.temperature = draw(st.one_of(st.just(0.0), st.floats(0.0, 2.0)))
    message.sampling.top_p = draw(st.floats(0.0, 1.0, exclude_min=True))
    if message.sampling.HasField("logprobs"):
        message.sampling.logprobs = draw(st.integers(0, 20))
    return message


@pytest.mark.parametrize("role", ["worker", "decode_worker"])
@FUZZ_SETTINGS
@given(message=admissible_generate_requests(), via_prefill_worker=st.booleans())
def test_admissible_generate_requests_never_fail_a_step(fuzz_stack: FuzzStack, role: str,
                                                        message: request_pb2.GenerateRequest,
                                                        via_prefill_worker: bool) -> None:
    """Refused at admission (INVALID_ARGUMENT) or served to the end: never an ERROR output,
    which would mean a parameter the engine let in broke the step it ran in. On the decode
    worker the prompt's KV comes from the real prefill worker, or from the random address
    `prefill_worker` names (dialled, failed, prefilled locally)."""
    if via_prefill_worker:
        message.prefill_worker = fuzz_stack.prefill_worker
    with grpc.insecure_channel(getattr(fuzz_stack, role)) as channel:
        try:
            outputs = list(worker_pb2_grpc.WorkerStub(channel).Generate(message, timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details()[:500])
            return
    errors = [output.error for output in outputs if output.finish_reason == request_pb2.FINISH_REASON_ERROR]
    assert errors == []
    finished = {output.index for output in outputs if output.finish_reason != request_pb2.FINISH_REASON_UNSPECIFIED}
    assert finished == set(range(message.sampling.n))


def _generate(request_id: str, prompt: list[int], **sampling: object) -> request_pb2.GenerateRequest:
    defaults: dict[str, object] = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "n": 1}
    return request_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling=request_pb2.SamplingParams(**{**defaults, **sampling}))


U32 = 2**32 - 1
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
OUT_OF_RANGE_GENERATE = [
    (_generate("oor-vocab", [1, 2, U32]), INVALID),
    (_generate("oor-empty", []), INVALID),
    (_generate("oor#sibling", [1, 2, 3]), INVALID),
    (_generate("oor~retry", [1, 2, 3]), INVALID),
    (_generate("oor-long-prompt", list(range(1, 5000))), INVALID),
    (_generate("oor-n", [1, 2, 3], n=U32), INVALID),
    (_generate("oor-max-tokens", [1, 2, 3], max_tokens=U32), INVALID),
    (_generate("oor-logprobs", [1, 2, 3], logprobs=U32, max_tokens=100), INVALID),  # was 72 MB of answer
    (_generate("oor-nan", [1, 2, 3], temperature=math.nan), INVALID),  # was a failed step, status OK
    (_generate("oor-top-p", [1, 2, 3], top_p=math.inf), INVALID),
    (_generate("oor-top-k", [1, 2, 3], top_k=U32), OK),  # past the vocabulary: no filter
    (_generate("oor-stop-ids", [1, 2, 3], stop_token_ids=[U32] * 100), OK),
    (_generate("oor-stop", [1, 2, 3], stop=["s" * 100_000] * 3), OK),
    (request_pb2.GenerateRequest(request_id="oor-priority", prompt_token_ids=[1, 2, 3],
                                 sampling=request_pb2.SamplingParams(max_tokens=2, n=1, top_p=1.0),
                                 priorities=[request_pb2.PriorityRange(start=U32, end=0, priority=U32)]), INVALID),
    (request_pb2.GenerateRequest(request_id="oor-multimodal", prompt_token_ids=[1, 2, 3],
                                 sampling=request_pb2.SamplingParams(max_tokens=2, n=1, top_p=1.0),
                                 multimodal=[request_pb2.MultimodalSpan(content_hash=b"h", offset=U32, length=U32)]),
     OK),  # a span past the prompt touches no block
    (request_pb2.GenerateRequest(request_id="oor-prefill-worker", prompt_token_ids=list(range(1, 60)),
                                 sampling=request_pb2.SamplingParams(max_tokens=2, n=1, top_p=1.0),
                                 prefill_worker="127.0.0.1:1"), OK),  # nobody there: prefilled locally
    (_generate("x" * 1_000_000, [1, 2, 3]), OK),
    (_generate("x" * 1_000_000 + "#", [1, 2, 3]), INVALID),  # was RESOURCE_EXHAUSTED: the echoed id overflowed the trailer
]
OUT_OF_RANGE_PREFILL = [
    kv_transfer_pb2.PrefillRequest(request=_generate("pf-unknown-peer", [1, 2, 3, 4, 5]), decode_worker_id="nobody",
                                   first_block=0, dest_block_ids=[0], deadline=time.time() + 300),
    kv_transfer_pb2.PrefillRequest(request=_generate("pf-blocks", list(range(1, 40))), decode_worker_id="nobody",
                                   first_block=U32, dest_block_ids=[U32] * 1000, deadline=time.time() + 300),
    kv_transfer_pb2.PrefillRequest(request=_generate("pf-timeout", list(range(1, 40))), decode_worker_id="",
                                   first_block=1, dest_block_ids=[], deadline=-math.inf),
    kv_transfer_pb2.PrefillRequest(request=_generate("pf-nan", [1, 2, 3]), decode_worker_id="nobody",
                                   dest_block_ids=[0], deadline=math.nan),
    kv_transfer_pb2.PrefillRequest(decode_worker_id="nobody", dest_block_ids=[5], deadline=time.time() + 300),
    kv_transfer_pb2.PrefillRequest(request=_generate("pf-vocab", [U32] * 20), decode_worker_id="nobody",
                                   dest_block_ids=[0, 1], deadline=time.time() + 300),
]
HANDSHAKES = [
    kv_transfer_pb2.HandshakeRequest(worker_id="", metadata=b""),
    kv_transfer_pb2.HandshakeRequest(worker_id="nobody", metadata=b"\x00" * 64),
    kv_transfer_pb2.HandshakeRequest(worker_id="nobody", metadata=b"\xff" * 100_000),
]


@pytest.mark.parametrize("role", list(ROLE_SERVICES))
@pytest.mark.parametrize(("message", "code"), OUT_OF_RANGE_GENERATE, ids=[m.request_id[:24] for m, _ in OUT_OF_RANGE_GENERATE])
def test_out_of_range_generate(channels: dict[str, grpc.Channel], role: str, message: request_pb2.GenerateRequest,
                               code: grpc.StatusCode) -> None:
    method = SERVICES["Worker"].methods_by_name["Generate"]
    answered, details = assert_ends_with_a_status(channels[role], method, message.SerializeToString())
    assert answered == code, details[:500]


@pytest.mark.parametrize("message", [*OUT_OF_RANGE_PREFILL, *HANDSHAKES], ids=lambda r: type(r).__name__)
def test_out_of_range_transfer_orders(channels: dict[str, grpc.Channel], message: Message) -> None:
    method = SERVICES["KvTransfer"].methods_by_name[type(message).__name__.removesuffix("Request")]
    code, details = call_raw(channels["prefill_worker"], path_of(method), message.SerializeToString(), False,
                             CALL_TIMEOUT_S)
    assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.UNAVAILABLE), (code, details[:500])
    assert len(details) <= MAX_DETAILS_CHARS, details[:200]


@pytest.mark.parametrize("prefill_worker", [
    lambda stack: "", lambda stack: "::::", lambda stack: "x" * 10_000, lambda stack: "127.0.0.1:0",
    lambda stack: "[::1]:99999", lambda stack: "unix:/nonexistent", lambda stack: "dns:///no.such.host.invalid:1",
    lambda stack: stack.worker,  # a worker without KvTransfer
    lambda stack: stack.decode_worker,  # itself
], ids=["empty", "colons", "huge", "port-0", "port-out-of-range", "unix", "no-such-host", "not-prefill", "itself"])
def test_hostile_prefill_worker_addresses_are_prefilled_locally(fuzz_stack: FuzzStack, prefill_worker) -> None:
    message = _generate(f"hostile-prefill-{time.monotonic_ns()}", PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    message.prefill_worker = prefill_worker(fuzz_stack)
    with grpc.insecure_channel(fuzz_stack.decode_worker) as channel:
        outputs = list(worker_pb2_grpc.WorkerStub(channel).Generate(message, timeout=CALL_TIMEOUT_S))
    assert [token for output in outputs for token in output.token_ids] == \
        fuzz_stack.baselines[fuzz_stack.decode_worker].tokens


@pytest.mark.parametrize("request_id", ["", "never-seen", "#", "x" * 1_000_000])
@pytest.mark.parametrize("role", list(ROLE_SERVICES))
def test_aborting_unknown_ids(channels: dict[str, grpc.Channel], role: str, request_id: str) -> None:
    method = SERVICES["Worker"].methods_by_name["Abort"]
    assert_ends_with_a_status(channels[role], method, worker_pb2.AbortRequest(request_id=request_id).SerializeToString())


@pytest.mark.parametrize("role", list(ROLE_SERVICES))
def test_the_worker_is_sound_after_the_grpc_fuzz(fuzz_stack: FuzzStack, role: str) -> None:
    address = getattr(fuzz_stack, role)
    baseline = fuzz_stack.baselines[address]
    assert_worker_sound(address, baseline.integrity, baseline.tokens)
