"""Priority-based LRU: lowest priority first, LRU within a priority, leaves before parents, expiry."""
from pdserve.kvcache import BlockUpdated
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion


def _evict_order(m, num):
    """Allocate `num` blocks through a throwaway request and report which cached keys disappeared."""
    before = dict(m.pool.cached)
    m.add_sequence(make_request("evictor", range(10_000, 10_000 + 4 * num)))
    gone = [b.block_id for h, b in before.items() if h not in m.pool.cached]
    m.free("evictor")
    return gone


def test_lowest_priority_goes_first_then_lru():
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("hi", range(4), priorities=[(0, 4, 80)]))  # block 0, prio 80, oldest
    run_to_completion(m, make_request("lo1", range(100, 104), priorities=[(0, 4, 10)]))  # block 1
    run_to_completion(m, make_request("lo2", range(200, 204), priorities=[(0, 4, 10)]))  # block 2
    run_to_completion(m, make_request("mid", range(300, 304)))  # block 3, default 35
    assert [m.pool.blocks[i].priority for i in range(4)] == [80, 10, 10, 35]
    assert _evict_order(m, 1) == [1]  # lowest priority, least recently used among them
    m.check_integrity()


def test_within_a_priority_least_recently_used_goes_first():
    m = make_manager(num_blocks=4)
    for i, start in enumerate((0, 100, 200)):
        run_to_completion(m, make_request(f"r{i}", range(start, start + 4)))  # blocks 0, 1, 2
    run_to_completion(m, make_request("touch", range(5)))  # re-uses block 0: now most recent
    assert _evict_order(m, 2) == [1]  # free block 3, then the LRU cached block


def test_leaves_are_evicted_before_their_parents():
    m = make_manager(num_blocks=3)
    run_to_completion(m, make_request("chain", range(12), priorities=[(0, 4, 10), (4, 12, 90)]))
    # block 0 has the lowest priority but is the parent of blocks 1 and 2
    m.add_sequence(make_request("x", range(500, 504)))
    assert m.pool.blocks[0].block_hash is not None and m.pool.blocks[2].block_hash is None
    m.check_integrity()


def test_duration_expires_back_to_default_priority(clock):
    m = make_manager(num_blocks=2, clock=clock)
    run_to_completion(m, make_request("sys", range(4), priorities=[(0, 4, 90, 60.0)]))  # block 0
    run_to_completion(m, make_request("user", range(100, 104), priorities=[(0, 4, 50)]))  # block 1
    clock.now += 61
    m.drain_events()
    m.add_sequence(make_request("x", range(500, 504)))
    assert m.pool.blocks[0].block_hash is None  # 90 expired to 35 < 50: evicted first
    events = m.drain_events()
    assert isinstance(events[0], BlockUpdated) and events[0].priority == 35


def test_decode_blocks_take_the_decode_priority():
    m = make_manager(num_blocks=4)
    r = make_request("a", range(4), decode_priority=70)
    m.add_sequence(r)
    m.mark_computed("a", 4)
    m.allocate_slots("a", 4)
    m.append_tokens("a", [7, 7, 7, 7])
    m.mark_computed("a", 4)
    assert [m.pool.blocks[i].priority for i in m.block_ids("a")] == [35, 70]


def test_reuse_with_explicit_priority_updates_the_block():
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("a", range(8)))
    m.drain_events()
    m.add_sequence(make_request("b", range(8), priorities=[(0, 4, 95)]))
    assert m.pool.blocks[0].priority == 95
    assert [type(e).__name__ for e in m.drain_events()] == ["BlockUpdated"]


def _hit_rate(policy: str) -> float:
    """A hot system prompt (3 blocks) between bursts of one-off requests that overflow the cache."""
    m = make_manager(num_blocks=8, eviction_policy=policy)
    system = list(range(12))
    hits = total = 0
    for round_ in range(20):
        req = make_request(f"s{round_}", system + [1000 + round_], priorities=[(0, 12, 90)])
        hits += m.analyze_prefix_reuse(req).num_cached_tokens
        total += 12
        run_to_completion(m, req)
        for j in range(4):  # one-off traffic: 2 cached blocks each, 8 distinct blocks per round
            base = 100_000 + 100 * (4 * round_ + j)
            run_to_completion(m, make_request(f"u{round_}.{j}", range(base, base + 9)))
    return hits / total


def test_priority_eviction_keeps_a_hot_system_prompt_where_lru_loses_it():
    assert _hit_rate("priority") == 19 / 20  # every round after the first hits all 12 tokens
    assert _hit_rate("lru") == 0.0
