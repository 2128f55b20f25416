"""pdserve types ↔ protobuf: exact round trips, and typed errors for what protobuf cannot carry."""
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.common.errors import InvalidRequestError, WorkerError
from pdserve.common.disagg import Hello
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import (
    GenerationRequest,
    Guide,
    GuideKind,
    MultimodalSpan,
    PriorityRange,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from pdserve.common.stats import EngineStats, LoraAdapterInfo, ModelInfo, WorkerRole
from pdserve.rpc import convert, kv_transfer
from pdserve.rpc.gen import request_pb2, worker_pb2

u32 = st.integers(0, 2**32 - 1)
finite = st.floats(allow_nan=False)
text = st.text(max_size=8)

sampling = st.builds(
    SamplingParams, max_tokens=u32, temperature=finite, top_p=finite, top_k=u32,
    seed=st.none() | st.integers(-(2**63), 2**63 - 1), stop=st.lists(text, max_size=3).map(tuple),
    stop_token_ids=st.lists(u32, max_size=3).map(tuple), ignore_eos=st.booleans(), n=u32,
    logprobs=st.none() | u32, include_stop_str_in_output=st.booleans(),
    guide=st.none() | st.builds(Guide, st.sampled_from(GuideKind), text),
    prompt_logprobs=st.none() | u32, skip_special_tokens=st.booleans(), spaces_between_special_tokens=st.booleans(),
    presence_penalty=finite, frequency_penalty=finite, repetition_penalty=finite, min_tokens=u32,
    logit_bias=st.lists(st.tuples(u32, finite), max_size=3).map(tuple),
    bad_words=st.lists(st.lists(u32, min_size=1, max_size=3).map(tuple), max_size=3).map(tuple),
)
requests = st.builds(
    GenerationRequest,
    request_id=text.map(RequestId),
    prompt_token_ids=st.lists(u32, max_size=8).map(tuple),
    sampling=sampling,
    cache_salt=st.none() | text,
    lora_id=st.none() | st.integers(-(2**63), 2**63 - 1),
    priorities=st.lists(st.builds(PriorityRange, u32, u32, u32, st.none() | finite), max_size=3).map(tuple),
    multimodal=st.lists(st.builds(MultimodalSpan, st.binary(max_size=8), u32, u32), max_size=2).map(tuple),
    block_keys=st.lists(st.binary(min_size=32, max_size=32), max_size=3).map(tuple),
)
logprobs = st.builds(TokenLogprob, u32, finite, st.lists(st.tuples(u32, finite), max_size=3).map(tuple))
outputs = st.builds(
    RequestOutput,
    request_id=text.map(RequestId), index=u32, token_ids=st.lists(u32, max_size=4).map(tuple), text=text,
    logprobs=st.lists(logprobs, max_size=2).map(tuple),
    finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]),
    num_prompt_tokens=u32, num_cached_tokens=u32, error=st.none() | text, error_param=st.none() | text,
    prompt_logprobs=st.lists(logprobs, max_size=2).map(tuple),
)


@given(requests)
def test_request_round_trips(request: GenerationRequest) -> None:
    wire = convert.request_to_proto(request).SerializeToString()
    assert convert.request_from_proto(request_pb2.GenerateRequest.FromString(wire)) == request


@given(outputs)
def test_output_round_trips(output: RequestOutput) -> None:
    wire = convert.output_to_proto(output).SerializeToString()
    assert convert.output_from_proto(request_pb2.RequestOutput.FromString(wire)) == output


def test_stats_and_info_round_trip() -> None:
    stats = EngineStats(1, 2, 3, 4, 5, 6, 7, 8, 9)
    info = ModelInfo("m", 2048, 16, "sha256-v1", WorkerRole.PREFILL, 49152, (0, 2))
    assert convert.stats_from_proto(convert.stats_to_proto(stats)) == stats
    assert convert.info_from_proto(convert.info_to_proto(info)) == info
    with_loras = dataclasses.replace(info, lora_enabled=True, max_loras=4, lora_adapters=(
        LoraAdapterInfo("sql", 2**63 - 1, "/a/sql"), LoraAdapterInfo("chat", 5, "/a/chat")))
    assert convert.info_from_proto(convert.info_to_proto(with_loras)) == with_loras


def test_handshake_hellos_carry_each_side_s_adapters() -> None:
    hello = Hello(WorkerId("d"), b"meta", "dep", b"key", frozenset({3, 2**63 - 1}))
    assert kv_transfer.hello_from_request(kv_transfer.hello_to_request(hello)) == hello
    reply = Hello(WorkerId("p"), b"meta", "dep", lora_ids=frozenset({5}))
    assert kv_transfer.hello_from_reply(kv_transfer.hello_to_reply(reply)) == reply


def test_detokenization_flags_left_unset_by_an_older_router_mean_vllms_defaults() -> None:
    params = convert.sampling_from_proto(request_pb2.SamplingParams(max_tokens=3))
    assert (params.skip_special_tokens, params.spaces_between_special_tokens, params.prompt_logprobs) == (
        True, True, None)


def test_request_without_sampling_gets_sampling_defaults() -> None:
    message = request_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2])
    assert convert.request_from_proto(message) == GenerationRequest(RequestId("r"), (1, 2))


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (GenerationRequest(RequestId("r"), (1, -5)), "prompt_token_ids"),
        (GenerationRequest(RequestId("r"), (2**32,)), "prompt_token_ids"),
        (GenerationRequest(RequestId("r"), (1,), SamplingParams(top_k=-1)), "sampling"),
        (GenerationRequest(RequestId("r"), (1,), SamplingParams(logit_bias=((-3, 1.0),))), "logit_bias"),
        (GenerationRequest(RequestId("r"), (1,), SamplingParams(bad_words=((1, 2**32),))), "bad_words"),
        (GenerationRequest(RequestId("r"), (1,), priorities=(PriorityRange(-1, 4, 50),)), "priorities"),
    ],
)
def test_values_protobuf_cannot_carry_are_invalid_requests(request_: GenerationRequest, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        convert.request_to_proto(request_)
    assert caught.value.param == param


def test_unknown_finish_reason_is_refused_before_sending() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        convert.output_to_proto(RequestOutput(RequestId("r"), 0, (1,), "x", finish_reason="done"))
    assert caught.value.param == "finish_reason"


def test_enum_values_from_a_newer_worker_are_worker_errors() -> None:
    with pytest.raises(WorkerError, match="finish_reason=9"):
        convert.output_from_proto(request_pb2.RequestOutput(request_id="r", finish_reason=9))
    with pytest.raises(WorkerError, match="role=0"):
        convert.info_from_proto(worker_pb2.ModelInfo(model_name="m"))


@pytest.mark.parametrize(("prefill_worker", "prefill_worker_id"),
                         [(None, None), ("10.0.0.7:50051", None), ("10.0.0.7:50051", "prefill-0/pod-a")])
def test_prefill_worker_and_its_id_round_trip(prefill_worker: str | None, prefill_worker_id: str | None) -> None:
    message = convert.request_to_proto(GenerationRequest(RequestId("r"), (1,)), prefill_worker, prefill_worker_id)
    assert convert.prefill_worker_from_proto(message) == prefill_worker
    assert convert.prefill_worker_id_from_proto(message) == prefill_worker_id


def test_sampling_without_processor_fields_means_none_of_them() -> None:
    params = convert.sampling_from_proto(request_pb2.SamplingParams(max_tokens=4, temperature=0.5, top_p=1.0, n=1))
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (params.logit_bias, params.min_tokens, params.bad_words) == ((), 0, ())
