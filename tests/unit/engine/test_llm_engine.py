"""The engine's step loop and scheduler over a token-store model stand-in (exact outputs)."""
import pytest

from pdserve.common.errors import DuplicateRequestError, InvalidRequestError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from tests.unit.engine.token_store_runner import CharTokenizer, TokenStoreRunner, reference

PROMPTS = [[5, 6, 7], list(range(10, 31)), [40] * 9, list(range(50, 67)), [3, 4]]


def make_engine(num_blocks=64, tpb=4, budget=256, max_seqs=16, reuse=True, max_len=128):
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=tpb, enable_block_reuse=reuse), num_blocks)
    runner = TokenStoreRunner(num_blocks, tpb)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len)
    return LLMEngine(runner, kv, CharTokenizer(), config)


def request(rid, prompt, max_tokens=8, **kw):
    return GenerationRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


def run(engine, requests, max_steps=2000):
    for r in requests:
        engine.add_request(r)
    outputs: dict[tuple, list] = {}
    reasons = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
            if out.finish_reason:
                reasons[(out.request_id, out.index)] = out.finish_reason
        engine.kv.check_integrity()
    assert not engine.has_work
    assert engine.kv.num_used_blocks == 0
    return outputs, reasons


def expected(max_tokens=8):
    return {(f"r{i}", 0): reference(p, max_tokens) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("kw", [
    {}, {"reuse": False}, {"budget": 4}, {"budget": 7}, {"num_blocks": 12}, {"num_blocks": 12, "budget": 5},
    {"max_seqs": 2},
])
def test_outputs_match_reference_under_chunking_preemption_and_caching(kw):
    engine = make_engine(**kw)
    outputs, _ = run(engine, [request(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    assert outputs == expected()


def test_tiny_cache_forces_preemption_and_still_completes():
    engine = make_engine(num_blocks=10, tpb=4)
    outputs, _ = run(engine, [request(f"r{i}", p, max_tokens=12) for i, p in enumerate(PROMPTS)])
    assert engine.scheduler.num_preemptions > 0
    assert outputs == expected(12)


def test_second_request_reuses_the_cached_prefix():
    engine = make_engine()
    run(engine, [request("a", range(20))])
    before = engine.runner.num_forward_tokens
    outputs, _ = run(engine, [request("b", list(range(20)) + [1, 2])])
    assert engine.runner.num_forward_tokens - before == 2 + 7  # 22 - 20 cached prompt tokens, then 7 decodes
    assert outputs[("b", 0)] == reference(list(range(20)) + [1, 2], 8)
    assert engine.kv.num_hit_tokens == 20


def test_a_burst_sharing_an_uncached_prefix_computes_it_once():
    """Prompts that arrive together sharing a prefix no step has computed: the first computes it,
    the others wait one step and find it cached (instead of each computing it in the same step)."""
    engine = make_engine()
    shared = list(range(20))  # 5 full blocks
    prompts = [shared + [60 + i, 70 + i] for i in range(3)]
    outputs, _ = run(engine, [request(f"s{i}", p) for i, p in enumerate(prompts)])
    assert outputs == {(f"s{i}", 0): reference(p, 8) for i, p in enumerate(prompts)}
    assert engine.runner.num_forward_tokens == 22 + 2 + 2 + 3 * 7
    assert engine.kv.num_hit_tokens == 2 * 20


def test_a_prompt_waits_for_the_shared_blocks_a_running_chunk_computes():
    engine = make_engine(budget=8)
    shared = list(range(20))
    outputs, _ = run(engine, [request("a", shared + [1, 2]), request("b", shared + [3, 4])])
    assert engine.runner.num_forward_tokens == 22 + 2 + 2 * 7  # b computes only its own 2 tokens
    assert outputs == {("a", 0): reference(shared + [1, 2], 8), ("b", 0): reference(shared + [3, 4], 8)}


def test_only_a_prompt_sharing_an_uncached_block_waits():
    engine = make_engine()
    for i, p in enumerate([list(range(20)), list(range(30, 50)), list(range(20)) + [9]]):
        engine.add_request(request(f"u{i}", p))
    engine.step()  # u1 shares nothing and starts beside u0; u2 shares u0's blocks
    assert [s.seq_id for s in engine.scheduler.running] == ["u0", "u1"]
    engine.step()
    assert [(s.seq_id, s.num_cached_tokens) for s in engine.scheduler.running][-1] == ("u2", 20)


def test_each_prompt_block_is_hashed_once_while_it_waits_chunks_and_is_claimed(monkeypatch):
    """A sequence owns its block digests: admission checks on several steps, its claim, and the
    in-batch check of its running chunks reuse them instead of hashing the prompt again."""
    from pdserve.kvcache import block_key
    hashed = []
    real = block_key.hash_block_tokens
    monkeypatch.setattr(block_key, "hash_block_tokens", lambda parent, tokens, *a: hashed.append(tuple(tokens)) or real(parent, tokens, *a))
    engine = make_engine(budget=8)
    prompts = [list(range(0, 24)), list(range(30, 54)), list(range(60, 84))]  # 6 blocks each
    outputs, _ = run(engine, [request(f"h{i}", p, max_tokens=2) for i, p in enumerate(prompts)])
    assert outputs == {(f"h{i}", 0): reference(p, 2) for i, p in enumerate(prompts)}
    blocks = [tuple(p[b:b + 4]) for p in prompts for b in range(0, 24, 4)]
    assert sorted(t for t in hashed if t in set(blocks)) == sorted(blocks)


def test_chunks_in_the_prompt_are_marked_as_prompt_however_short():
    """The model computes prompt tokens one way (a tile) and decode tokens another; a prompt whose
    every block but its last token is cached still goes as a prompt."""
    engine = make_engine(budget=7)
    seen = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: seen.extend(batch.chunks) or forward(batch)
    run(engine, [request("a", range(21))])
    run(engine, [request("b", range(21))])  # 20 tokens in whole cached blocks: 1 left to compute
    assert [(c.start_pos, len(c.token_ids)) for c in seen if c.is_prompt] == [(0, 7), (7, 7), (14, 7), (20, 1)]
    assert all(len(c.token_ids) == 1 and c.start_pos >= 21 for c in seen if not c.is_prompt)


def test_n_completions_share_the_prompt_blocks():
    engine = make_engine()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks and a partial one to copy
    outputs, reasons = run(engine, [request("r", prompt, n=3)])
    assert sorted(outputs) == [("r", 0), ("r", 1), ("r", 2)]
    assert all(v == reference(prompt, 8) for v in outputs.values())  # greedy: identical
    assert engine.runner.num_forward_tokens == 13 + 3 * 7  # the prompt is computed once


def test_stop_token_ids_and_eos_finish_with_stop():
    engine = make_engine()
    ref = reference([5, 6, 7], 8, eos=None)
    outputs, reasons = run(engine, [request("a", [5, 6, 7], stop_token_ids=(ref[2],))])
    assert outputs[("a", 0)] == ref[:3] and reasons[("a", 0)] == "stop"


def test_length_finish_and_usage_counts():
    engine = make_engine()
    engine.add_request(request("a", [5, 6, 7], max_tokens=2))
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert [o.finish_reason for o in outs] == [None, "length"]
    assert outs[-1].num_prompt_tokens == 3


def test_abort_frees_blocks_and_reports_abort():
    engine = make_engine()
    engine.add_request(request("a", range(20), max_tokens=50))
    engine.step()
    assert engine.kv.num_used_blocks > 0
    outs = engine.abort(RequestId("a"))
    assert [o.finish_reason for o in outs] == ["abort"]
    assert engine.kv.num_used_blocks == 0 and not engine.has_work
    engine.kv.check_integrity()
    assert engine.abort(RequestId("a")) == []


@pytest.mark.parametrize("bad,param", [
    (request("x", []), "prompt"),
    (request("x", [500]), "prompt"),
    (request("x", [1] * 100, max_tokens=40), "max_tokens"),
    (request("x", [1], n=99), "n"),
    (request("x", [1], top_p=float("nan")), "top_p"),  # refused alone at admission, never in a step's batch
    (request("x", [1], logprobs=2**32 - 1), "logprobs"),
])
def test_bad_requests_are_rejected_without_state_change(bad, param):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(bad)
    assert info.value.param == param
    assert not engine.has_work


def test_duplicate_request_id_is_rejected():
    engine = make_engine()
    engine.add_request(request("a", [1, 2]))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(request("a", [1, 2]))


def test_an_empty_request_id_is_refused():
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request("", [1, 2]))
    assert info.value.param == "request_id" and not engine.has_work


def test_an_id_with_the_engines_sibling_mark_is_refused_and_the_siblings_finish():
    engine = make_engine()
    engine.add_request(request("x", [1, 2, 3], max_tokens=4, n=2))
    first = engine.step()  # the prompt is computed and "x#1" forked off it
    assert engine.kv.has_request(RequestId("x#1"))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request("x#1", [5, 6]))
    assert info.value.param == "request_id"
    outputs, reasons = run(engine, [])
    for out in first:
        outputs[(out.request_id, out.index)] = list(out.token_ids) + outputs[(out.request_id, out.index)]
    assert outputs == {("x", 0): reference([1, 2, 3], 4), ("x", 1): reference([1, 2, 3], 4)}
    assert set(reasons) == {("x", 0), ("x", 1)}
