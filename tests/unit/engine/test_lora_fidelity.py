"""Multi-LoRA in the engine against PEFT, float32: requests for two random adapters and for the
base model in one batch give PEFT's (and transformers') greedy tokens, on torch ops and on the
native kernels of every ISA level this CPU runs; a prefix cached under one adapter is never reused
by another or by the base model; bad adapters are refused by name."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from model_builders import TOKENS_PER_BLOCK, blocks_for, chunk, load_runner, prompt, run
from native_levels import LEVELS_HERE
from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.loading.lora_files import read_lora_checkpoint
from pdserve.engine.model.lora import LoraSettings
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from tests.lora_builders import ATTENTION, greedy as peft_greedy, make_adapter
from token_store_runner import CharTokenizer

MAX_NEW = 8
_references: dict[tuple[int, tuple[int, ...]], list[int]] = {}


def greedy(model: torch.nn.Module, tokens: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's (or transformers') greedy tokens, computed once per model and prompt."""
    key = (id(model), tuple(tokens))
    if key not in _references:
        _references[key] = peft_greedy(model, tokens, max_new_tokens)
    return _references[key]


PROMPTS = [prompt(5, 1), prompt(17, 2), prompt(11, 3), prompt(26, 4), prompt(9, 5), prompt(14, 6)]


# Qwen3 and Gemma 3 have the usual projections (q/k norms and Gemma's sandwich norms around them)
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def family(request, checkpoints, tmp_path_factory):
    """The base checkpoint, two adapters (all projections r=8; q/k/v/o r=4 with rsLoRA), and
    each one's PEFT model."""
    base = checkpoints[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    first = make_adapter(base.hf_model, root / "first", seed=1)
    second = make_adapter(base.hf_model, root / "second", seed=2, targets=ATTENTION, r=4, alpha=8, use_rslora=True)
    return base, {"first": (root / "first", first), "second": (root / "second", second)}


def _engine(checkpoint, settings=LoraSettings(max_loras=2, max_lora_rank=8), budget=512,
            kernels="torch") -> LLMEngine:
    runner = load_runner(checkpoint, num_blocks=96, lora=settings, kernels=kernels)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 96)
    return LLMEngine(runner, kv, CharTokenizer(), SchedulerConfig(8, budget, 64))


def _loaded(engine: LLMEngine, adapters: dict) -> dict[str, int]:
    ids = {}
    for name, (path, _) in adapters.items():
        checkpoint = read_lora_checkpoint(path)
        engine.add_lora(checkpoint)
        ids[name] = checkpoint.lora_id
    return ids


def _request(rid: str, tokens: list[int], lora_id: int | None) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), tuple(tokens), SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                           ignore_eos=True), lora_id=lora_id)


def _run(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], int]]:
    """Every request's tokens and cached prompt tokens, all admitted before the first step."""
    for request in requests:
        engine.add_request(request)
    out: dict[str, tuple[list[int], int]] = {}
    while engine.has_work:
        for o in engine.step():
            tokens, cached = out.get(o.request_id, ([], 0))
            out[o.request_id] = (tokens + list(o.token_ids), max(cached, o.num_cached_tokens))
        engine.kv.check_integrity()
    return out


def test_one_batch_of_two_adapters_and_the_base_model_equals_peft(family, kernels):
    base, adapters = family
    engine = _engine(base, kernels=kernels)
    ids = _loaded(engine, adapters)
    names = [None, "first", "second"]  # each prompt under each, interleaved in one batch
    requests = [_request(f"r{i}-{name}", p, ids.get(name)) for i, p in enumerate(PROMPTS) for name in names]
    got = _run(engine, requests)
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}-None"][0] == greedy(base.hf_model, p, MAX_NEW)
        for name, (_, peft_model) in adapters.items():
            assert got[f"r{i}-{name}"][0] == greedy(peft_model, p, MAX_NEW), (i, name)
    # the adapters change the output (else the comparisons above would prove nothing)
    assert sum(got[f"r{i}-first"][0] != got[f"r{i}-None"][0] for i in range(len(PROMPTS))) >= len(PROMPTS) - 1
    assert sum(got[f"r{i}-second"][0] != got[f"r{i}-None"][0] for i in range(len(PROMPTS))) >= len(PROMPTS) - 1


def test_chunked_prefill_under_an_adapter_equals_peft(family, kernels):
    base, adapters = family
    engine = _engine(base, budget=7, kernels=kernels)  # chunks of odd lengths, adapters' rows split across steps
    ids = _loaded(engine, adapters)
    got = _run(engine, [_request("a", PROMPTS[3], ids["first"]), _request("b", PROMPTS[1], ids["second"])])
    assert got["a"][0] == greedy(adapters["first"][1], PROMPTS[3], MAX_NEW)
    assert got["b"][0] == greedy(adapters["second"][1], PROMPTS[1], MAX_NEW)


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_a_bf16_model_on_the_native_kernels_adds_each_adapters_delta(family, level):
    """A bf16 model's deltas are computed in float32 and rounded once: every prompt position's
    logits under each adapter, and the base model's, are the float32 torch path's within bf16's
    rounding, in one batch of all three."""
    base, adapters = family
    settings = LoraSettings(max_loras=2, max_lora_rank=8)
    runners = {"bf16": load_runner(base, lora=settings, kernels=level, dtype="bfloat16"),
               "f32": load_runner(base, lora=settings, kernels="torch")}
    ids = {}
    for runner in runners.values():
        for name, (path, _) in adapters.items():
            checkpoint = read_lora_checkpoint(path)
            runner.lora.add(checkpoint)
            ids[name] = checkpoint.lora_id
    tokens = PROMPTS[3]
    span = len(blocks_for(0, len(tokens)))
    chunks = [dataclasses.replace(chunk(f"r-{name}", tokens, 0, blocks_for(i * span, len(tokens)), all_logits=True,
                                        is_prompt=True), lora_id=ids.get(name))
              for i, name in enumerate([None, "first", "second"])]
    got = {name: logits.float() for name, logits in zip([None, "first", "second"], run(runners["bf16"], *chunks))}
    want = {name: logits.float() for name, logits in zip([None, "first", "second"], run(runners["f32"], *chunks))}
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0.15, rtol=0.05, msg=lambda m: f"{name}: {m}")
    # each adapter moves the logits past that tolerance (else the check proves nothing)
    for name in ("first", "second"):
        assert not torch.allclose(want[name], want[None], atol=0.15, rtol=0.05)


def test_a_prefix_cached_under_one_adapter_serves_only_that_adapter(family):
    base, adapters = family
    engine = _engine(base)
    ids = _loaded(engine, adapters)
    shared = PROMPTS[3]
    _run(engine, [_request("warm", shared, ids["first"])])
    got = _run(engine, [_request("other", shared, ids["second"]), _request("base", shared, None)])
    assert got["other"][1] == 0 and got["base"][1] == 0
    again = _run(engine, [_request("same", shared, ids["first"])])
    assert again["same"][1] == (len(shared) - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
    assert again["same"][0] == greedy(adapters["first"][1], shared, MAX_NEW)


def test_an_unloaded_adapter_is_refused_and_its_running_requests_finish(family):
    base, adapters = family
    engine = _engine(base)
    ids = _loaded(engine, adapters)
    engine.add_request(_request("running", PROMPTS[0], ids["first"]))
    tokens = [t for o in engine.step() for t in o.token_ids]
    engine.remove_lora(ids["first"])
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.add_request(_request("late", PROMPTS[1], ids["first"]))
    while engine.has_work:
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert tokens == greedy(adapters["first"][1], PROMPTS[0], MAX_NEW)
    engine.step()
    assert ids["first"] not in engine.runner.lora and ids["second"] in engine.runner.lora


def test_adapters_that_do_not_fit_are_refused_by_name(family, tmp_path):
    base, adapters = family
    engine = _engine(base, LoraSettings(max_loras=1, max_lora_rank=4))
    with pytest.raises(ConfigError, match="rank 8 exceeds"):
        engine.add_lora(read_lora_checkpoint(adapters["first"][0]))
    engine.add_lora(read_lora_checkpoint(adapters["second"][0]))
    with pytest.raises(ConfigError, match="max_loras"):
        engine.add_lora(read_lora_checkpoint(adapters["first"][0]))
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        read_lora_checkpoint(tmp_path)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["second"][0] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((adapters["second"][0] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="use_dora"):
        read_lora_checkpoint(dora)


def test_an_adapter_of_another_model_is_refused(family, tmp_path):
    base, _ = family
    engine = _engine(base)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj."
    save_file({prefix + "lora_A.weight": torch.ones(4, 64), prefix + "lora_B.weight": torch.ones(128, 4)},
              tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with pytest.raises(ConfigError, match="another model"):
        engine.add_lora(read_lora_checkpoint(tmp_path))
    assert len(engine.runner.lora) == 0


def test_the_same_files_give_the_same_id_and_other_files_another(family):
    _, adapters = family
    first, second = (read_lora_checkpoint(adapters[n][0]) for n in ("first", "second"))
    assert read_lora_checkpoint(adapters["first"][0]).lora_id == first.lora_id
    assert first.lora_id != second.lora_id and 0 <= first.lora_id < 2**63


def test_lora_runs_on_the_native_kernels_where_they_run(checkpoints, family):
    """With adapters enabled the native kernels still run the steps (each adapter's pairs copied
    for them when it loads); torch ops only where asked for."""
    base, adapters = family
    native = load_runner(base, kernels="auto", lora=LoraSettings(max_loras=2, max_lora_rank=8))
    if native.native is None:
        pytest.skip("no native kernels run on this CPU")
    engine = LLMEngine(native, KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 64), CharTokenizer(),
                       SchedulerConfig(8, 512, 64))
    ids = _loaded(engine, adapters)
    assert all(native.lora.plan([(i, 1)]).groups[0][0].kernel_weights is not None for i in ids.values())
    assert load_runner(base, kernels="torch", lora=LoraSettings()).native is None
