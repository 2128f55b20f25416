"""The router's prefix index: events in, overlaps out; gaps and unsynced workers; removal; salts."""
from pdserve.common.ids import BlockHash, WorkerId
from pdserve.kvcache import AllCleared, BlockRemoved, BlockStored, BlockUpdated, Tier, hash_request_blocks
from pdserve.router.routing.prefix_index import ApplyResult, Overlap, PrefixIndex

A, B = WorkerId("a:1"), WorkerId("b:2")
TPB = 4
PROMPT = list(range(100, 120))  # 5 full blocks
KEYS = hash_request_blocks(PROMPT, TPB)


def stored(seq: int, keys: list[BlockHash], tier: Tier = Tier.DEVICE) -> BlockStored:
    return BlockStored(seq, tuple(keys), None, tier, 35, None)


def synced_index(*workers: WorkerId) -> PrefixIndex:
    index = PrefixIndex()
    for worker in workers:
        index.load_snapshot(worker, [], next_seq=0)
    return index


def test_overlap_is_the_leading_run_each_worker_holds() -> None:
    index = synced_index(A, B)
    assert index.apply(A, [stored(0, KEYS[:3])]) is ApplyResult.APPLIED
    assert index.apply(B, [stored(0, KEYS[:1]), stored(1, KEYS[2:5])]) is ApplyResult.APPLIED  # misses block 1
    assert index.overlaps(KEYS, [A, B]) == {A: Overlap(num_device=3), B: Overlap(num_device=1)}


def test_overlap_counts_blocks_by_tier() -> None:
    index = synced_index(A)
    index.apply(A, [stored(0, KEYS[:2]), stored(1, KEYS[2:3], Tier.HOST), stored(2, KEYS[3:4], Tier.DISK)])
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=2, num_host=1, num_disk=1)}


def test_updated_moves_a_block_between_tiers_and_removed_drops_it_only_from_its_tier() -> None:
    index = synced_index(A)
    index.apply(A, [stored(0, KEYS[:2])])
    index.apply(A, [BlockUpdated(1, KEYS[1], Tier.HOST, 35)])
    assert index.tier_of(A, KEYS[1]) is Tier.HOST
    index.apply(A, [BlockRemoved(2, (KEYS[1],), Tier.DEVICE)])  # not in that tier: still held
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=1, num_host=1)}
    index.apply(A, [BlockRemoved(3, (KEYS[1],), Tier.HOST)])
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=1)}
    assert index.num_blocks(A) == 1


def test_updated_for_an_unknown_block_adds_nothing() -> None:
    index = synced_index(A)
    index.apply(A, [BlockUpdated(0, KEYS[0], Tier.HOST, 80)])
    assert index.num_blocks(A) == 0


def test_all_cleared_drops_only_that_workers_blocks() -> None:
    index = synced_index(A, B)
    index.apply(A, [stored(0, KEYS[:2])])
    index.apply(B, [stored(0, KEYS[:2])])
    index.apply(A, [AllCleared(1)])
    assert index.overlaps(KEYS, [A, B]) == {A: Overlap(), B: Overlap(num_device=2)}


def test_events_before_the_snapshot_are_skipped_and_a_gap_stops_applying() -> None:
    index = PrefixIndex()
    index.load_snapshot(A, [(KEYS[0], Tier.DEVICE)], next_seq=5)
    assert index.apply(A, [stored(3, KEYS[3:4]), stored(5, KEYS[1:2])]) is ApplyResult.APPLIED
    assert index.apply(A, [stored(6, KEYS[2:3]), stored(8, KEYS[4:5])]) is ApplyResult.GAP
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=3)}  # seq 3 skipped, seq 8 not applied
    assert index.apply(A, [stored(7, KEYS[3:4])]) is ApplyResult.APPLIED  # the next expected one still is


def test_a_worker_without_snapshot_refuses_events() -> None:
    index = PrefixIndex()
    assert index.apply(A, [stored(0, KEYS[:1])]) is ApplyResult.UNSYNCED
    assert index.num_blocks(A) == 0
    assert not index.is_synced(A)


def test_unsynced_keeps_entries_as_an_estimate_until_the_next_snapshot() -> None:
    index = synced_index(A)
    index.apply(A, [stored(0, KEYS[:3])])
    index.mark_unsynced(A)
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=3, is_synced=False)}
    assert index.apply(A, [stored(1, KEYS[3:4])]) is ApplyResult.UNSYNCED
    index.load_snapshot(A, [(KEYS[0], Tier.DEVICE)], next_seq=9)
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=1)}
    assert index.tier_of(A, KEYS[2]) is None


def test_removing_a_worker_drops_its_entries_and_keeps_the_others() -> None:
    index = synced_index(A, B)
    index.apply(A, [stored(0, KEYS[:4])])
    index.apply(B, [stored(0, KEYS[:2])])
    index.remove_worker(A)
    assert index.overlaps(KEYS, [A, B]) == {A: Overlap(is_synced=False), B: Overlap(num_device=2)}
    assert (index.num_blocks(A), index.tier_of(A, KEYS[0])) == (0, None)


def test_another_tenants_salt_never_overlaps() -> None:
    index = synced_index(A)
    index.apply(A, [stored(0, hash_request_blocks(PROMPT, TPB, cache_salt="tenant-1"))])
    same_tenant = hash_request_blocks(PROMPT, TPB, cache_salt="tenant-1")
    other_tenant = hash_request_blocks(PROMPT, TPB, cache_salt="tenant-2")
    assert index.overlaps(same_tenant, [A]) == {A: Overlap(num_device=5)}
    assert index.overlaps(other_tenant, [A]) == {A: Overlap()}
    assert index.overlaps(KEYS, [A]) == {A: Overlap()}  # no salt is a namespace of its own


def test_held_keys_extend_a_workers_run_until_each_hold_is_released() -> None:
    """A dispatched prompt's keys count as the worker's device blocks after the run its events
    gave, once per hold; released, only the events' run is left."""
    index = synced_index(A, B)
    index.apply(A, [stored(0, KEYS[:2], Tier.HOST)])
    index.hold(A, KEYS[:4])
    index.hold(A, KEYS[:3])
    index.hold(B, KEYS[1:5])  # no run from block 0: nothing counts
    assert index.overlaps(KEYS, [A, B]) == {A: Overlap(num_device=2, num_host=2), B: Overlap()}
    index.release(A, KEYS[:4])
    assert index.overlaps(KEYS, [A]) == {A: Overlap(num_device=1, num_host=2)}
    index.release(A, KEYS[:3])
    index.release(A, KEYS[:3])  # one release too many changes nothing
    assert index.overlaps(KEYS, [A, B]) == {A: Overlap(num_host=2), B: Overlap()}


def test_holds_on_an_unsynced_or_removed_worker() -> None:
    index = synced_index(A)
    index.hold(B, KEYS[:2])
    assert index.overlaps(KEYS, [B]) == {B: Overlap(num_device=2, is_synced=False)}
    index.hold(A, KEYS[:3])
    index.remove_worker(A)
    index.release(A, KEYS[:3])
    assert index.overlaps(KEYS, [A]) == {A: Overlap(is_synced=False)}
