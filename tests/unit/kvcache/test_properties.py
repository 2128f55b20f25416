"""Property-based: random add / grow / compute / free / fork / evict across priorities and salts,
and prompts received from a peer without window layers' slices (a window of 4 on one layer).

`check_integrity()` runs after every step; a model of what must be cached checks reuse, and no
hit holds a block lacking slices that the claim's first computed query would read.
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.common.errors import OutOfBlocksError
from pdserve.kvcache import CacheRequest
from pdserve.kvcache.windows import SlidingWindows
from tests.unit.kvcache.conftest import FakeClock, make_manager, make_request

PREFIXES = [list(range(p * 100, p * 100 + 12)) for p in range(3)]
WINDOWS = SlidingWindows((4, None), 4)


class KvCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.m = make_manager(num_blocks=12, tokens_per_block=4, clock=self.clock)
        self.live: dict[str, int] = {}  # request id -> prompt length
        self.requests: dict[str, CacheRequest] = {}  # request id -> what it was claimed with
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(prefix=st.integers(0, 2), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 50), max_size=6),
          salt=st.sampled_from([None, "t1", "t2"]), prio=st.integers(0, 100), dur=st.sampled_from([None, 5.0]),
          claim_all=st.booleans())
    def add(self, prefix, cut, tail, salt, prio, dur, claim_all):
        tokens = PREFIXES[prefix][:cut] + tail
        rid = self._new_id()
        request = make_request(rid, tokens, cache_salt=salt, priorities=[(0, len(tokens), prio, dur)],
                               num_claim_tokens=None if claim_all else min(len(tokens), 3))
        analysis = self.m.analyze_prefix_reuse(request)
        try:
            claim = self.m.add_sequence(request)
        except OutOfBlocksError:
            assert not analysis.fits
            assert not self.m.has_request(rid)
            return
        assert analysis.fits and claim.num_cached_tokens == analysis.num_cached_tokens
        self._check_readable(claim)
        self.live[rid] = len(tokens)
        self.requests[rid] = request

    @rule(prefix=st.integers(0, 2), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 50), max_size=6))
    def receive(self, prefix, cut, tail):
        """A decode worker's remote prefill: the peer leaves out the window layer's out-of-reach slices."""
        request = make_request(self._new_id(), PREFIXES[prefix][:cut] + tail)
        try:
            claim = self.m.add_sequence(request)
        except OutOfBlocksError:
            return
        self._check_readable(claim)
        first_block, prompt_len = claim.num_cached_tokens // 4, len(request.token_ids)
        self.m.lack_slices(request.request_id, WINDOWS.skipped(prompt_len, first_block,
                                                               len(claim.block_ids) - first_block))
        self.m.mark_computed(request.request_id, prompt_len - claim.num_cached_tokens)
        self.live[request.request_id] = prompt_len
        self.requests[request.request_id] = request

    def _check_readable(self, claim) -> None:
        for block_id in claim.block_ids[:claim.num_cached_tokens // 4]:
            readable_from = self.m.pool.blocks[block_id].readable_from
            assert readable_from is None or readable_from <= claim.num_cached_tokens

    @rule(data=st.data(), pair=st.booleans())
    def add_batch(self, data, pair):
        prefixes = data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=3))
        requests = [make_request(self._new_id(), PREFIXES[p] + [9] * i) for i, p in enumerate(prefixes)]
        try:
            claims = self.m.add_sequence_batch(requests)
        except OutOfBlocksError:
            assert not any(self.m.has_request(r.request_id) for r in requests)
            return
        for r, c in zip(requests, claims):
            self._check_readable(c)
            self.live[r.request_id] = len(r.token_ids)
            self.requests[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def compute_and_grow(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        done = self.m.num_computed_tokens(rid)
        prompt_left = self.live[rid] - done
        if prompt_left > 0:
            step = min(n, prompt_left)
            try:
                self.m.allocate_slots(rid, step)
            except OutOfBlocksError:
                return
            self.m.mark_computed(rid, step)
            return
        try:
            self.m.allocate_slots(rid, 1)
        except OutOfBlocksError:
            return
        self.m.append_tokens(rid, [n])
        self.m.mark_computed(rid, 1)
        self.live[rid] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        parent = self.requests[rid]
        child = CacheRequest(self._new_id(), parent.token_ids[:self.m.num_computed_tokens(rid)], parent.lora_id,
                             parent.cache_salt, parent.multimodal, parent.priorities)
        try:
            self.m.fork(rid, child)
        except OutOfBlocksError:
            return
        self.live[child.request_id] = self.m.num_computed_tokens(child.request_id)
        self.requests[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.free(rid)
        del self.live[rid]

    @rule(seconds=st.sampled_from([0.0, 3.0, 10.0]))
    def advance_clock(self, seconds):
        self.clock.now += seconds

    @rule()
    def drain(self):
        events = self.m.drain_events()
        seqs = [e.seq for e in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    @invariant()
    def integrity(self):
        self.m.check_integrity()
        assert self.m.num_used_blocks <= self.m.num_blocks


KvCacheMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKvCacheMachine = KvCacheMachine.TestCase
