"""Prompt logprobs (vLLM's `prompt_logprobs`, behind `echo` with `logprobs`) computed by the
engine from its prefill, against transformers' log_softmax of the same tiny checkpoint in
float32."""
import pytest
import torch

from model_builders import TOKENS_PER_BLOCK, load_runner, prompt
from pdserve.common.errors import InvalidRequestError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.model import prompt_logprobs as module
from pdserve.engine.model.prompt_logprobs import prompt_token_logprobs
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from token_store_runner import CharTokenizer

TOL = 1e-4  # as the model's logits parity (test_model_parity.py)
PROMPT = prompt(21, seed=7)
NUM_TOP = 3


def make_engine(runner, num_blocks=64, budget=512) -> LLMEngine:
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), num_blocks)
    return LLMEngine(runner, kv, CharTokenizer(), SchedulerConfig(8, budget, 128))


def generate(engine: LLMEngine, rid: str, prompt_ids: list[int], **sampling) -> list[RequestOutput]:
    params = SamplingParams(**{"max_tokens": 2, "temperature": 0.0, "ignore_eos": True, **sampling})
    engine.add_request(GenerationRequest(RequestId(rid), tuple(prompt_ids), params))
    outputs = []
    for _ in range(200):
        if not engine.has_work:
            break
        outputs += [o for o in engine.step() if o.request_id == rid]
        engine.kv.check_integrity()
    return outputs


def check_against_transformers(checkpoint, prompt_ids, entries) -> None:
    reference = checkpoint.hf_logits(prompt_ids).log_softmax(dim=-1)  # (T, V)
    assert [e.token_id for e in entries] == prompt_ids[1:]
    got = torch.tensor([e.logprob for e in entries])
    want = reference[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    for position, entry in enumerate(entries):
        top_lp, top_ids = reference[position].topk(NUM_TOP)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top]), top_lp, atol=TOL, rtol=0)


@pytest.mark.parametrize("budget", [512, 7, TOKENS_PER_BLOCK])  # whole prompt, odd chunks, one block a step
def test_prompt_logprobs_equal_transformers_log_softmax(checkpoints, kernels, budget):
    engine = make_engine(load_runner(checkpoints["llama"], kernels=kernels), budget=budget)
    outputs = generate(engine, "r", PROMPT, prompt_logprobs=NUM_TOP)
    check_against_transformers(checkpoints["llama"], PROMPT, outputs[0].prompt_logprobs)
    assert [o.prompt_logprobs for o in outputs[1:]] == [()]  # the first output carries them, once


def test_a_cached_prompt_is_computed_again_when_its_logprobs_are_wanted(checkpoints):
    engine = make_engine(load_runner(checkpoints["llama"]))
    warm = generate(engine, "warm", PROMPT)
    assert warm[0].prompt_logprobs == ()  # not asked for
    hit = generate(engine, "hit", PROMPT)
    assert hit[0].num_cached_tokens == 20  # the cache holds the prompt's full blocks
    echoed = generate(engine, "echo", PROMPT, prompt_logprobs=0)
    assert echoed[0].num_cached_tokens == 0
    assert [o.token_ids for o in echoed] == [o.token_ids for o in warm]
    check_entries = echoed[0].prompt_logprobs
    assert all(entry.top == () for entry in check_entries)  # 0: the prompt token's own logprob only
    reference = checkpoints["llama"].hf_logits(PROMPT).log_softmax(dim=-1)
    want = reference[torch.arange(20), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(torch.tensor([e.logprob for e in check_entries]), want, atol=TOL, rtol=0)


def test_every_completion_of_n_carries_the_prompts_logprobs(checkpoints):
    engine = make_engine(load_runner(checkpoints["llama"]))
    outputs = generate(engine, "r", PROMPT, prompt_logprobs=NUM_TOP, n=3, temperature=1.0, seed=5)
    firsts = {o.index: o.prompt_logprobs for o in outputs if o.prompt_logprobs}
    assert sorted(firsts) == [0, 1, 2]
    assert firsts[0] == firsts[1] == firsts[2] and len(firsts[0]) == len(PROMPT) - 1


def test_a_one_token_prompt_has_no_prompt_logprobs(checkpoints):
    engine = make_engine(load_runner(checkpoints["llama"]))
    assert generate(engine, "r", PROMPT[:1], prompt_logprobs=2)[0].prompt_logprobs == ()


def test_prompt_logprobs_out_of_range_are_refused_before_anything_changes(checkpoints):
    engine = make_engine(load_runner(checkpoints["llama"]))
    params = SamplingParams(max_tokens=2, prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs=21"):
        engine.add_request(GenerationRequest(RequestId("r"), tuple(PROMPT), params))
    assert not engine.has_work


def test_long_chunks_are_reduced_slice_by_slice_with_the_same_result(monkeypatch):
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3))
    next_ids = [4, 9, 0, 49, 17, 3, 3]
    whole = prompt_token_logprobs(logits, next_ids, 2)
    monkeypatch.setattr(module, "ROWS_PER_SLICE", 3)
    assert prompt_token_logprobs(logits, next_ids, 2) == whole
    reference = logits.log_softmax(dim=-1)
    assert [e.logprob for e in whole] == pytest.approx(reference[range(7), next_ids].tolist(), abs=1e-6)
    with pytest.raises(ValueError, match="7 logits rows for 6 next tokens"):
        prompt_token_logprobs(logits, next_ids[:6], 2)
