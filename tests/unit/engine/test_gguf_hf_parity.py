"""load_gguf on the real SmolLM2 GGUF against Hugging Face transformers' own GGUF loading.

transformers dequantizes and un-permutes the same file independently; every tensor must
match bit for bit in float32. Loading the model there takes ~15 s, so it happens once.
"""
import os

import pytest
import torch
import transformers

from pdserve.common.model_source import default_model_path
from pdserve.engine.gguf_loader import load_gguf


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path, dtype=torch.float32)


def test_every_tensor_equals_transformers_state_dict(ours, hf_model):
    _, tensors = ours
    state = hf_model.state_dict()
    assert hf_model.config.tie_word_embeddings is True
    assert sorted(tensors) == sorted(set(state) - {"lm_head.weight"})  # tied: no separate lm_head
    mismatched = [name for name, tensor in tensors.items() if not torch.equal(tensor, state[name])]
    assert mismatched == []
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_config_matches_transformers_config(ours, hf_model):
    config, _ = ours
    hf = hf_model.config
    assert config["hidden_size"] == hf.hidden_size == 576
    assert config["num_hidden_layers"] == hf.num_hidden_layers == 30
    assert config["num_attention_heads"] == hf.num_attention_heads == 9
    assert config["num_key_value_heads"] == hf.num_key_value_heads == 3
    assert config["intermediate_size"] == hf.intermediate_size == 1536
    assert config["head_dim"] == hf.head_dim == 64
    assert config["vocab_size"] == hf.vocab_size == 49152
    assert config["max_position_embeddings"] == hf.max_position_embeddings == 8192
    assert config["rms_norm_eps"] == hf.rms_norm_eps
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
