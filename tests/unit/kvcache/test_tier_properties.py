"""Property-based, across the three tiers: random batches of requests (shared prefixes, retention
priorities on both sides of the offload gate, pressure that forces evictions down through host
memory to disk), each claimed in one two-phase batch, then computed and freed out of order.

After every operation: `check_integrity()` (device pool and both lower tiers), every cached
block in every tier holds its own key's KV (a model of the bytes, moves applied in order), a
batch either gets every block it was promised with its hits copied back or fails leaving nothing
claimed, and a block below the gate never reaches a lower tier."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.errors import OutOfBlocksError
from tests.unit.kvcache.conftest import make_manager, make_request
from tests.unit.kvcache.test_lower_tiers import Bytes

PREFIXES = [list(range(p * 100, p * 100 + 16)) for p in range(6)]
GATE = 35

request_spec = st.tuples(st.integers(0, 5), st.integers(1, 16), st.lists(st.integers(0, 3), max_size=4),
                         st.sampled_from([10, 35, 80]))
batches = st.lists(st.lists(request_spec, min_size=1, max_size=3), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(batches=batches, order=st.randoms(use_true_random=False))
def test_every_tier_stays_sound_and_true_to_its_keys(batches, order):
    m, data = make_manager(num_blocks=8, num_host_blocks=3, num_disk_blocks=5,
                           secondary_offload_min_priority=GATE), Bytes()
    for b, batch in enumerate(batches):
        requests = []
        for i, (prefix, cut, tail, priority) in enumerate(batch):
            tokens = PREFIXES[prefix][:cut] + tail
            requests.append(make_request(f"b{b}r{i}", tokens, priorities=[(0, len(tokens), priority)]))
        try:
            claims = m.add_sequence_batch(requests)
        except OutOfBlocksError:
            assert all(not m.has_request(r.request_id) for r in requests)  # all or nothing
            data.apply(m)
            m.check_integrity()
            data.check(m)
            continue
        data.apply(m)
        for request, claim in zip(requests, claims):
            hashes = request.block_hashes(4)
            for i, block_id in enumerate(claim.block_ids[: claim.num_cached_tokens // 4]):
                assert data.device[block_id] == hashes[i]  # promised hits hold their KV
        for request, claim in zip(requests, claims):  # computed, in the batch's order
            hashes = request.block_hashes(4)
            for i, block_id in enumerate(claim.block_ids):
                if i * 4 >= claim.num_cached_tokens and i < len(hashes):
                    data.device[block_id] = hashes[i]
            m.mark_computed(request.request_id, len(request.token_ids) - claim.num_cached_tokens)
        for request in order.sample(requests, len(requests)):  # freed out of order
            m.free(request.request_id)
        m.check_integrity()
        data.check(m)
        lower = [*m.host.entries.values(), *m.disk.entries.values()]
        assert all(entry.priority >= GATE for entry in lower), "a block below the gate moved down"
