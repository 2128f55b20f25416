"""Fidelity of the whole engine (scheduler + KV cache manager + model + sampler) against
transformers' greedy `generate`, float32, over a batch of prompts of mixed lengths:
with prefix reuse on and off, chunks of one block and of an odd number of tokens, a warm
prefix cache, preemption forced by a tiny cache, and prefixes offloaded to the host tier and
copied back."""
import pytest
import torch

from model_builders import TOKENS_PER_BLOCK, load_runner, prompt
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.model.host_store import HostKvStore
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from token_store_runner import CharTokenizer

MAX_NEW = 8
SHARED = prompt(13, seed=99)  # a prefix several prompts share, so reuse has something to find
PROMPTS = [prompt(3, 1), SHARED + prompt(9, 2), prompt(21, 3), SHARED + prompt(2, 4), prompt(40, 5)]

# Every family served; Gemma 3's window layer (window 8) drops most of the longer prompts' keys.
KINDS = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe"]
CASES = {
    "reuse": dict(),
    "no_reuse": dict(reuse=False),
    "chunk_one_block": dict(budget=TOKENS_PER_BLOCK),
    "chunk_odd": dict(budget=7),
    "tiny_cache_preempts": dict(num_blocks=16),
}


def _engine(checkpoint, num_blocks=64, budget=512, reuse=True, kernels="auto", host_blocks=0) -> LLMEngine:
    runner = load_runner(checkpoint, num_blocks=num_blocks, kernels=kernels)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, enable_block_reuse=reuse), num_blocks,
                        num_host_blocks=host_blocks)
    store = HostKvStore(runner.kv_tensor, host_blocks) if host_blocks else None
    return LLMEngine(runner, kv, CharTokenizer(), SchedulerConfig(8, budget, 64), tier_store=store)


def _generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(RequestId(f"{tag}{i}"), tuple(p), params))
    out: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_work:
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expected(checkpoints):
    refs = {}
    for kind in KINDS:
        model = checkpoints[kind].hf_model
        refs[kind] = []
        for p in PROMPTS:
            with torch.no_grad():
                ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            refs[kind].append(ids[0, len(p):].tolist())
            assert len(refs[kind][-1]) == MAX_NEW  # transformers did not stop at its EOS
    return refs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_engine_output_equals_transformers(checkpoints, expected, kind, case, kernels):
    engine = _engine(checkpoints[kind], **CASES[case], kernels=kernels)
    assert _generate(engine, PROMPTS, "a") == expected[kind]
    if case == "tiny_cache_preempts":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", KINDS)
def test_warm_prefix_cache_gives_the_same_tokens(checkpoints, expected, kind):
    engine = _engine(checkpoints[kind])
    _generate(engine, PROMPTS, "cold")
    hits_before = engine.kv.num_hit_tokens
    assert _generate(engine, PROMPTS, "warm") == expected[kind]
    assert engine.kv.num_hit_tokens > hits_before


@pytest.mark.parametrize("kind", KINDS)
def test_prefixes_offloaded_to_the_host_tier_and_copied_back_give_the_same_tokens(checkpoints, expected, kind,
                                                                                  kernels):
    engine = _engine(checkpoints[kind], num_blocks=24, host_blocks=64, kernels=kernels)
    assert _generate(engine, PROMPTS, "cold") == expected[kind]
    _generate(engine, [prompt(50, 100 + i) for i in range(3)], "flush")  # pushes the prompts' blocks down
    assert engine.kv.tiers.num_offloaded > 0
    hits, onboarded = engine.kv.num_hit_tokens, engine.kv.tiers.num_onboarded
    assert _generate(engine, PROMPTS, "warm") == expected[kind]
    assert engine.kv.tiers.num_onboarded > onboarded and engine.kv.num_hit_tokens > hits


def test_lower_tier_copies_count_against_the_step_budget():
    from pdserve.engine.core.scheduler import copy_cost_tokens

    assert copy_cost_tokens((3, 0, 0), 16) == 0  # device hits cost nothing
    assert copy_cost_tokens((0, 4, 0), 16) == 8  # 64 host-tier tokens: an eighth
    assert copy_cost_tokens((1, 2, 2), 16) == 4 + 8


@pytest.mark.parametrize("kind", KINDS)
def test_host_tier_hits_under_a_small_step_budget_give_the_same_tokens(checkpoints, expected, kind):
    engine = _engine(checkpoints[kind], num_blocks=24, host_blocks=64, budget=7)
    _generate(engine, PROMPTS, "cold")
    _generate(engine, [prompt(50, 100 + i) for i in range(3)], "flush")
    assert _generate(engine, PROMPTS, "warm") == expected[kind]
    assert engine.kv.tiers.num_onboarded > 0
