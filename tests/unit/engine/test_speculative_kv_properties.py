"""Property-based: under random drafts (right, wrong, or partly right), no block holding an
unaccepted token is ever published.

The target stands in for a model by storing token ids in its KV slots (token_store_runner.py)
and predicting from what it reads back, so a draft's slot that stayed in a published block shows
up as that block's stored tokens differing from the tokens its key was hashed from. After every
step: the manager's integrity; every block findable in the prefix cache holds exactly the tokens
of its key; and at the end each output equals the target's own greedy continuation.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.core.speculation import Speculator
from pdserve.engine.model.batch import ForwardBatch, ForwardOutput
from pdserve.kvcache import CacheRequest, KvCacheConfig, KvCacheManager
from token_store_runner import VOCAB, CharTokenizer, TokenStoreRunner, next_token, reference

TPB = 4
PREFIX = [5, 9, 2, 7, 11, 3]


class AllRowsRunner(TokenStoreRunner):
    """TokenStoreRunner with a logits row for every token of an `all_logits` chunk."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        logits = []
        for chunk in batch.chunks:
            for i, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                self.store[chunk.block_table[pos // self.tpb], pos % self.tpb] = token
            end = chunk.start_pos + len(chunk.token_ids)
            context = [int(self.store[chunk.block_table[p // self.tpb], p % self.tpb]) for p in range(end)]
            first = chunk.start_pos if chunk.all_logits else end - 1 if chunk.needs_logits else end
            rows = []
            for p in range(first, end):
                row = torch.full((VOCAB,), -10.0)
                row[next_token(context[:p + 1])] = 10.0
                rows.append(row)
            logits.append(torch.stack(rows) if rows else torch.empty(0, VOCAB))
        return ForwardOutput(logits)


class RandomDrafts:
    """The target's true continuation, each drafted token replaced by a wrong one when `data` says."""

    def __init__(self, data) -> None:
        self.data = data

    def propose(self, seqs, num_tokens):
        drafts = []
        for seq, n in zip(seqs, num_tokens):
            tokens = list(seq.token_ids)
            draft = []
            for _ in range(self.data.draw(st.integers(0, n))):
                right = next_token(tokens)
                token = right if self.data.draw(st.booleans()) else (right + 1) % VOCAB
                draft.append(token)
                tokens.append(token)
            drafts.append(draft)
        return drafts

    def observe(self, batch, output):
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tails=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=7), min_size=1, max_size=5),
       num_blocks=st.sampled_from([12, 40]), k=st.integers(1, 5))
def test_no_block_holding_an_unaccepted_token_is_published(data, tails, num_blocks, k) -> None:
    runner = AllRowsRunner(num_blocks, TPB)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TPB), num_blocks)
    config = SchedulerConfig(8, 64, 48)
    engine = LLMEngine(runner, kv, CharTokenizer(), config,
                       speculator=Speculator(SpeculativeConfig("ngram", k), RandomDrafts(data), kv, 48))
    prompts = [PREFIX[:data.draw(st.integers(1, len(PREFIX)))] + tail for tail in tails]
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(RequestId(f"r{i}"), tuple(p), SamplingParams(max_tokens=10, temperature=0.0)))
    out: dict[str, list[int]] = {}
    known: dict[bytes, list[int]] = {}  # block key -> the accepted tokens it was hashed from
    for _ in range(400):
        if not engine.has_work:
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        kv.check_integrity()
        for i, p in enumerate(prompts):
            tokens = p + out.get(f"r{i}", [])
            for b, key in enumerate(CacheRequest(RequestId("x"), tokens).block_hashes(TPB)):
                known[key] = tokens[b * TPB:(b + 1) * TPB]
        for key, tokens in known.items():
            block = kv.pool.lookup(key)
            if block is not None:
                assert runner.store[block.block_id].tolist() == tokens
    assert not engine.has_work
    assert kv.num_used_blocks == 0
    assert [out[f"r{i}"] for i in range(len(prompts))] == [reference(p, 10) for p in prompts]
