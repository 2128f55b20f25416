"""`KvTransfer.Prefill` past the handshake: this test process is a decode worker's NIXL peer (its own
KV tensor, a real handshake), then orders the prefill worker to write out-of-range, mismatched and
random block lists into it (each with a valid write grant, so it reaches the block checks; one
without a valid grant must be refused first). Every order ends within its deadline with a status;
a refused order writes nothing, and afterwards the prefill worker holds no blocks and still
serves correctly."""
import dataclasses
import math
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.ids import WorkerId
from pdserve.rpc import kv_transfer as convert
from pdserve.rpc.gen import kv_transfer_pb2, kv_transfer_pb2_grpc, request_pb2, worker_pb2, worker_pb2_grpc
from pdserve.rpc.status import MAX_DETAILS_CHARS
from pdserve.transfer.handshake import PeerMetadata
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.worker.kv.write_grants import grant_of, new_nonce, new_order_key
from tests.fuzz.worker_calls import FuzzStack, assert_worker_sound

pytestmark = pytest.mark.integration
PEER = WorkerId("fuzz-decode")
NUM_PEER_BLOCKS = 16
CALL_TIMEOUT_S = 30.0
U32 = 2**32 - 1
MAX_EXAMPLES = 50
ORDER_KEY = new_order_key()  # sent in our handshake; every order below carries a grant under it


@dataclasses.dataclass
class DecodePeer:
    kv: torch.Tensor  # (NUM_PEER_BLOCKS, L, 2, tpb, kvh, hd), written only by the prefill worker
    tokens_per_block: int
    metadata: bytes  # what the handshake sent


@pytest.fixture(scope="module")
def prefill_stub(fuzz_stack: FuzzStack) -> Iterator[kv_transfer_pb2_grpc.KvTransferStub]:
    with grpc.insecure_channel(fuzz_stack.prefill_worker) as channel:
        yield kv_transfer_pb2_grpc.KvTransferStub(channel)


@pytest.fixture(scope="module")
def decode_peer(fuzz_stack: FuzzStack, prefill_stub: kv_transfer_pb2_grpc.KvTransferStub) -> Iterator[DecodePeer]:
    from pdserve.transfer.nixl_transport import NixlTransport

    with grpc.insecure_channel(fuzz_stack.prefill_worker) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10).info
    spec = KvLayoutSpec(info.model_name, "float32", num_layers=2, num_kv_heads=2, head_dim=16,
                        tokens_per_block=info.tokens_per_block)  # the tiny checkpoint's layout
    kv = torch.zeros(NUM_PEER_BLOCKS, *spec.block_shape)
    transport = NixlTransport(PEER, kv, spec)
    stop = threading.Event()

    def progress() -> None:  # without NIXL's own progress thread, connections and writes need our polls
        while not stop.wait(0.005):
            transport.drain_notifications()

    thread = threading.Thread(target=progress, daemon=True)
    thread.start()
    try:
        metadata = transport.local_metadata()
        prefill_stub.Handshake(kv_transfer_pb2.HandshakeRequest(worker_id=PEER, metadata=metadata,
                                                                order_key=ORDER_KEY), timeout=30)
        yield DecodePeer(kv, info.tokens_per_block, metadata)
    finally:
        stop.set()
        thread.join(timeout=5)
        transport.close()


def order(request_id: str, num_tokens: int, dest_block_ids: list[int], first_block: int = 0,
          timeout_s: float = 10.0) -> kv_transfer_pb2.PrefillRequest:
    request = request_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[(7 * i) % 40000 + 100 for i in range(num_tokens)],
        sampling=request_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, n=1))
    message = kv_transfer_pb2.PrefillRequest(request=request, decode_worker_id=PEER, first_block=first_block,
                                             dest_block_ids=dest_block_ids, deadline=time.time() + timeout_s,
                                             nonce=new_nonce())
    message.grant = grant_of(ORDER_KEY, convert.order_from_proto(message))
    return message


def call_prefill(stub: kv_transfer_pb2_grpc.KvTransferStub,
                 message: kv_transfer_pb2.PrefillRequest) -> tuple[grpc.StatusCode, str]:
    try:
        stub.Prefill(message, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_a_well_formed_order_writes_the_peers_blocks(prefill_stub, decode_peer: DecodePeer) -> None:
    """The fuzzing below reaches the write: a correct order succeeds and fills the named blocks."""
    num_tokens = 3 * decode_peer.tokens_per_block
    assert call_prefill(prefill_stub, order("well-formed", num_tokens, [5, 6])) == (grpc.StatusCode.OK, "")
    written = [i for i in range(NUM_PEER_BLOCKS) if decode_peer.kv[i].abs().sum() > 0]
    assert written == [5, 6]
    decode_peer.kv.zero_()


@pytest.mark.parametrize("grant", [b"", b"x" * 32, "another key", "other blocks"])
def test_an_order_without_a_valid_grant_is_refused_and_writes_nothing(prefill_stub, decode_peer: DecodePeer,
                                                                     grant: bytes | str) -> None:
    message = order("ungranted", 3 * decode_peer.tokens_per_block, [5, 6])
    if grant == "another key":
        message.grant = grant_of(new_order_key(), convert.order_from_proto(message))
    elif grant == "other blocks":
        message.dest_block_ids[:] = [7, 8]  # the grant was for 5 and 6
    else:
        message.grant = grant
    assert call_prefill(prefill_stub, message) == (
        grpc.StatusCode.PERMISSION_DENIED, "order for 'ungranted' carries no valid write grant of 'fuzz-decode'")
    assert int(torch.count_nonzero(decode_peer.kv)) == 0


@pytest.mark.parametrize(("first_block", "dest_block_ids", "code"), [
    (0, [NUM_PEER_BLOCKS], grpc.StatusCode.INVALID_ARGUMENT),
    (0, [U32], grpc.StatusCode.INVALID_ARGUMENT),
    (0, [0, 0], grpc.StatusCode.INVALID_ARGUMENT),  # two blocks into one
    (0, [1, 2, 3, 4], grpc.StatusCode.INVALID_ARGUMENT),  # more blocks than the prompt has
    (U32, [1], grpc.StatusCode.INVALID_ARGUMENT),
    (3, [1], grpc.StatusCode.INVALID_ARGUMENT),
    (0, [], grpc.StatusCode.INVALID_ARGUMENT),
], ids=["past-the-end", "u32", "duplicate", "too-many", "first-u32", "first-past-prompt", "none"])
def test_out_of_range_block_lists_are_refused_and_write_nothing(prefill_stub, decode_peer: DecodePeer,
                                                                first_block: int, dest_block_ids: list[int],
                                                                code: grpc.StatusCode) -> None:
    message = order(f"oor-{first_block}-{len(dest_block_ids)}", 2 * decode_peer.tokens_per_block, dest_block_ids,
                    first_block)
    answered, details = call_prefill(prefill_stub, message)
    assert answered == code, details[:500]
    assert int(torch.count_nonzero(decode_peer.kv)) == 0


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, -0.0, math.nan, math.inf, -math.inf, 601.0, 1e300])
def test_nonsense_deadlines_are_refused(prefill_stub, decode_peer: DecodePeer, timeout_s: float) -> None:
    message = order(f"timeout-{timeout_s}", 2 * decode_peer.tokens_per_block, [1], timeout_s=timeout_s)
    answered, details = call_prefill(prefill_stub, message)
    assert answered == grpc.StatusCode.INVALID_ARGUMENT, details[:500]


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_tokens=st.integers(1, 100), first_block=st.one_of(st.integers(0, 8), st.just(U32)),
       dest_block_ids=st.lists(st.one_of(st.integers(0, 2 * NUM_PEER_BLOCKS), st.just(U32)), max_size=8),
       timeout_s=st.one_of(st.floats(0.01, 10.0), st.just(0.0)))
def test_random_orders_end_with_a_status(prefill_stub, decode_peer: DecodePeer, num_tokens: int, first_block: int,
                                         dest_block_ids: list[int], timeout_s: float) -> None:
    code, details = call_prefill(prefill_stub, order("random", num_tokens, dest_block_ids, first_block, timeout_s))
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.INTERNAL), details[:500]
    assert len(details) <= MAX_DETAILS_CHARS


def test_a_peer_claiming_more_blocks_than_it_registered_is_written_nowhere_else(
        prefill_stub, decode_peer: DecodePeer) -> None:
    """A handshake whose header claims 1000 blocks over the same registered memory is refused, or
    writing past the registered tensor fails; either way the worker carries on."""
    decode_peer.kv.zero_()  # the random orders above wrote some blocks
    claimed = dataclasses.replace(PeerMetadata.decode(decode_peer.metadata), num_blocks=1000)
    hostile = kv_transfer_pb2.HandshakeRequest(worker_id=PEER, metadata=claimed.encode(), order_key=ORDER_KEY)
    try:
        prefill_stub.Handshake(hostile, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        assert err.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), err.details()
    else:
        code, details = call_prefill(prefill_stub, order("past-registered", 2 * decode_peer.tokens_per_block, [999]))
        assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), details
    assert int(torch.count_nonzero(decode_peer.kv)) == 0


def test_the_prefill_worker_is_sound_after_the_transfer_fuzz(fuzz_stack: FuzzStack) -> None:
    baseline = fuzz_stack.baselines[fuzz_stack.prefill_worker]
    assert_worker_sound(fuzz_stack.prefill_worker, baseline.integrity, baseline.tokens)
