"""The lower tiers' bookkeeping: blocks the device evicts move down to the host tier by priority,
and on to the disk tier; prefixes continue into them, phase 2 of the claim onboards them, and the
queued copies, made in order, leave every cached block holding its own key's KV (checked against
a model of the bytes)."""
import random

from pdserve.kvcache import BlockRemoved, BlockStored, BlockUpdated, Tier
from pdserve.kvcache.lower_tier import MoveKind
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion


class Bytes:
    """What each device block and host slot holds: the key of the KV written into it."""

    def __init__(self) -> None:
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.disk: dict[bytes, bytes] = {}  # file of a key -> what it holds

    def apply(self, manager, moves: list | None = None) -> list:
        moves = manager.drain_tier_moves() if moves is None else moves
        for move in moves:
            if move.kind is MoveKind.OFFLOAD:
                self.host[move.slot] = self.device.get(move.block_id)
            elif move.kind is MoveKind.ONBOARD:
                self.device[move.block_id] = self.host.get(move.slot)
            elif move.kind is MoveKind.SPILL:
                self.disk[move.block_hash] = self.host.get(move.slot)
            elif move.kind is MoveKind.LOAD:
                self.device[move.block_id] = self.disk.get(move.block_hash)
            else:
                self.disk.pop(move.block_hash, None)
        return moves

    def check(self, manager) -> None:
        for block_hash, block in manager.pool.cached.items():
            assert self.device.get(block.block_id) == block_hash, f"device block {block.block_id}"
        for block_hash, entry in manager.host.entries.items():
            assert self.host.get(entry.slot) == block_hash, f"host slot {entry.slot}"
        if manager.disk is not None:
            for block_hash in manager.disk.entries:
                assert self.disk.get(block_hash) == block_hash, "disk file"
            assert set(self.disk) == set(manager.disk.entries)  # deleted files are gone


def serve(manager, data: "Bytes", request) -> int:
    """Claim, make the copies, compute (write) the rest, publish, free; the cached tokens."""
    claim = manager.add_sequence(request)
    data.apply(manager)
    hashes = request.block_hashes(manager.tokens_per_block)
    for i, block_id in enumerate(claim.block_ids):
        if i * manager.tokens_per_block >= claim.num_cached_tokens and i < len(hashes):
            data.device[block_id] = hashes[i]
    manager.mark_computed(request.request_id, len(request.token_ids) - claim.num_cached_tokens)
    manager.free(request.request_id)
    manager.check_integrity()
    data.check(manager)
    return claim.num_cached_tokens


def test_an_evicted_block_moves_down_and_a_prefix_hit_comes_back_from_the_host():
    m, data = make_manager(num_blocks=3, num_host_blocks=4), Bytes()
    a = make_request("a", range(9))  # two full blocks cached, then one partial
    assert serve(m, data, a) == 0
    m.drain_events()
    assert serve(m, data, make_request("b", range(100, 109))) == 0  # evicts a's two blocks
    moved = [e for e in m.drain_events() if isinstance(e, BlockUpdated)]
    assert [(e.old_tier, e.tier, e.block_hash) for e in moved] == [
        (Tier.DEVICE, Tier.HOST, h) for h in a.block_hashes(4)[:2][::-1]]
    analysis = m.analyze_prefix_reuse(make_request("a2", range(9)))
    assert (analysis.num_cached_tokens, analysis.num_onboard_blocks, analysis.num_cached_by_tier) == (8, 2, (0, 2, 0))
    assert serve(m, data, make_request("a2", range(9))) == 8  # cached tokens count every tier
    events = m.drain_events()
    assert [(e.old_tier, e.tier, e.block_hash) for e in events
            if isinstance(e, BlockUpdated) and e.tier is Tier.DEVICE] == [(Tier.HOST, Tier.DEVICE, h)
                                                                          for h in a.block_hashes(4)[:2]]
    assert not [e for e in events if isinstance(e, BlockStored) and e.block_hashes[0] in a.block_hashes(4)[:2]]
    assert (m.tiers.num_offloaded, m.tiers.num_onboarded) == (4, 2)  # b's blocks moved down to make room
    assert m.tiers.hit_tokens == [0, 8, 0]


def test_blocks_below_the_offload_priority_are_dropped():
    m, data = make_manager(num_blocks=4, num_host_blocks=4, secondary_offload_min_priority=50), Bytes()
    serve(m, data, make_request("low", range(5), priorities=[(0, 5, 10)]))
    serve(m, data, make_request("high", range(100, 105), priorities=[(0, 5, 80)]))
    m.drain_events()
    serve(m, data, make_request("x", range(500, 513)))  # four blocks: evicts both, the lower priority first
    events = [e for e in m.drain_events() if not isinstance(e, BlockStored)]
    assert [(type(e), e.tier) for e in events] == [(BlockRemoved, Tier.DEVICE), (BlockUpdated, Tier.HOST)]
    assert len(m.host.entries) == 1 and m.pool.num_dropped_by_priority == 1
    assert m.analyze_prefix_reuse(make_request("low2", range(5))).num_cached_tokens == 0
    assert m.analyze_prefix_reuse(make_request("high2", range(100, 105))).num_cached_tokens == 4


def test_a_full_host_tier_drops_its_least_recently_used_entry_saying_so():
    m, data = make_manager(num_blocks=2, num_host_blocks=2), Bytes()
    keys = []
    for i in range(4):
        request = make_request(f"r{i}", range(100 * i, 100 * i + 5))
        keys.append(request.block_hashes(4)[0])
        serve(m, data, request)
    events = m.drain_events()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [keys[0]] and e_tier(events, keys[0]) == Tier.HOST
    assert set(m.host.entries) == {keys[1], keys[2]} and keys[3] in m.pool.cached


def e_tier(events, block_hash):
    return next(e.tier for e in events if isinstance(e, BlockRemoved) and e.block_hashes[0] == block_hash)


def test_a_batch_keeps_its_promise_when_its_own_allocation_would_push_its_host_hits_out():
    m, data = make_manager(num_blocks=5, num_host_blocks=2), Bytes()
    hit = make_request("hit", range(9))
    serve(m, data, hit)
    serve(m, data, make_request("pusher", range(100, 120)))  # 5 blocks: hit's two move down, host full
    assert set(m.host.entries) == set(hit.block_hashes(4)[:2])
    # one batch: the host hit, and a request whose allocation evicts device blocks into the full tier
    claims = m.add_sequence_batch([make_request("hit2", range(9)), make_request("big", range(200, 208))])
    data.apply(m)
    assert claims[0].num_cached_tokens == 8
    assert set(m.host.entries) == set(hit.block_hashes(4)[:2])  # pinned: not pushed out by "big"
    for block_id, block_hash in zip(claims[0].block_ids, hit.block_hashes(4)[:2]):
        assert data.device[block_id] == block_hash
    for rid in ("hit2", "big"):
        m.free(rid)
    m.check_integrity()


def test_two_requests_of_one_batch_share_the_block_onboarded_once():
    m, data = make_manager(num_blocks=4, num_host_blocks=4), Bytes()
    serve(m, data, make_request("a", range(9)))
    serve(m, data, make_request("b", range(100, 113)))  # 4 blocks: both of a's move down
    claims = m.add_sequence_batch([make_request("a2", range(9)), make_request("a3", list(range(8)) + [77])])
    moves = data.apply(m)
    assert [m.kind for m in moves].count(MoveKind.ONBOARD) == 2
    assert claims[0].block_ids[:2] == claims[1].block_ids[:2]
    for rid in ("a2", "a3"):
        m.free(rid)
    m.check_integrity()
    data.check(m)


def test_a_reset_empties_the_host_tier_and_snapshots_name_each_block_by_its_best_tier():
    m, data = make_manager(num_blocks=3, num_host_blocks=4), Bytes()
    serve(m, data, make_request("a", range(9)))
    serve(m, data, make_request("b", range(100, 109)))
    tiers = dict(m.cached_blocks_by_tier())
    assert sorted(tiers.values()) == [Tier.DEVICE] * 2 + [Tier.HOST] * 2
    assert m.reset_prefix_cache()
    assert m.cached_blocks_by_tier() == [] and not m.host.entries
    m.check_integrity()


def test_random_traffic_keeps_every_cached_block_holding_its_own_kv():
    rng = random.Random(0)
    prefixes = [list(range(1000 * p, 1000 * p + 12)) for p in range(6)]
    m, data = make_manager(num_blocks=6, num_host_blocks=5), Bytes()
    for i in range(400):
        prompt = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
        if not prompt:
            continue
        priorities = [(0, len(prompt), rng.choice([10, 35, 80]))] if rng.random() < 0.3 else []
        serve(m, data, make_request(f"r{i}", prompt, priorities=priorities))
    assert m.tiers.num_onboarded > 20 and m.tiers.num_offloaded > 20


def test_random_traffic_through_three_tiers_keeps_every_cached_block_holding_its_own_kv():
    rng = random.Random(1)
    prefixes = [list(range(1000 * p, 1000 * p + 12)) for p in range(10)]
    m, data = make_manager(num_blocks=6, num_host_blocks=4, num_disk_blocks=8), Bytes()
    for i in range(500):
        prompt = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
        priorities = [(0, len(prompt), rng.choice([10, 35, 80]))] if rng.random() < 0.3 else []
        serve(m, data, make_request(f"r{i}", prompt, priorities=priorities))
    assert m.tiers.num_spilled > 10 and m.tiers.num_loaded > 10


def test_a_block_the_host_tier_lets_go_moves_to_disk_and_comes_back_from_there():
    m, data = make_manager(num_blocks=2, num_host_blocks=1, num_disk_blocks=4), Bytes()
    first = make_request("first", range(5))
    serve(m, data, first)
    for i in range(1, 4):  # each pushes the previous block down: device -> host -> disk
        serve(m, data, make_request(f"r{i}", range(100 * i, 100 * i + 5)))
    key = first.block_hashes(4)[0]
    assert key in m.disk and key not in m.host and key not in m.pool.cached
    assert dict(m.cached_blocks_by_tier())[key] == Tier.DISK
    analysis = m.analyze_prefix_reuse(make_request("again", range(5)))
    assert (analysis.num_cached_tokens, analysis.num_cached_by_tier) == (4, (0, 0, 1))
    assert serve(m, data, make_request("again", range(5))) == 4
    assert m.tiers.num_loaded == 1 and m.tiers.hit_tokens == [0, 0, 4]


def test_blocks_found_on_disk_at_start_are_announced_and_a_corrupt_one_is_a_miss():
    corrupt = set()
    m = make_manager(num_blocks=4, num_host_blocks=2, num_disk_blocks=4, disk_verifier=lambda h: h not in corrupt)
    good, bad = make_request("good", range(5)), make_request("bad", range(100, 105))
    (good_key,), (bad_key,) = good.block_hashes(4)[:1], bad.block_hashes(4)[:1]
    corrupt.add(bad_key)
    assert m.adopt_disk_blocks([(good_key, None, 35), (bad_key, None, 35)]) == 2
    events = m.drain_events()
    assert [(type(e), e.tier) for e in events] == [(BlockStored, Tier.DISK)] * 2
    data = Bytes()
    data.disk = {good_key: good_key, bad_key: b"garbage"}
    assert serve(m, data, make_request("bad2", range(100, 105))) == 0  # a miss, never the corrupt bytes
    assert (m.tiers.num_corrupt, bad_key in m.disk, bad_key in data.disk) == (1, False, False)
    assert [(type(e), e.tier) for e in m.drain_events() if isinstance(e, BlockRemoved)] == [(BlockRemoved, Tier.DISK)]
    assert serve(m, data, make_request("good2", range(5))) == 4


def test_a_graceful_stop_writes_the_host_tier_to_disk():
    m, data = make_manager(num_blocks=2, num_host_blocks=2, num_disk_blocks=4), Bytes()
    for i in range(3):
        serve(m, data, make_request(f"r{i}", range(100 * i, 100 * i + 5)))
    assert len(m.host.entries) == 2 and not m.disk.entries
    data.apply(m, m.spill_host_tier())
    assert set(m.disk.entries) == set(m.host.entries)
    data.check(m)


def test_a_full_host_tier_drops_its_lowest_priority_entry_first_then_the_least_recent():
    m, data = make_manager(num_blocks=2, num_host_blocks=2), Bytes()
    keys = {}
    for name, start, priority in (("hot", 0, 90), ("warm", 100, 50), ("next", 200, 35), ("last", 300, 35)):
        request = make_request(name, range(start, start + 5), priorities=[(0, 5, priority)])
        keys[name] = request.block_hashes(4)[0]
        serve(m, data, request)
    # hot then warm moved down; next pushed last's predecessor down: the host tier was full, and
    # warm (priority 50) went before hot (90) although hot is older
    assert set(m.host.entries) == {keys["hot"], keys["next"]}
    assert keys["last"] in m.pool.cached
