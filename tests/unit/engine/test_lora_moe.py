"""LoRA on the mixtures of experts: adapters of the attention projections (and of Qwen3-MoE's dense
MLP layers) apply as on a dense model; an adapter of an expert, a router or a sparse layer's MLP
is refused by name, never loaded and silently left out."""
import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from model_builders import TOKENS_PER_BLOCK, blocks_for, chunk, load_runner, prompt, run
from pdserve.common.errors import ConfigError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.loading.lora_files import read_lora_checkpoint
from pdserve.engine.model.lora import LoraSettings
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from tests.lora_builders import ATTENTION, greedy, make_adapter
from token_store_runner import CharTokenizer

MAX_NEW = 8
PROMPTS = [prompt(5, 1), prompt(17, 2), prompt(11, 3)]
SETTINGS = LoraSettings(max_loras=1, max_lora_rank=8)


def save_adapter(folder, tensors: dict[str, torch.Tensor], alpha: int = 4) -> None:
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": alpha}))


def pair(module: str, out: int, inp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    prefix = f"base_model.model.model.{module}."
    return {prefix + "lora_A.weight": torch.randn(4, inp, generator=generator) * 0.3,
            prefix + "lora_B.weight": torch.randn(out, 4, generator=generator) * 0.3}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_an_attention_adapter_on_a_mixture_equals_peft(checkpoints, kernels, tmp_path, kind):
    base = checkpoints[kind]
    peft_model = make_adapter(base.hf_model, tmp_path / "adapter", seed=1, targets=ATTENTION)
    runner = load_runner(base, num_blocks=64, lora=SETTINGS, kernels=kernels)
    engine = LLMEngine(runner, KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), 64), CharTokenizer(),
                       SchedulerConfig(8, 512, 64))
    checkpoint = read_lora_checkpoint(tmp_path / "adapter")
    engine.add_lora(checkpoint)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerationRequest(RequestId(f"r{i}"), tuple(p), params, lora_id=checkpoint.lora_id))
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == [greedy(peft_model, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("name", [
    "layers.0.mlp.experts.1.gate_proj",  # Qwen-MoE, an expert's own projection
    "layers.1.block_sparse_moe.experts.0.w1",  # Mixtral's
    "layers.0.mlp.experts",  # PEFT's adapter of the experts' 3-D parameters
    "layers.0.mlp.gate",  # a router
    "layers.0.block_sparse_moe.gate",
])
def test_an_adapter_of_experts_or_a_router_is_refused_by_name(tmp_path, name):
    save_adapter(tmp_path / "adapter", {**pair("layers.0.self_attn.q_proj", 128, 128), **pair(name, 64, 128)})
    with pytest.raises(ConfigError, match=rf"{name}\.lora_[AB].*not LoRA targets"):
        read_lora_checkpoint(tmp_path / "adapter")


@pytest.mark.parametrize("kind, module", [("qwen3_moe", "down_proj"), ("mixtral", "gate_proj")])
def test_a_dense_mlp_adapter_on_a_sparse_layer_is_refused(checkpoints, tmp_path, kind, module):
    """An adapter of a dense model of the same shape would otherwise load, its MLP pairs never applied."""
    mlp = pair(f"layers.0.mlp.{module}", 128, 128)  # the tiny models' dense intermediate size is 128
    save_adapter(tmp_path / "adapter", {**pair("layers.1.self_attn.o_proj", 128, 128), **mlp})
    runner = load_runner(checkpoints[kind], lora=SETTINGS, kernels="torch")
    with pytest.raises(ConfigError, match=f"layer 0 {module}: the layer's MLP is a mixture of experts"):
        runner.lora.add(read_lora_checkpoint(tmp_path / "adapter"))
    assert len(runner.lora) == 0


def test_an_adapter_of_a_dense_layer_of_qwen3_moe_applies(checkpoints, kernels, tmp_path):
    """Layer 1 of the tiny Qwen3-MoE is dense (mlp_only_layers): its MLP takes adapters; the
    reference is transformers with the delta merged into the weights."""
    base = checkpoints["qwen3_moe"]
    tensors = {**pair("layers.1.mlp.gate_proj", 128, 128, seed=1), **pair("layers.1.mlp.down_proj", 128, 128, seed=2)}
    save_adapter(tmp_path / "adapter", tensors, alpha=8)  # scaling 2
    merged = copy.deepcopy(base.hf_model)
    mlp = merged.model.layers[1].mlp
    with torch.no_grad():
        for projection in (mlp.gate_proj, mlp.down_proj):
            name = "gate_proj" if projection is mlp.gate_proj else "down_proj"
            prefix = f"base_model.model.model.layers.1.mlp.{name}."
            projection.weight += 2 * tensors[prefix + "lora_B.weight"] @ tensors[prefix + "lora_A.weight"]
        ids = prompt(13, seed=9)
        expected = merged(torch.tensor([ids])).logits[0]
    runner = load_runner(base, lora=SETTINGS, kernels=kernels)
    checkpoint = read_lora_checkpoint(tmp_path / "adapter")
    runner.lora.add(checkpoint)
    lora_chunk = dataclasses.replace(chunk("r", ids, 0, blocks_for(0, 13), all_logits=True), lora_id=checkpoint.lora_id)
    [logits] = run(runner, lora_chunk)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert not torch.allclose(logits, base.hf_logits(ids), atol=1e-2)
