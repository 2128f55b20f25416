"""Draft-model speculation (`engine/spec/draft_model.py`): greedy output equals the output
without drafts on every forward path, through chunked prefill, preemption, prefix-cache hits,
the host tier, forks, a LoRA adapter (drafted without it) and a cache too small for every
draft; seeded sampling keeps its tokens; the target drafting for itself has nearly every draft
accepted; the draft K/V the proposer counts as written is, after every step, what the draft
model computes for those tokens from scratch (also for a sequence back in other blocks); a
draft of another vocabulary, of a shorter context or missing is refused by name."""
from dataclasses import dataclass

import pytest
import torch

from model_builders import TOKENS_PER_BLOCK, load_runner, prompt
from pdserve.common.errors import ConfigError, OutOfBlocksError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.core.speculation import Speculator
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.loading.lora_files import read_lora_checkpoint
from pdserve.engine.model.host_store import HostKvStore
from pdserve.engine.model.lora import LoraSettings
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.spec.proposers import DrafterContext, build_proposer
from pdserve.kvcache import CacheRequest, KvCacheConfig, KvCacheManager
from tests.draft_builders import make_draft_checkpoint, make_noisy_copy
from tests.lora_builders import make_adapter
from token_store_runner import CharTokenizer

MAX_NEW = 16
MAX_MODEL_LEN = 128
PROMPTS = [prompt(3, 1), prompt(9, 2) * 2, prompt(21, 3), prompt(5, 4) * 4]
KINDS = ["llama", "gemma3"]


@pytest.fixture(scope="module")
def drafts(checkpoints, tmp_path_factory):
    """Draft checkpoints of the tiny targets' vocabulary: the llama target itself, a copy of it
    with noise (agreeing on some drafts), and a random one-layer llama."""
    root = tmp_path_factory.mktemp("drafts")
    llama = checkpoints["llama"]
    return {"self": llama.path, "noisy": make_noisy_copy(root / "noisy", llama.hf_model, 0.03),
            "small": make_draft_checkpoint(root / "small", llama.path)}


def _engine(target, draft=None, k=4, num_blocks=64, budget=512, kernels="auto", host_blocks=0, lora=None):
    runner = load_runner(target, num_blocks=num_blocks, kernels=kernels, lora=lora)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), num_blocks, num_host_blocks=host_blocks)
    store = HostKvStore(runner.kv_tensor, host_blocks) if host_blocks else None
    speculator = None
    if draft is not None:
        config = SpeculativeConfig("draft_model", k, model=str(draft))
        context = DrafterContext(runner, kv, "float32", kernels, None, MAX_MODEL_LEN)
        speculator = Speculator(config, build_proposer(config, context), kv, MAX_MODEL_LEN)
    return LLMEngine(runner, kv, CharTokenizer(), SchedulerConfig(8, budget, MAX_MODEL_LEN), tier_store=store,
                     speculator=speculator)


def _generate(engine, prompts, tag="a", max_new=MAX_NEW, after_step=None, n=1, lora_id=None, **params):
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_new, ignore_eos=True, n=n, **({"temperature": 0.0} | params))
        engine.add_request(GenerationRequest(RequestId(f"{tag}{i}"), tuple(p), sampling, lora_id=lora_id))
    out: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 1000
        for o in engine.step():
            out.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        engine.kv.check_integrity()
        if after_step is not None:
            after_step(engine)
    assert engine.kv.num_used_blocks == 0
    return [out[(f"{tag}{i}", j)] for i in range(len(prompts)) for j in range(n)], steps


def _acceptance(engine) -> float:
    counts = engine.take_step_stats().spec
    return counts.num_accepted_tokens / counts.num_draft_tokens


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: _generate(_engine(checkpoints[kind], kernels="torch"), PROMPTS)[0] for kind in KINDS}


class DraftKvCheck:
    """After each step: every position the proposer counts as written holds the K/V the draft
    model computes for the same tokens from scratch (a reference runner, in one chunk)."""

    def __init__(self, draft, kernels):
        self.reference = ModelRunner.load(draft, "float32", "cpu", num_blocks=MAX_MODEL_LEN // TOKENS_PER_BLOCK,
                                          tokens_per_block=TOKENS_PER_BLOCK, kernels=kernels)
        self.num_checked = 0

    def __call__(self, engine):
        self.check(engine.speculator.proposer)

    def check(self, proposer):
        tpb = TOKENS_PER_BLOCK
        for seq_id, state in proposer._states.items():
            if not state.fed:
                continue
            blocks = tuple(range(-(-len(state.fed) // tpb)))
            self.reference.forward(ForwardBatch((SeqChunk(seq_id, tuple(state.fed), 0, blocks),)))
            expected = self.reference.kv_tensor[list(blocks)]  # (nb, L, 2, tpb, kvh, hd)
            written = proposer.runner.kv_tensor[list(state.block_ids[:len(blocks)])]
            n = len(state.fed)
            # (L, 2, positions, kvh, hd): token slots in order, the last block cut at n
            expected = expected.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n]
            written = written.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n]
            torch.testing.assert_close(written, expected, atol=1e-4, rtol=1e-4, msg=f"{seq_id}: draft K/V")
            self.num_checked += 1


@pytest.mark.parametrize("draft", ["self", "noisy", "small"])
def test_greedy_output_equals_the_output_without_drafts(checkpoints, drafts, references, draft, kernels):
    engine = _engine(checkpoints["llama"], drafts[draft], kernels=kernels)
    check = DraftKvCheck(drafts[draft], kernels)
    outputs, steps = _generate(engine, PROMPTS, after_step=check)
    assert outputs == references["llama"]
    assert check.num_checked > 0
    acceptance = _acceptance(engine)
    if draft == "self":
        assert acceptance > 0.9, acceptance
        assert steps < MAX_NEW / 2
    if draft == "noisy":
        assert 0 < acceptance < 1, acceptance  # some drafts rejected, some taken


def test_a_target_of_another_family_keeps_its_output(checkpoints, drafts, references):
    engine = _engine(checkpoints["gemma3"], drafts["small"])
    outputs, _ = _generate(engine, PROMPTS)
    assert outputs == references["gemma3"]


@pytest.mark.parametrize("case", [dict(budget=7), dict(num_blocks=14), dict(host_blocks=32, num_blocks=20)],
                         ids=["chunked-prefill", "preemption", "host-tier"])
@pytest.mark.parametrize("draft", ["self", "noisy"])
def test_drafts_through_chunks_preemption_prefix_hits_and_tiers(checkpoints, drafts, references, case, draft):
    engine = _engine(checkpoints["llama"], drafts[draft], **case)
    check = DraftKvCheck(drafts[draft], "auto")
    for tag in ("a", "b"):  # the second round finds the first's blocks cached (or in the host tier)
        outputs, _ = _generate(engine, PROMPTS, tag, after_step=check)
        assert outputs == references["llama"]
    if draft == "self":
        assert _acceptance(engine) > 0.9
    if "num_blocks" in case and "host_blocks" not in case:
        assert engine.scheduler.num_preemptions > 0


def test_forked_completions_and_short_budgets_keep_their_output(checkpoints, drafts, references):
    """n=2 (the second completion forked off the first's prompt blocks) and max_tokens below k."""
    engine = _engine(checkpoints["llama"], drafts["noisy"], k=6)
    check = DraftKvCheck(drafts["noisy"], "auto")
    outputs, _ = _generate(engine, PROMPTS, n=2, after_step=check)
    assert outputs == [r for r in references["llama"] for _ in range(2)]
    outputs, _ = _generate(engine, PROMPTS, "s", max_new=3, after_step=check)
    assert outputs == [r[:3] for r in references["llama"]]


def test_a_sequence_under_a_lora_adapter_is_drafted_without_it(checkpoints, drafts, references, tmp_path):
    """The draft (the base model) drafts for an adapter's requests; the target, adapter
    included, verifies: the output is the adapter's without drafts."""
    make_adapter(checkpoints["llama"].hf_model, tmp_path / "adapter", seed=1)
    adapter = read_lora_checkpoint(tmp_path / "adapter")
    outputs = []
    for draft in (None, drafts["self"]):
        engine = _engine(checkpoints["llama"], draft, kernels="torch", lora=LoraSettings(max_loras=1, max_lora_rank=8))
        engine.add_lora(adapter)
        check = DraftKvCheck(drafts["self"], "torch") if draft else None
        outputs.append(_generate(engine, PROMPTS, lora_id=adapter.lora_id, after_step=check)[0])
    assert outputs[1] == outputs[0]
    assert _acceptance(engine) > 0
    assert sum(a != b for a, b in zip(outputs[0], references["llama"])) >= len(PROMPTS) - 1  # the adapter matters


def test_seeded_sampling_gives_the_tokens_it_gives_without_drafts(checkpoints, drafts):
    sampled = [_generate(_engine(checkpoints["llama"], draft), PROMPTS, temperature=1.0, seed=7)[0]
               for draft in (None, drafts["self"])]
    assert sampled[1] == sampled[0]


def test_the_proposer_forgets_finished_sequences(checkpoints, drafts):
    engine = _engine(checkpoints["llama"], drafts["noisy"])
    _generate(engine, PROMPTS)
    engine.add_request(GenerationRequest(RequestId("z"), tuple(PROMPTS[0]),
                                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    while engine.has_work:
        engine.step()
    assert engine.speculator.proposer._states.keys() <= {RequestId("z")}
    engine.add_request(GenerationRequest(RequestId("y"), tuple(PROMPTS[1]),
                                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    engine.step()
    engine.step()
    assert set(engine.speculator.proposer._states) == {RequestId("y")}


class RefusalCount:
    """The KV cache manager, counting the slot reservations it refuses."""

    def __init__(self, kv):
        self.kv = kv
        self.num_refused = 0

    def allocate_slots(self, seq_id, num_tokens):
        try:
            return self.kv.allocate_slots(seq_id, num_tokens)
        except OutOfBlocksError:
            self.num_refused += 1
            raise

    def __getattr__(self, name):
        return getattr(self.kv, name)


def test_drafts_without_free_blocks_are_skipped_not_preempting(checkpoints, drafts, references):
    """A small cache: the draft's slot reservations fail at times and those sequences draft
    nothing that step; outputs are unchanged."""
    engine = _engine(checkpoints["llama"], drafts["self"], k=8, num_blocks=24)
    proposer = engine.speculator.proposer
    proposer.kv = RefusalCount(proposer.kv)
    outputs, _ = _generate(engine, PROMPTS, after_step=DraftKvCheck(drafts["self"], "auto"))
    assert outputs == references["llama"]
    assert proposer.kv.num_refused > 0


@dataclass
class StandIn:
    """What the proposer reads of a `Sequence`."""

    seq_id: RequestId
    token_ids: list[int]
    num_prompt_tokens: int


def test_a_sequence_back_in_other_blocks_feeds_them_again(checkpoints, drafts):
    """Preempted and readmitted between two draft calls (no prefix reuse: fresh blocks), a
    sequence's draft K/V is computed again in its new blocks, and its drafts stay the same."""
    runner = load_runner(checkpoints["llama"], num_blocks=32)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, enable_block_reuse=False), 32)
    config = SpeculativeConfig("draft_model", 3, model=str(drafts["self"]))
    proposer = build_proposer(config, DrafterContext(runner, kv, "float32", "auto", None, MAX_MODEL_LEN))
    check = DraftKvCheck(drafts["self"], "auto")
    seq = StandIn(RequestId("s"), PROMPTS[2] + [7], len(PROMPTS[2]))

    def admit() -> list[int]:
        kv.add_sequence(CacheRequest(seq.seq_id, seq.token_ids))
        kv.mark_computed(seq.seq_id, len(seq.token_ids) - 1)
        return kv.block_ids(seq.seq_id)

    before = admit()
    first = proposer.propose([seq], [3])
    check.check(proposer)
    kv.free(seq.seq_id)
    after = admit()
    assert set(after).isdisjoint(before)
    assert proposer.propose([seq], [3]) == first
    check.check(proposer)


def _context(checkpoints, max_model_len=MAX_MODEL_LEN):
    runner = load_runner(checkpoints["llama"], num_blocks=8)
    return DrafterContext(runner, KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 8),
                          "float32", "torch", None, max_model_len)


def test_a_draft_of_another_vocabulary_is_refused(checkpoints, tmp_path):
    draft = make_draft_checkpoint(tmp_path / "other_vocab", checkpoints["llama"].path, vocab_size=301)
    with pytest.raises(ConfigError) as err:
        build_proposer(SpeculativeConfig("draft_model", 4, model=str(draft)), _context(checkpoints))
    assert err.value.field == "speculative_config.model"
    assert "vocabulary" in err.value.reason


def test_a_draft_shorter_than_max_model_len_is_refused(checkpoints, tmp_path):
    draft = make_draft_checkpoint(tmp_path / "short", checkpoints["llama"].path, max_position_embeddings=64)
    with pytest.raises(ConfigError) as err:
        build_proposer(SpeculativeConfig("draft_model", 4, model=str(draft)), _context(checkpoints))
    assert err.value.field == "speculative_config.model"
    assert "max_model_len (128)" in err.value.reason
    build_proposer(SpeculativeConfig("draft_model", 4, model=str(draft)), _context(checkpoints, 64))


def test_a_missing_draft_checkpoint_is_refused_by_name(checkpoints, tmp_path):
    with pytest.raises(ConfigError) as err:
        build_proposer(SpeculativeConfig("draft_model", 4, model=str(tmp_path / "absent")), _context(checkpoints))
    assert err.value.field == "speculative_config.model"
