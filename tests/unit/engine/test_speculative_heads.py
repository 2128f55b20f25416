"""EAGLE, EAGLE-3 and MTP heads in the engine: greedy output equals the output without
speculation on every forward path, through chunked prefill; every draft equals what the head's
arithmetic written plainly (`tests/head_reference.py`) drafts from transformers' hidden states on
the same tokens; a sequence first seen past position 0 (a cached prefix; a decode worker's
prompt) drafts from what it saw. Heads are random, so acceptance is not asserted here."""
import pytest
import torch

from model_builders import TINY, TOKENS_PER_BLOCK, load_runner, prompt
from native_levels import LEVELS_HERE
from pdserve.common.errors import ConfigError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.speculative import SpeculativeConfig, parse_speculative_config
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.core.speculation import Speculator
from pdserve.engine.spec import eagle, mtp
from pdserve.engine.spec.proposers import DrafterContext, build_proposer, drafter_bytes_per_block
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from tests.head_builders import make_eagle3_head, make_eagle_head, make_mimo_checkpoint
from tests.head_reference import ReferenceHead
from token_store_runner import CharTokenizer

MAX_NEW = 10
PROMPTS = [prompt(3, 1), prompt(21, 3), prompt(9, 2) * 2]
K = 3


class Recorded:
    """The proposer under test, each call's drafts kept with the tokens they followed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[tuple[int, ...], int, int, list[int]]] = []

    def propose(self, seqs, num_tokens):
        drafts = self.inner.propose(seqs, num_tokens)
        for seq, n, d in zip(seqs, num_tokens, drafts):
            self.calls.append((tuple(seq.token_ids), seq.num_computed_tokens, n, d))
        return drafts

    def observe(self, batch, output):
        self.inner.observe(batch, output)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, checkpoints):
    """method -> (target checkpoint, its transformers model, the head's folder)."""
    root = tmp_path_factory.mktemp("heads")
    llama = checkpoints["llama"]
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(4)
    deep_model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 8})).eval()
    deep_model.save_pretrained(root / "deep")
    mimo = make_mimo_checkpoint(root / "mimo")
    return {
        "eagle": (llama.path, llama.hf_model, make_eagle_head(root / "eagle", llama.path)),
        "eagle3": (root / "deep", deep_model, make_eagle3_head(root / "eagle3", root / "deep")),
        "mtp": (root / "mimo", mimo, root / "mimo"),
    }


def _engine(target_path, method, head_dir, kernels, budget=8, num_blocks=64, k=K, dtype="float32"):
    runner = load_runner(_Path(target_path), num_blocks=num_blocks, kernels=kernels, dtype=dtype)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), num_blocks)
    config = SchedulerConfig(8, budget, 128)
    speculator = None
    if method is not None:
        spec = SpeculativeConfig(method, k, model=str(head_dir))
        speculator = Speculator(spec, Recorded(build_proposer(spec, DrafterContext(runner, kv))), kv, config.max_model_len)
    return LLMEngine(runner, kv, CharTokenizer(), config, speculator=speculator)


class _Path:
    """load_runner takes a TinyCheckpoint; these targets are folders."""

    def __init__(self, path) -> None:
        self.path = path


def _generate(engine, prompts, tag="a", max_new=MAX_NEW):
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(RequestId(f"{tag}{i}"), tuple(p), sampling))
    out: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_work:
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        engine.kv.check_integrity()
    assert not engine.has_work and engine.kv.num_used_blocks == 0
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def references(heads):
    return {method: _generate(_engine(target, None, None, "torch"), PROMPTS) for method, (target, _, _) in heads.items()}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_greedy_output_unchanged_and_drafts_follow_the_head(heads, references, kernels, method):
    target, hf_model, head_dir = heads[method]
    engine = _engine(target, method, head_dir, kernels)
    assert _generate(engine, PROMPTS) == references[method]
    calls = engine.speculator.proposer.calls
    drafted = [c for c in calls if c[3]]
    assert len(drafted) >= len(PROMPTS) * 2  # every sequence drafted, several times
    reference = ReferenceHead(method, head_dir, hf_model)
    for token_ids, computed, budget, drafts in calls:
        assert drafts == reference.drafts(list(token_ids), computed, budget), (token_ids, computed)
    _generate(engine, [prompt(4, 11)], tag="z", max_new=2)
    assert set(engine.speculator.proposer.inner._tracks) <= {"z0"}  # finished sequences are let go at the next step


def _second_after_first(heads, first_prompt, second_prompt):
    """The drafts of a second request after a first one cached its prompt's blocks, with the
    first position the head read from for it."""
    target, hf_model, head_dir = heads["eagle"]
    engine = _engine(target, "eagle", head_dir, "torch", budget=64)
    _generate(engine, [first_prompt], tag="first", max_new=2)
    engine.speculator.proposer.calls.clear()
    _generate(engine, [second_prompt], tag="second", max_new=6)
    calls = engine.speculator.proposer.calls
    assert calls and all(c[3] for c in calls)
    return calls, engine.speculator.proposer.inner._tracks["second0"].first, ReferenceHead("eagle", head_dir, hf_model)


def test_a_cached_prefix_the_head_wrote_is_read_again(heads):
    """The second request finds the first's prompt blocks cached, the head's K/V in them written
    for the same tokens through the next block's first: it reads them as if it had watched."""
    shared = prompt(13, 9)
    calls, first, reference = _second_after_first(heads, shared, shared + prompt(3, 10))
    assert first == 0
    for token_ids, computed, budget, drafts in calls:
        assert drafts == reference.drafts(list(token_ids), computed, budget)


def test_a_sequence_first_seen_past_position_0_drafts_from_what_it_saw(heads):
    """Here the token after the cached blocks differs: the last block's head K/V was written for
    another successor, so the head starts at the first computed position and attends from there
    (a decode worker's prompt is the same case: no head K/V at all)."""
    shared = prompt(12, 9)
    calls, first, reference = _second_after_first(heads, shared + [5], shared + [6] + prompt(3, 10))
    cached = len(shared)
    assert first == cached
    whole_context = 0
    for token_ids, computed, budget, drafts in calls:
        assert drafts == reference.drafts(list(token_ids), computed, budget, first=cached)
        whole_context += drafts == reference.drafts(list(token_ids), computed, budget)
    assert whole_context < len(calls)  # the context the head saw made a difference


def test_eagle3_reads_vllms_default_layers_or_its_configs(heads, tmp_path):
    target, _, _ = heads["eagle3"]
    runner = load_runner(_Path(target), num_blocks=8, kernels="torch")
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 8)
    default = eagle.load(SpeculativeConfig("eagle3", 2, model=str(heads["eagle3"][2])), DrafterContext(runner, kv))
    assert default.head.capture.layers == (2, 4, 5)
    own = make_eagle3_head(tmp_path / "own", target, aux_layers=[1, 3, 7])
    assert eagle.load(SpeculativeConfig("eagle3", 2, model=str(own)), DrafterContext(runner, kv)).head.capture.layers == (1, 3, 7)
    assert runner.capture.layers == (1, 3, 7)


def test_eagle3_with_its_own_embedding_follows_the_reference(heads, tmp_path):
    target, hf_model, _ = heads["eagle3"]
    head_dir = make_eagle3_head(tmp_path / "embed", target, seed=5, own_embedding=True)
    engine = _engine(target, "eagle3", head_dir, "torch")
    _generate(engine, PROMPTS[:2])
    reference = ReferenceHead("eagle3", head_dir, hf_model)
    calls = engine.speculator.proposer.calls
    assert calls
    for token_ids, computed, budget, drafts in calls:
        assert drafts == reference.drafts(list(token_ids), computed, budget)


def test_heads_that_do_not_fit_are_refused_by_name(heads, checkpoints, tmp_path):
    llama = checkpoints["llama"]
    runner = load_runner(llama, num_blocks=8, kernels="torch")
    context = DrafterContext(runner, KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 8))
    shallow = make_eagle3_head(tmp_path / "shallow", llama.path)  # a 2-layer target has no layers 2, 1, -1
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        eagle.load(SpeculativeConfig("eagle3", 2, model=str(shallow)), context)
    with pytest.raises(ConfigError, match="use method 'eagle3'"):
        eagle.load(SpeculativeConfig("eagle", 2, model=str(shallow)), context)
    with pytest.raises(ConfigError, match="use method 'eagle'"):
        eagle.load(SpeculativeConfig("eagle3", 2, model=str(heads["eagle"][2])), context)
    other_vocab = make_eagle_head(tmp_path / "vocab", heads["mtp"][0])
    _rewrite_config(other_vocab, vocab_size=512)
    with pytest.raises(ConfigError, match="vocabulary has 512 tokens"):
        eagle.load(SpeculativeConfig("eagle", 2, model=str(other_vocab)), context)
    with pytest.raises(ConfigError, match="MTP layers are served for MiMoForCausalLM"):
        mtp.load(SpeculativeConfig("mtp", 1, model=str(llama.path)), context)


def _rewrite_config(folder, **fields):
    import json
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


def test_the_worker_budgets_one_layer_of_head_kv_per_block(heads):
    eagle_spec = SpeculativeConfig("eagle", 2, model=str(heads["eagle"][2]))
    mtp_spec = parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1}, str(heads["mtp"][0]))
    assert mtp_spec.model == str(heads["mtp"][0])
    # one layer: K and V of 4 tokens, 2 KV heads of 32
    assert drafter_bytes_per_block(eagle_spec, TOKENS_PER_BLOCK, torch.float32) == 2 * 4 * 2 * 32 * 4
    assert drafter_bytes_per_block(mtp_spec, TOKENS_PER_BLOCK, torch.bfloat16) == 2 * 4 * 2 * 32 * 2
    assert drafter_bytes_per_block(mtp_spec, TOKENS_PER_BLOCK, torch.float8_e4m3fn) == 2 * 4 * 2 * 32 * 2


def test_block_records_key_the_tokens_through_the_next_blocks_first():
    from pdserve.engine.spec.head_blocks import BlockDigests, HeadBlocks
    blocks = HeadBlocks(tokens_per_block=2)
    tokens = [5, 6, 7, 8, 9]
    blocks.record(BlockDigests(None, tokens), [10, 11], 0, 2)
    assert blocks.holds(BlockDigests(None, tokens), [10, 11], 2)
    assert blocks.holds(BlockDigests(None, tokens[:4] + [1]), [10, 11], 1)  # block 0 reads tokens 0..2
    assert not blocks.holds(BlockDigests(None, tokens[:4] + [1]), [10, 11], 2)  # another successor
    assert not blocks.holds(BlockDigests(3, tokens), [10, 11], 1)  # another adapter
    assert not blocks.holds(BlockDigests(None, tokens), [10, 12], 2)  # another block
    blocks.forget([11])
    assert not blocks.holds(BlockDigests(None, tokens), [10, 11], 2)


def test_a_mimo_checkpoints_body_is_served_as_qwen2(heads, kernels):
    """MiMoForCausalLM: its body's logits are transformers' Qwen2's; its MTP tensors sit beside."""
    from model_builders import chunk, run
    target, hf_model, _ = heads["mtp"]
    ids = prompt(11, 12)
    [logits] = run(load_runner(_Path(target), kernels=kernels), chunk("m", ids, 0, [0, 1, 2], all_logits=True))
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_greedy_output_unchanged_through_preemption(heads, references, method):
    """Too few blocks for every sequence: preempted ones recompute (the head starts them again),
    and drafts that find no free slots are not made."""
    target, _, head_dir = heads[method]
    engine = _engine(target, method, head_dir, "torch", num_blocks=12)
    assert _generate(engine, PROMPTS) == references[method]


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_greedy_output_unchanged_in_bfloat16(heads, level, method):
    """The heads' matrices in bf16, multiplied as the target's are (the AVX2 kernels' panels).
    Native kernels only: there a row's bits do not depend on the chunk it is computed in; torch
    ops in bf16 compute a verified chunk's rows with other roundings than single decode steps,
    which can flip a near-tie whatever drafts them."""
    target, _, head_dir = heads[method]
    kernels = level
    plain = _generate(_engine(target, None, None, kernels, dtype="bfloat16"), PROMPTS)
    engine = _engine(target, method, head_dir, kernels, dtype="bfloat16")
    assert _generate(engine, PROMPTS) == plain
    assert any(c[3] for c in engine.speculator.proposer.calls)


@pytest.mark.parametrize("fields, named", [({"num_hidden_layers": 2}, "num_hidden_layers"),
                                           ({"add_para_norm": True}, "add_para_norm"),
                                           ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state")])
def test_head_variants_not_computed_are_refused_by_name(heads, tmp_path, fields, named):
    target, _, _ = heads["eagle"]
    runner = load_runner(_Path(target), num_blocks=8, kernels="torch")
    context = DrafterContext(runner, KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 8))
    head = make_eagle_head(tmp_path / "variant", target)
    _rewrite_config(head, **fields)
    with pytest.raises(ConfigError, match=named):
        eagle.load(SpeculativeConfig("eagle", 2, model=str(head)), context)


def test_an_eagle3_head_stored_under_layers_0_loads_as_vllm_renames_it(heads, tmp_path):
    """Converted EAGLE-3 heads keep the midlayer as `layers.0.*` (vLLM renames midlayer to it)."""
    from safetensors.torch import load_file, save_file
    target, hf_model, original = heads["eagle3"]
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    tensors = {n.replace("midlayer.", "layers.0."): t for n, t in load_file(str(original / "model.safetensors")).items()}
    save_file(tensors, str(renamed / "model.safetensors"))
    (renamed / "config.json").write_text((original / "config.json").read_text())
    first = _engine(target, "eagle3", original, "torch")
    second = _engine(target, "eagle3", renamed, "torch")
    _generate(first, PROMPTS[:1])
    _generate(second, PROMPTS[:1])
    assert first.speculator.proposer.calls == second.speculator.proposer.calls
