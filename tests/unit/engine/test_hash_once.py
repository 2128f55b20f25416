"""Block keys are hashed once per request in each process: the router hashes the prompt for its
routing and sends the keys on; a worker hashes only the first block, to check them, and the blocks
its tokens fill later. One sequence per request, whose token list and digests the KV manager
shares (no copy hashed again). Two engines stand for a decode and a prefill worker."""
from collections import Counter
from dataclasses import replace

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.kvcache import block_key
from pdserve.router.routing.routed_backend import prompt_block_keys
from tests.unit.engine.test_llm_engine import make_engine, reference, request

TPB = 4  # make_engine's tokens per block
PROMPT = list(range(10, 35))  # 25 tokens: 6 full blocks


class HashCount:
    """Which block digests each process computed, and how often."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.process = "router"
        self.counts: dict[str, Counter] = {}
        real = block_key.hash_block_tokens

        def counted(*args):
            digest = real(*args)
            self.counts.setdefault(self.process, Counter())[digest] += 1
            return digest
        monkeypatch.setattr(block_key, "hash_block_tokens", counted)

    def of(self, process: str) -> Counter:
        return self.counts.get(process, Counter())


def _steps(engine, hashes: HashCount, process: str) -> list[int]:
    hashes.process = process
    tokens = []
    while engine.has_work:
        for out in engine.step():
            tokens += out.token_ids
    return tokens


def _disaggregated(req: GenerationRequest, hashes: HashCount) -> list[int]:
    """`req` admitted on a decode engine, prefilled on a prefill engine, its KV copied, decoded."""
    d, p = make_engine(), make_engine()
    hashes.process = "decode"
    claim, reason = d.remote.admit(req, min_remote_tokens=1, lease_s=5.0)
    assert claim is not None and reason is None
    hashes.process = "prefill"
    p.add_request(req, prefill_only=True, hold_lease_s=5.0)
    first = _steps(p, hashes, "prefill")[0]
    d.runner.store[list(claim.block_ids)] = p.runner.store[p.remote.held_block_ids(req.request_id)]
    p.remote.release_held(req.request_id)
    hashes.process = "decode"
    tokens = [t for out in d.remote.complete(req.request_id, first) for t in out.token_ids]  # first among them
    tokens += _steps(d, hashes, "decode")
    assert d.kv.num_used_blocks == 0 and p.kv.num_used_blocks == 0
    return tokens


def test_the_router_hashes_the_prompt_and_each_worker_only_checks_its_first_block(monkeypatch):
    hashes = HashCount(monkeypatch)
    req = request("r", PROMPT, max_tokens=12)  # 37 tokens in all: 9 full blocks
    keys = prompt_block_keys(req, TPB)
    assert len(keys) == 6 and set(hashes.of("router")) == set(keys)
    assert _disaggregated(replace(req, block_keys=tuple(keys)), hashes) == reference(PROMPT, 12)
    for process in ("router", "decode", "prefill"):
        assert set(hashes.of(process).values()) == {1}, process  # no digest computed twice in one process
    assert set(hashes.of("decode")) & set(keys) == {keys[0]}  # the check; then the generated blocks
    assert len(hashes.of("decode")) == 1 + 3
    assert set(hashes.of("prefill")) == {keys[0]}  # its prompt's keys came with the order


def test_without_the_routers_keys_each_block_is_hashed_once_per_worker(monkeypatch):
    hashes = HashCount(monkeypatch)
    assert _disaggregated(request("r", PROMPT, max_tokens=12), hashes) == reference(PROMPT, 12)
    assert set(hashes.of("decode").values()) == {1} and len(hashes.of("decode")) == 9
    assert set(hashes.of("prefill").values()) == {1} and len(hashes.of("prefill")) == 6


def test_siblings_share_their_parents_digests(monkeypatch):
    hashes = HashCount(monkeypatch)
    engine = make_engine()
    hashes.process = "worker"
    engine.add_request(GenerationRequest("r", tuple(PROMPT), SamplingParams(n=3, max_tokens=4, temperature=1.0,
                                                                            seed=7)))
    _steps(engine, hashes, "worker")
    hashes.process = "test"
    prompt_keys = prompt_block_keys(request("r", PROMPT), TPB)
    assert all(hashes.of("worker")[key] == 1 for key in prompt_keys)  # not once per sibling
    assert engine.kv.num_used_blocks == 0


def test_keys_made_for_another_salt_are_dropped_never_a_hit(monkeypatch):
    engine = make_engine()
    engine.add_request(request("warm", PROMPT, max_tokens=1))
    _steps(engine, HashCount(monkeypatch), "worker")
    unsalted = prompt_block_keys(request("x", PROMPT), TPB)
    salted = replace(request("r", PROMPT, max_tokens=1), cache_salt="tenant", block_keys=tuple(unsalted))
    claim, reason = engine.remote.admit(salted, min_remote_tokens=1, lease_s=5.0)
    assert claim.num_cached_tokens == 0  # the unsalted keys would have matched all 6 blocks
    engine.remote.fail("r", recompute=False, reason="test")


@pytest.mark.parametrize("keys", [(b"short",), tuple(bytes(32) for _ in range(len(PROMPT) + 1))])
def test_malformed_keys_are_refused_and_change_nothing(keys):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as refused:
        engine.remote.admit(replace(request("r", PROMPT), block_keys=keys), 1, 5.0)
    assert refused.value.param == "block_keys"
    assert not engine.has_work and engine.kv.num_used_blocks == 0
