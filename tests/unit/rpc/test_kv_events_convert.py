"""KV events, batches and snapshots ↔ protobuf: exact round trips; unknown values are typed errors."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.common.errors import WorkerError
from pdserve.common.ids import BlockHash
from pdserve.kvcache import AllCleared, BlockRemoved, BlockStored, BlockUpdated, Tier
from pdserve.rpc import kv_events as convert
from pdserve.rpc.gen import kv_events_pb2 as pb

seqs = st.integers(0, 2**64 - 1)
hashes = st.binary(min_size=32, max_size=32).map(BlockHash)
tiers = st.sampled_from(list(Tier))
priorities = st.integers(0, 100)
events = st.one_of(
    st.builds(BlockStored, seqs, st.lists(hashes, max_size=3).map(tuple), st.none() | hashes, tiers, priorities,
              st.none() | st.integers(-(2**63), 2**63 - 1)),
    st.builds(BlockRemoved, seqs, st.lists(hashes, max_size=3).map(tuple), tiers),
    st.builds(BlockUpdated, seqs, hashes, tiers, priorities, st.none() | tiers),
    st.builds(AllCleared, seqs),
)


@given(st.text(max_size=8), st.lists(events, max_size=4))
def test_batches_round_trip(epoch: str, batch: list) -> None:
    wire = convert.batch_to_proto(epoch, batch).SerializeToString()
    assert convert.batch_from_proto(pb.KvEventBatch.FromString(wire)) == convert.EventBatch(epoch, tuple(batch))


@given(st.builds(convert.KvSnapshot, st.text(max_size=8), seqs, st.lists(st.tuples(hashes, tiers), max_size=4).map(tuple)))
def test_snapshots_round_trip(snapshot: convert.KvSnapshot) -> None:
    wire = convert.snapshot_to_proto(snapshot).SerializeToString()
    assert convert.snapshot_from_proto(pb.SnapshotResponse.FromString(wire)) == snapshot


def test_an_unknown_tier_or_an_event_without_kind_is_a_worker_error() -> None:
    with pytest.raises(WorkerError, match="storage tier 0"):
        convert.event_from_proto(pb.KvEvent(seq=1, removed=pb.BlockRemoved(block_hashes=[b"x"])))
    with pytest.raises(WorkerError, match="seq=4 with no kind"):
        convert.event_from_proto(pb.KvEvent(seq=4))
