"""Speculative decoding in the engine: greedy output equals the output without drafts, on every
forward path, with drafts that agree, disagree and run into max_tokens, through chunked
prefill, preemption and the host tier; only accepted tokens are ever marked computed.

`ScriptedDrafts` drafts from a known continuation with a wrong token every third position, so
each step both accepts and rejects; n-gram lookup drafts from the sequence itself."""
import pytest
import torch

from model_builders import TOKENS_PER_BLOCK, load_runner, prompt
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.core.speculation import Speculator
from pdserve.engine.model.host_store import HostKvStore
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.spec.proposers import NgramDrafts
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from token_store_runner import CharTokenizer

MAX_NEW = 12
PROMPTS = [prompt(3, 1), prompt(9, 2) * 2, prompt(21, 3), prompt(5, 4) * 4]
KINDS = ["llama", "gemma3", "qwen3_moe"]


class ScriptedDrafts:
    """Drafts the reference continuation, with every third drafted position wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.calls = 0

    def propose(self, seqs, num_tokens):
        drafts = []
        for seq, n in zip(seqs, num_tokens):
            self.calls += 1
            out = seq.token_ids[seq.num_prompt_tokens:]
            truth = self.continuations[tuple(seq.token_ids[:seq.num_prompt_tokens])][len(out):len(out) + n]
            drafts.append([t if (i + self.calls) % 3 else (t + 1) % self.vocab for i, t in enumerate(truth)])
        return drafts

    def observe(self, batch, output):
        pass


def _engine(checkpoint, proposer=None, k=4, num_blocks=64, budget=512, kernels="auto", host_blocks=0,
            disable_by_batch_size=None):
    runner = load_runner(checkpoint, num_blocks=num_blocks, kernels=kernels)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), num_blocks, num_host_blocks=host_blocks)
    store = HostKvStore(runner.kv_tensor, host_blocks) if host_blocks else None
    config = SchedulerConfig(8, budget, 128)
    speculator = None if proposer is None else Speculator(
        SpeculativeConfig("ngram", k, disable_by_batch_size=disable_by_batch_size), proposer, kv, config.max_model_len)
    return LLMEngine(runner, kv, CharTokenizer(), config, tier_store=store, speculator=speculator)


def _generate(engine, prompts, tag="a", max_new=MAX_NEW, **params):
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True, **params)
        engine.add_request(GenerationRequest(RequestId(f"{tag}{i}"), tuple(p), sampling))
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 1000
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return [out[f"{tag}{i}"] for i in range(len(prompts))], steps


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for kind in KINDS:
        engine = _engine(checkpoints[kind], kernels="torch")
        outputs, _ = _generate(engine, PROMPTS, max_new=MAX_NEW)
        refs[kind] = outputs
    return refs


@pytest.mark.parametrize("kind", KINDS)
def test_scripted_drafts_keep_greedy_output(checkpoints, references, kind, kernels):
    truth = {tuple(p): out for p, out in zip(PROMPTS, references[kind])}
    engine = _engine(checkpoints[kind], ScriptedDrafts(truth, 300), kernels=kernels)
    outputs, steps = _generate(engine, PROMPTS)
    assert outputs == references[kind]
    counts = engine.take_step_stats().spec
    assert counts.num_accepted_tokens > 0
    assert counts.num_accepted_tokens < counts.num_draft_tokens  # some were rejected
    assert steps < MAX_NEW  # fewer steps than tokens: drafts were taken


@pytest.mark.parametrize("case", [dict(budget=7), dict(num_blocks=14), dict(host_blocks=32, num_blocks=20)])
def test_scripted_drafts_through_chunks_preemption_and_tiers(checkpoints, references, case):
    truth = {tuple(p): out for p, out in zip(PROMPTS, references["llama"])}
    engine = _engine(checkpoints["llama"], ScriptedDrafts(truth, 300), **case)
    for tag in ("a", "b"):  # the second round finds the first's blocks cached (or in the host tier)
        outputs, _ = _generate(engine, PROMPTS, tag)
        assert outputs == references["llama"]


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_drafts_keep_greedy_output(checkpoints, references, kind):
    engine = _engine(checkpoints[kind], NgramDrafts(1, 3))
    outputs, _ = _generate(engine, PROMPTS)
    assert outputs == references[kind]
    assert engine.take_step_stats().spec.num_drafts > 0


def test_disable_by_batch_size_drafts_nothing_for_a_full_batch(checkpoints, references):
    truth = {tuple(p): out for p, out in zip(PROMPTS, references["llama"])}
    engine = _engine(checkpoints["llama"], ScriptedDrafts(truth, 300), disable_by_batch_size=len(PROMPTS))
    outputs, _ = _generate(engine, PROMPTS)
    assert outputs == references["llama"]
    assert engine.take_step_stats().spec.num_drafts == 0
    outputs, _ = _generate(engine, PROMPTS[:1], "b")  # one request: below the limit
    assert engine.take_step_stats().spec.num_drafts > 0


def test_drafts_stop_at_max_tokens_and_stop_tokens(checkpoints, references):
    truth = {tuple(p): out for p, out in zip(PROMPTS, references["llama"])}
    engine = _engine(checkpoints["llama"], ScriptedDrafts(truth, 300), k=8)
    outputs, _ = _generate(engine, PROMPTS, max_new=5)
    assert outputs == [r[:5] for r in references["llama"]]
    stop = references["llama"][2][3]
    outputs, _ = _generate(engine, PROMPTS[2:3], "s", stop_token_ids=(stop,))
    assert outputs == [references["llama"][2][:references["llama"][2].index(stop) + 1]]


PROCESSED = dict(logprobs=2, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                 logit_bias=((7, 3.0), (11, -2.0)), bad_words=((5, 6),), min_tokens=3)


def _generate_with_logprobs(engine, prompts, **params):
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, **params)
        engine.add_request(GenerationRequest(RequestId(f"p{i}"), tuple(p), sampling))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    while engine.has_work:
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            logprobs.setdefault(o.request_id, []).extend(o.logprobs)
    return [(tokens[f"p{i}"], logprobs[f"p{i}"]) for i in range(len(prompts))]


def test_logits_processors_and_logprobs_see_the_accepted_drafts(checkpoints):
    """Penalties count the accepted drafts as output tokens, bad words and min_tokens see them, and
    each token's logprobs are of its own row: the same tokens and logprobs as without drafts."""
    plain = _generate_with_logprobs(_engine(checkpoints["llama"], kernels="torch"), PROMPTS, **PROCESSED)
    truth = {tuple(p): out for p, (out, _) in zip(PROMPTS, plain)}
    engine = _engine(checkpoints["llama"], ScriptedDrafts(truth, 300), kernels="torch")
    speculated = _generate_with_logprobs(engine, PROMPTS, **PROCESSED)
    assert [t for t, _ in speculated] == [t for t, _ in plain]
    for (_, got), (_, want) in zip(speculated, plain):
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got] == [(lp.token_id, [t for t, _ in lp.top]) for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    assert engine.take_step_stats().spec.num_accepted_tokens > 0
