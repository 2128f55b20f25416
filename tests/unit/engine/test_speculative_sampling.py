"""Sampling under speculation keeps the target's distribution, and a seeded request's tokens.

The target is a small trigram model over a 4-token vocabulary whose "KV cache" stores token ids
in the block slots (as token_store_runner.py): each row's logits depend on its token and the
token before it, read back through the block table, so a draft's slot left unoverwritten or a
wrong computed count changes the distribution. Drafts are fixed guesses, right only sometimes,
so both acceptance and rejection are exercised. 6,000 three-token outputs are compared with the
model's exact distribution over the 64 outcomes by a chi-square test (p > 0.01).
"""
import itertools
from dataclasses import dataclass

import torch

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.core.speculation import Speculator
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.model.batch import ForwardBatch, ForwardOutput
from pdserve.engine.model.sampler import Sampler
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from token_store_runner import CharTokenizer

VOCAB = 4
TPB = 4
PROMPT = (1, 2)
TABLE = torch.randn((VOCAB, VOCAB, VOCAB), generator=torch.Generator().manual_seed(7))  # (previous, token, next)


@dataclass
class _Config:
    vocab_size: int = VOCAB


class TrigramRunner:
    device = "cpu"
    lora = None

    def __init__(self, num_blocks: int) -> None:
        self.config = _Config()
        self.store = torch.full((num_blocks, TPB), -1, dtype=torch.long)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        logits = []
        for chunk in batch.chunks:
            for i, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                self.store[chunk.block_table[pos // TPB], pos % TPB] = token
            rows = [self._row(chunk, chunk.start_pos + i) for i in range(len(chunk.token_ids))]
            if not chunk.all_logits:
                rows = rows[-1:] if chunk.needs_logits else []
            logits.append(torch.stack(rows) if rows else torch.empty(0, VOCAB))
        return ForwardOutput(logits)

    def _row(self, chunk, pos: int) -> torch.Tensor:
        token = int(self.store[chunk.block_table[pos // TPB], pos % TPB])
        previous = int(self.store[chunk.block_table[(pos - 1) // TPB], (pos - 1) % TPB]) if pos else 0
        return TABLE[previous, token]

    def copy_blocks(self, src, dst) -> None:
        self.store[dst] = self.store[src]


class FixedDrafts:
    def propose(self, seqs, num_tokens):
        return [[3, 0, 2][:n] for n in num_tokens]

    def observe(self, batch, output):
        pass


def _engine(speculate: bool, seed: int = 0) -> LLMEngine:
    num_blocks = 256
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TPB), num_blocks)
    config = SchedulerConfig(64, 512, 64)
    speculator = Speculator(SpeculativeConfig("ngram", 3), FixedDrafts(), kv, 64) if speculate else None
    return LLMEngine(TrigramRunner(num_blocks), kv, CharTokenizer(), config,
                     sampler=Sampler(seed=seed, eos_token_ids=()), speculator=speculator)


def _run(engine: LLMEngine, num: int, max_tokens: int, seed: int | None = None) -> list[tuple[int, ...]]:
    for i in range(num):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                                seed=None if seed is None else seed + i)
        engine.add_request(GenerationRequest(RequestId(f"r{i}"), PROMPT, params))
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.kv.num_used_blocks == 0
    return [tuple(out[f"r{i}"]) for i in range(num)]


def _exact(max_tokens: int) -> dict[tuple[int, ...], float]:
    probs = TABLE.softmax(dim=-1)
    exact = {}
    for outcome in itertools.product(range(VOCAB), repeat=max_tokens):
        context = list(PROMPT) + list(outcome)
        p = 1.0
        for t in range(len(PROMPT), len(context)):
            p *= float(probs[context[t - 2], context[t - 1], context[t]])
        exact[outcome] = p
    return exact


def test_sampled_outputs_keep_the_target_distribution() -> None:
    engine = _engine(speculate=True)
    samples = _run(engine, 6000, 3)
    counts = engine.take_step_stats().spec
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    exact = _exact(3)
    observed = torch.tensor([sum(1 for s in samples if s == o) for o in exact], dtype=torch.float64)
    expected = torch.tensor(list(exact.values()), dtype=torch.float64) * len(samples)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((len(exact) - 1) / 2), torch.tensor(chi2 / 2)))
    assert p_value > 0.01, (chi2, p_value)


def test_a_wrong_verification_fails_the_same_check() -> None:
    """The check can fail: always accepting the draft skews the distribution far past p = 0.01."""
    engine = _engine(speculate=True)
    original = engine.speculator.verify

    def accept_everything(verified, emit, counts):
        forced = [(seq, drafts, logits.clone()) for seq, drafts, logits in verified]
        for _, drafts, logits in forced:
            for i, d in enumerate(drafts):
                logits[i] = -1e9
                logits[i, d] = 0.0
        return original(forced, emit, counts)

    engine.speculator.verify = accept_everything
    samples = _run(engine, 2000, 3)
    exact = _exact(3)
    observed = torch.tensor([sum(1 for s in samples if s == o) for o in exact], dtype=torch.float64)
    expected = torch.tensor(list(exact.values()), dtype=torch.float64) * len(samples)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert float(torch.special.gammaincc(torch.tensor((len(exact) - 1) / 2), torch.tensor(chi2 / 2))) < 1e-6


def test_a_seeded_request_gets_the_same_tokens_with_and_without_drafts() -> None:
    with_drafts = _run(_engine(speculate=True), 50, 8, seed=100)
    without = _run(_engine(speculate=False), 50, 8, seed=100)
    assert with_drafts == without
