"""The shared transport bookkeeping, driven through the fake: happy paths and failure paths."""
from dataclasses import replace

import pytest
import torch

from pdserve.common.errors import ConfigError, IncompatiblePeerError, InvalidRequestError, TransferError
from pdserve.common.ids import BlockId, WorkerId
from pdserve.transfer.fake import FakeFabric, FakeTransport, Fault
from pdserve.transfer.interface import Notification, TransferState
from pdserve.transfer.layout import KvLayoutSpec

SPEC = KvLayoutSpec("m", "bfloat16", num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=2)
P, D = WorkerId("prefill"), WorkerId("decode")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_kv(num_blocks: int, seed: int) -> torch.Tensor:
    """(N, L, 2, tpb, kvh, hd) of seeded random bf16 values."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *SPEC.block_shape, generator=generator).to(torch.bfloat16)


def ids(*block_ids: int) -> list[BlockId]:
    return [BlockId(i) for i in block_ids]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


@pytest.fixture
def prefill(fabric: FakeFabric, clock: Clock) -> FakeTransport:
    return FakeTransport(P, make_kv(8, seed=1), SPEC, fabric, clock)


@pytest.fixture
def decode(fabric: FakeFabric, prefill: FakeTransport) -> FakeTransport:
    decode = FakeTransport(D, make_kv(16, seed=2), SPEC, fabric)
    prefill.add_peer(D, decode.local_metadata())
    return decode


def run(transport: FakeTransport, handle) -> None:
    assert transport.poll(handle) is TransferState.PENDING
    transport.wait(handle)
    transport.release(handle)


def test_write_lands_blocks_in_place_and_notifies_after(prefill: FakeTransport, decode: FakeTransport) -> None:
    before = decode.kv.clone()
    handle = prefill.write_blocks(D, ids(3, 0, 7), ids(9, 2, 14), b"req-1", timeout_s=5)
    assert (handle.peer_id, handle.num_blocks, handle.deadline) == (D, 3, 105.0)
    assert decode.drain_notifications() == []
    run(prefill, handle)
    expected = before.clone()
    expected[[9, 2, 14]] = prefill.kv[[3, 0, 7]]
    assert decode.kv.view(torch.uint8).equal(expected.view(torch.uint8))
    assert decode.drain_notifications() == [Notification(P, b"req-1")]
    assert decode.drain_notifications() == []
    assert [t.is_released for t in prefill.posted] == [True]


def test_a_write_of_some_layers_lands_only_their_k_and_v(prefill: FakeTransport, decode: FakeTransport) -> None:
    before = decode.kv.clone()
    handle = prefill.write_blocks(D, ids(3, 0), ids(9, 2), b"", timeout_s=5, layers=[[1], [0, 1]])
    assert handle.num_blocks == 2
    run(prefill, handle)
    expected = before.clone()
    expected[9, 1] = prefill.kv[3, 1]  # (L, 2, tpb, kvh, hd) per block: layer 1's K and V
    expected[2] = prefill.kv[0]
    assert decode.kv.view(torch.uint8).equal(expected.view(torch.uint8))


def test_bad_layers_post_nothing(prefill: FakeTransport, decode: FakeTransport) -> None:
    with pytest.raises(InvalidRequestError, match="layers"):
        prefill.write_blocks(D, ids(3), ids(9), b"", timeout_s=5, layers=[[2]])  # SPEC has 2 layers
    assert prefill.posted == []


def test_read_copies_from_the_peer_and_empty_notify_sends_nothing(prefill: FakeTransport,
                                                                  decode: FakeTransport) -> None:
    handle = prefill.read_blocks(D, ids(15, 1), ids(4, 5), b"", timeout_s=5)
    run(prefill, handle)
    assert prefill.kv[[4, 5]].view(torch.uint8).equal(decode.kv[[15, 1]].view(torch.uint8))
    assert decode.drain_notifications() == []


def test_injected_failure_fails_the_transfer_with_its_reason_until_healed(fabric: FakeFabric, prefill: FakeTransport,
                                                             decode: FakeTransport) -> None:
    before = decode.kv.clone()
    fabric.inject(D, Fault.FAIL)
    handle = prefill.write_blocks(D, ids(1), ids(1), b"req-1", timeout_s=5)
    assert prefill.poll(handle) is TransferState.FAILED
    with pytest.raises(TransferError) as raised:
        prefill.wait(handle)
    assert str(raised.value) == "transfer 0 to 'decode' failed: injected failure on transfer with 'decode'"
    prefill.release(handle)
    assert decode.kv.equal(before)
    assert decode.drain_notifications() == []
    fabric.heal(D)
    run(prefill, prefill.write_blocks(D, ids(1), ids(1), b"req-1", timeout_s=5))
    assert decode.drain_notifications() == [Notification(P, b"req-1")]


def test_a_stalled_transfer_fails_at_its_deadline_and_is_cancelled(fabric: FakeFabric, clock: Clock,
                                                                    prefill: FakeTransport,
                                                                    decode: FakeTransport) -> None:
    fabric.inject(D, Fault.STALL)
    handle = prefill.write_blocks(D, ids(1), ids(1), b"req-1", timeout_s=2.5)
    clock.now = 102.4
    assert prefill.poll(handle) is TransferState.PENDING
    clock.now = 102.5
    assert prefill.poll(handle) is TransferState.FAILED
    assert prefill.posted[0].is_released
    with pytest.raises(TransferError, match="^transfer 0 to 'decode' failed: timed out$"):
        prefill.wait(handle)


def test_wait_on_a_stalled_transfer_is_bounded_by_the_real_clock(fabric: FakeFabric) -> None:
    prefill = FakeTransport(P, make_kv(8, seed=1), SPEC, fabric)
    decode = FakeTransport(D, make_kv(8, seed=2), SPEC, fabric)
    prefill.add_peer(D, decode.local_metadata())
    fabric.inject(D, Fault.STALL)
    handle = prefill.write_blocks(D, ids(1), ids(1), b"", timeout_s=0.05)
    with pytest.raises(TransferError, match="timed out"):
        prefill.wait(handle)


def test_peer_vanishing_mid_transfer_fails_it_and_later_posts_raise(fabric: FakeFabric, prefill: FakeTransport,
                                                                    decode: FakeTransport) -> None:
    handle = prefill.write_blocks(D, ids(1), ids(1), b"", timeout_s=5)
    assert prefill.poll(handle) is TransferState.PENDING
    fabric.vanish(D)
    assert prefill.poll(handle) is TransferState.FAILED
    with pytest.raises(TransferError, match="vanished mid-transfer"):
        prefill.wait(handle)
    with pytest.raises(TransferError) as raised:
        prefill.write_blocks(D, ids(2), ids(2), b"", timeout_s=5)
    assert str(raised.value) == "peer 'decode' disconnected"
    assert len(prefill.posted) == 1


def test_remove_peer_fails_its_pending_transfers(prefill: FakeTransport, decode: FakeTransport) -> None:
    handle = prefill.write_blocks(D, ids(1), ids(1), b"", timeout_s=5)
    prefill.remove_peer(D)
    prefill.remove_peer(D)
    assert prefill.poll(handle) is TransferState.FAILED
    with pytest.raises(TransferError, match="^transfer 0 to 'decode' failed: peer 'decode' was removed$"):
        prefill.wait(handle)
    assert prefill.posted[0].is_released
    with pytest.raises(TransferError, match="^unknown peer 'decode': add_peer first$"):
        prefill.write_blocks(D, ids(1), ids(1), b"", timeout_s=5)


def test_add_peer_is_idempotent_and_new_metadata_replaces_the_old(fabric: FakeFabric, prefill: FakeTransport,
                                                                  decode: FakeTransport) -> None:
    handle = prefill.write_blocks(D, ids(1), ids(1), b"", timeout_s=5)
    prefill.add_peer(D, decode.local_metadata())
    assert prefill.poll(handle) is TransferState.PENDING
    restarted = FakeTransport(D, make_kv(32, seed=3), SPEC, fabric)
    prefill.add_peer(D, restarted.local_metadata())
    assert prefill.poll(handle) is TransferState.FAILED
    run(prefill, prefill.write_blocks(D, ids(0), ids(31), b"", timeout_s=5))
    assert restarted.kv[31].equal(prefill.kv[0])


def test_incompatible_or_misnamed_peer_is_refused_and_not_added(fabric: FakeFabric,
                                                                prefill: FakeTransport) -> None:
    odd_spec = replace(SPEC, head_dim=8)
    odd = FakeTransport(D, torch.zeros(4, *odd_spec.block_shape, dtype=torch.bfloat16), odd_spec, fabric)
    with pytest.raises(IncompatiblePeerError) as raised:
        prefill.add_peer(D, odd.local_metadata())
    assert str(raised.value) == ("peer 'decode' has an incompatible KV layout; head_dim: local=4 remote=8; "
                                 "bytes_per_block: local=128 remote=256")
    with pytest.raises(IncompatiblePeerError, match="^metadata for peer 'decode-1' names worker 'decode'$"):
        prefill.add_peer(WorkerId("decode-1"), odd.local_metadata())
    with pytest.raises(IncompatiblePeerError, match="^peer 'prefill' is this worker itself$"):
        prefill.add_peer(P, prefill.local_metadata())
    with pytest.raises(TransferError, match="unknown peer 'decode'"):
        prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)


def test_unreachable_peer_is_not_added(fabric: FakeFabric, prefill: FakeTransport) -> None:
    gone = FakeTransport(D, make_kv(4, seed=4), SPEC, fabric)
    metadata = gone.local_metadata()
    fabric.vanish(D)
    with pytest.raises(TransferError, match="^peer 'decode' is unreachable$"):
        prefill.add_peer(D, metadata)
    with pytest.raises(TransferError, match="unknown peer"):
        prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan"), "5", True])
def test_bad_timeout_is_refused_before_anything_is_posted(prefill: FakeTransport, decode: FakeTransport,
                                                          timeout_s: object) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=timeout_s)
    assert raised.value.param == "timeout_s"
    assert prefill.posted == []


def test_a_write_whose_time_ran_out_waiting_for_the_transport_is_never_posted(
        prefill: FakeTransport, decode: FakeTransport, clock: Clock) -> None:
    class SlowLock:  # another thread holds the transport's lock for 6 s of the clock
        def __enter__(self) -> None:
            clock.now += 6.0

        def __exit__(self, *exc_info: object) -> None:
            pass

    prefill._lock = SlowLock()
    with pytest.raises(TransferError, match="not posted: its 5 s passed waiting for the transport"):
        prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)
    assert prefill.posted == []


def test_notify_must_be_bytes(prefill: FakeTransport, decode: FakeTransport) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        prefill.write_blocks(D, ids(0), ids(0), "req-1", timeout_s=5)
    assert (str(raised.value), raised.value.param) == ("notify='req-1': must be bytes", "notify")
    assert prefill.posted == []


def test_bad_block_ids_change_nothing(prefill: FakeTransport, decode: FakeTransport) -> None:
    with pytest.raises(InvalidRequestError, match=r"remote_block_ids \[16\] out of range \[0, 16\)"):
        prefill.write_blocks(D, ids(0), ids(16), b"", timeout_s=5)
    assert prefill.posted == []
    handle = prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)
    assert handle.transfer_id == 0


def test_released_handles_are_no_longer_held(prefill: FakeTransport, decode: FakeTransport) -> None:
    handle = prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)
    prefill.release(handle)
    assert prefill.posted[0].is_released
    with pytest.raises(TransferError, match="^transfer 0 is not held"):
        prefill.poll(handle)
    with pytest.raises(TransferError, match="^transfer 0 is not held"):
        prefill.release(handle)


def test_close_cancels_everything_is_idempotent_and_refuses_later_use(prefill: FakeTransport,
                                                                      decode: FakeTransport) -> None:
    prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)
    done = prefill.write_blocks(D, ids(1), ids(1), b"", timeout_s=5)
    prefill.wait(done)
    prefill.close()
    prefill.close()
    assert [t.is_released for t in prefill.posted] == [True, True]
    with pytest.raises(TransferError, match="^transport of worker 'prefill' is closed$"):
        prefill.write_blocks(D, ids(0), ids(0), b"", timeout_s=5)
    with pytest.raises(TransferError, match="closed"):
        prefill.local_metadata()


@pytest.mark.parametrize(("kv", "message"), [
    (torch.zeros(4, 2, 2, 2, 2, 8, dtype=torch.bfloat16),
     "kv_tensor.shape=(4, 2, 2, 2, 2, 8): expected (N, *(2, 2, 2, 2, 4))"),
    (torch.zeros(4, 2, 2, 2, 2, 4), "kv_tensor.dtype='float32': spec says bfloat16"),
    (torch.zeros(2, 4, 2, 2, 2, 4, dtype=torch.bfloat16).transpose(0, 1),  # (4, 2, 2, 2, 2, 4)
     "kv_tensor='non-contiguous': must be contiguous (one region per block)"),
])
def test_a_tensor_that_does_not_match_the_spec_is_refused(fabric: FakeFabric, kv: torch.Tensor,
                                                          message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        FakeTransport(P, kv, SPEC, fabric)
    assert str(raised.value) == message
