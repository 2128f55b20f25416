"""load_gguf on GGUF files of Qwen3, Gemma 3, Phi-3, Mixtral and Qwen3-MoE, each written from a
tiny HF checkpoint as llama.cpp's converter writes it: the HF tensors and the HF model config
come back. The one field a GGUF never carries is the checkpoint's dtype (a GGUF config says
bfloat16: `gguf_config`)."""
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from pdserve.engine.loading.gguf_loader import load_gguf, load_gguf_config
from pdserve.engine.loading.model_config import ModelConfig

from gguf_builders import make_family_source, write_hf_gguf

FAMILIES = ["qwen2", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe"]
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """kind -> (HF checkpoint dir, config.json, tensors): the builders' checkpoint, norms randomized."""
    root, made = tmp_path_factory.mktemp("families"), {}

    def source(kind: str):
        if kind not in made:
            made[kind] = (root / kind, *make_family_source(root / kind, kind, seed=len(made)))
        return made[kind]
    return source


def gguf_of(source, tmp_path, qtype=None, meta=None) -> str:
    _, config, tensors = source
    path = tmp_path / "m.gguf"
    write_hf_gguf(path, config, tensors, qtype=qtype, meta=meta)
    return str(path)


def expected_tensors(kind: str, config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The HF tensors as a GGUF gives them back. Gemma's norms are stored as 1 + w in float32, so
    w comes back as (1 + w) - 1, within an ulp of 1 of w."""
    if config.get("tie_word_embeddings"):
        tensors = {name: t for name, t in tensors.items() if name != "lm_head.weight"}
    if kind == "gemma3":
        tensors = {name: (t + 1) - 1 if name.endswith("norm.weight") else t for name, t in tensors.items()}
    return tensors


@pytest.mark.parametrize("kind", FAMILIES)
def test_f32_gguf_gives_the_hf_tensors(sources, tmp_path, kind):
    _, config, hf = sources(kind)
    _, tensors = load_gguf(gguf_of(sources(kind), tmp_path))
    expected = expected_tensors(kind, config, hf)
    assert sorted(tensors) == sorted(expected)
    mismatched = [name for name, t in expected.items() if not torch.equal(tensors[name], torch.from_numpy(t))]
    assert mismatched == []


def test_gemma_norms_lose_at_most_an_ulp_of_one(sources, tmp_path):
    _, _, hf = sources("gemma3")
    _, tensors = load_gguf(gguf_of(sources("gemma3"), tmp_path))
    norms = [name for name in hf if name.endswith("norm.weight")]
    assert len(norms) == 1 + 2 * 6  # the final norm; per layer input, q, k, post-attention, pre- and post-MLP
    for name in norms:
        torch.testing.assert_close(tensors[name], torch.from_numpy(hf[name]), atol=2 ** -23, rtol=0)


def test_gemma_norms_are_shifted_in_float32_then_cast(sources, tmp_path):
    _, config, hf = sources("gemma3")
    _, tensors = load_gguf(gguf_of(sources("gemma3"), tmp_path), dtype=torch.bfloat16)
    for name, t in expected_tensors("gemma3", config, hf).items():
        assert torch.equal(tensors[name], torch.from_numpy(t).to(torch.bfloat16)), name


@pytest.mark.parametrize("kind", FAMILIES)
def test_quantized_gguf_gives_the_dequantized_hf_tensors(sources, tmp_path, kind):
    _, config, hf = sources(kind)
    _, tensors = load_gguf(gguf_of(sources(kind), tmp_path, qtype=Q8_0))
    for name, t in expected_tensors(kind, config, hf).items():
        reference = gguf.quants.dequantize(gguf.quants.quantize(t, Q8_0), Q8_0) if t.ndim >= 2 else t
        assert torch.equal(tensors[name], torch.from_numpy(reference)), name
    assert not torch.equal(tensors["model.embed_tokens.weight"], torch.from_numpy(hf["model.embed_tokens.weight"]))


@pytest.mark.parametrize("kind", FAMILIES)
def test_gguf_config_is_the_hf_model_config(sources, tmp_path, kind):
    _, hf_config, _ = sources(kind)
    path = gguf_of(sources(kind), tmp_path)
    config, _ = load_gguf(path)
    assert load_gguf_config(path) == config
    assert config["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_hf_config(config) == replace(ModelConfig.from_hf_config(hf_config), torch_dtype="bfloat16")


@pytest.mark.parametrize("kind, architecture", [
    ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"), ("phi3", "Phi3ForCausalLM"),
    ("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_gguf_config_names_the_hf_architecture(sources, tmp_path, kind, architecture):
    config = load_gguf_config(gguf_of(sources(kind), tmp_path))
    assert config["architectures"] == [architecture]
