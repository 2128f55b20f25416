"""load_gguf on small GGUF files written here: names, Q/K un-permutation, dequantization, errors."""
import gguf
import numpy as np
import pytest
import torch

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.gguf_families import LLAMA, PHI3, hf_target
from pdserve.engine.loading.gguf_loader import load_gguf, load_gguf_config, unpermute_rope_rows

from gguf_builders import (FFN, HEAD_DIM, HIDDEN, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, VOCAB, llama_cpp_permute,
                           make_hf_weights, write_gguf)


def test_f32_tensors_come_back_with_hf_names_and_hf_row_order(tmp_path):
    weights = make_hf_weights(untied=False)
    write_gguf(tmp_path / "m.gguf", weights)
    config, tensors = load_gguf(str(tmp_path / "m.gguf"))
    assert sorted(tensors) == sorted(weights)
    for name, array in weights.items():
        assert torch.equal(tensors[name], torch.from_numpy(array)), name
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": pytest.approx(1e-5), "rope_theta": 50000.0, "max_position_embeddings": 256,
        "vocab_size": VOCAB, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


def test_untied_output_becomes_lm_head(tmp_path):
    weights = make_hf_weights(untied=True)
    write_gguf(tmp_path / "m.gguf", weights)
    config, tensors = load_gguf(str(tmp_path / "m.gguf"))
    assert config["tie_word_embeddings"] is False
    assert torch.equal(tensors["lm_head.weight"], torch.from_numpy(weights["lm_head.weight"]))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_quantized_tensors_are_dequantized_then_cast(tmp_path, qtype):
    weights = make_hf_weights(untied=False)
    quantized = ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    write_gguf(tmp_path / "m.gguf", weights, quantize={name: qtype for name in quantized})
    _, tensors = load_gguf(str(tmp_path / "m.gguf"), dtype=torch.bfloat16)
    for name in quantized:
        reference = gguf.quants.dequantize(gguf.quants.quantize(weights[name], qtype), qtype)
        assert tensors[name].dtype == torch.bfloat16
        assert torch.equal(tensors[name], torch.from_numpy(reference).to(torch.bfloat16)), name
        assert not torch.equal(tensors[name].float(), torch.from_numpy(weights[name]))  # really quantized


def test_unpermute_inverts_llama_cpp_permute_for_every_head_count():
    weight = np.arange(8 * HEAD_DIM * 3, dtype=np.float32).reshape(8 * HEAD_DIM, 3)
    for num_heads in (1, 2, 8):
        assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(weight, num_heads), num_heads), weight)


def test_qk_biases_are_unpermuted_too(tmp_path):
    rng = np.random.default_rng(1)
    q_bias = rng.standard_normal(NUM_HEADS * HEAD_DIM, dtype=np.float32)
    k_bias = rng.standard_normal(NUM_KV_HEADS * HEAD_DIM, dtype=np.float32)
    extra = [("blk.0.attn_q.bias", llama_cpp_permute(q_bias[:, None], NUM_HEADS)[:, 0]),
             ("blk.0.attn_k.bias", llama_cpp_permute(k_bias[:, None], NUM_KV_HEADS)[:, 0])]
    write_gguf(tmp_path / "m.gguf", make_hf_weights(untied=False), extra=extra)
    config, tensors = load_gguf(str(tmp_path / "m.gguf"))
    assert config["attention_bias"] is True
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(q_bias))
    assert torch.equal(tensors["model.layers.0.self_attn.k_proj.bias"], torch.from_numpy(k_bias))


def test_other_architectures_raise_config_error_naming_it(tmp_path):
    write_gguf(tmp_path / "m.gguf", make_hf_weights(untied=False), arch="falcon")  # not a family served
    with pytest.raises(ConfigError) as err:
        load_gguf(str(tmp_path / "m.gguf"))
    assert (err.value.field, err.value.value) == ("general.architecture", "falcon")
    with pytest.raises(ConfigError):
        load_gguf_config(str(tmp_path / "m.gguf"))


def test_unknown_tensor_raises_config_error_naming_it(tmp_path):
    extra = [("rope_freqs.weight", np.ones(HEAD_DIM // 2, dtype=np.float32))]
    write_gguf(tmp_path / "m.gguf", make_hf_weights(untied=False), extra=extra)
    with pytest.raises(ConfigError) as err:
        load_gguf(str(tmp_path / "m.gguf"))
    assert (err.value.field, err.value.value) == ("tensor", "rope_freqs.weight")


def test_hf_tensor_names():
    assert hf_target(LLAMA, "token_embd.weight").name == "model.embed_tokens.weight"
    assert hf_target(LLAMA, "output.weight").name == "lm_head.weight"
    assert hf_target(LLAMA, "blk.12.attn_output.weight").name == "model.layers.12.self_attn.o_proj.weight"
    assert hf_target(LLAMA, "blk.0.attn_q.bias").name == "model.layers.0.self_attn.q_proj.bias"
    assert hf_target(LLAMA, "blk.3.ffn_norm.weight").name == "model.layers.3.post_attention_layernorm.weight"
    assert hf_target(PHI3, "blk.0.attn_qkv.weight").name == "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(ConfigError):
        hf_target(LLAMA, "blk.0.attn_qkv.weight")
