"""The host tier's bookkeeping: blocks the device evicts move down by priority, prefixes continue
into the tier, phase 2 of the claim onboards them, and the queued copies, made in order, leave
every cached block holding its own key's KV (checked against a model of the bytes)."""
import random

from pdserve.kvcache import BlockRemoved, BlockStored, BlockUpdated, Tier
from pdserve.kvcache.host_tier import MoveKind
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion


class Bytes:
    """What each device block and host slot holds: the key of the KV written into it."""

    def __init__(self) -> None:
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}

    def apply(self, manager) -> list:
        moves = manager.drain_tier_moves()
        for move in moves:
            if move.kind is MoveKind.OFFLOAD:
                self.host[move.slot] = self.device.get(move.block_id)
            else:
                self.device[move.block_id] = self.host.get(move.slot)
        return moves

    def check(self, manager) -> None:
        for block_hash, block in manager.pool.cached.items():
            assert self.device.get(block.block_id) == block_hash, f"device block {block.block_id}"
        for block_hash, entry in manager.host.entries.items():
            assert self.host.get(entry.slot) == block_hash, f"host slot {entry.slot}"


def serve(manager, data: Bytes, request) -> int:
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
    assert [(e.tier, e.block_hash) for e in moved] == [(Tier.HOST, h) for h in a.block_hashes(4)[:2][::-1]]
    analysis = m.analyze_prefix_reuse(make_request("a2", range(9)))
    assert (analysis.num_cached_tokens, analysis.num_onboard_blocks, analysis.num_cached_by_tier) == (8, 2, (0, 2, 0))
    assert serve(m, data, make_request("a2", range(9))) == 8  # cached tokens count every tier
    events = m.drain_events()
    assert [(e.tier, e.block_hash) for e in events if isinstance(e, BlockUpdated) and e.tier is Tier.DEVICE] == [
        (Tier.DEVICE, h) for h in a.block_hashes(4)[:2]]
    assert not [e for e in events if isinstance(e, BlockStored) and e.block_hashes[0] in a.block_hashes(4)[:2]]
    assert (m.num_offloaded_blocks, m.num_onboarded_blocks) == (4, 2)  # b's blocks moved down to make room


def test_blocks_below_the_offload_priority_are_dropped():
    m, data = make_manager(num_blocks=4, num_host_blocks=4, secondary_offload_min_priority=50), Bytes()
    serve(m, data, make_request("low", range(5), priorities=[(0, 5, 10)]))
    serve(m, data, make_request("high", range(100, 105), priorities=[(0, 5, 80)]))
    m.drain_events()
    serve(m, data, make_request("x", range(500, 513)))  # four blocks: evicts both, the lower priority first
    events = [e for e in m.drain_events() if not isinstance(e, BlockStored)]
    assert [(type(e), e.tier) for e in events] == [(BlockRemoved, Tier.DEVICE), (BlockUpdated, Tier.HOST)]
    assert len(m.host.entries) == 1
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
    assert m.num_onboarded_blocks > 20 and m.num_offloaded_blocks > 20
