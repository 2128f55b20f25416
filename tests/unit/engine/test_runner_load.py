"""ModelRunner.load from sharded, single-file and GGUF checkpoints; typed errors for what it refuses."""
import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from pdserve.common.errors import ConfigError
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.loading.weights import load_model_config

from model_builders import TINY, chunk, load_runner, make_checkpoint, prompt, run


def test_sharded_checkpoint_loads_and_matches(tmp_path, checkpoints):
    sharded = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert len(list(sharded.path.glob("*.safetensors"))) > 1
    assert (sharded.path / "model.safetensors.index.json").is_file()
    ids = prompt(10, seed=1)
    [logits] = run(load_runner(sharded), chunk("r", ids, 0, [0, 1, 2], all_logits=True))
    torch.testing.assert_close(logits, checkpoints["llama"].hf_logits(ids), atol=1e-4, rtol=0)


def test_properties_and_budget_sizing(checkpoints):
    runner = ModelRunner.load(checkpoints["llama"].path, dtype="bfloat16", device="cpu",
                              kv_cache_bytes=10 * 2048 + 5, tokens_per_block=4)
    # 2 layers * (K, V) * 4 tokens * 2 heads * 32 dims * 2 bytes
    assert runner.bytes_per_block == 2048
    assert runner.num_blocks == 10
    assert runner.kv_tensor.shape == (10, 2, 2, 4, 2, 32)
    assert (runner.dtype, runner.device, runner.config.vocab_size) == (torch.bfloat16, torch.device("cpu"), 300)


def test_auto_dtype_follows_the_checkpoint(tmp_path, checkpoints):
    shutil.copytree(checkpoints["llama"].path, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"dtype": "bfloat16"}))
    runner = ModelRunner.load(tmp_path / "m", dtype="auto", device="cpu", num_blocks=4)
    assert (runner.dtype, runner.kv_tensor.dtype) == (torch.bfloat16, torch.bfloat16)
    assert load_runner(checkpoints["llama"], dtype="auto").dtype == torch.float32


def test_auto_dtype_of_a_float16_checkpoint_on_a_cpu_is_float32(tmp_path, checkpoints):
    """float32 holds every float16 weight exactly and runs on the native kernels; float16 would
    run on torch ops. Asked for by name, float16 is served as asked."""
    shutil.copytree(checkpoints["llama"].path, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"dtype": "float16"}))
    runner = ModelRunner.load(tmp_path / "m", dtype="auto", device="cpu", num_blocks=4)
    assert (runner.dtype, runner.kv_tensor.dtype) == (torch.float32, torch.float32)
    assert ModelRunner.load(tmp_path / "m", dtype="float16", device="cpu", num_blocks=4).dtype == torch.float16


def test_unsupported_architecture(tmp_path, checkpoints):
    shutil.copytree(checkpoints["llama"].path, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_runner_at(tmp_path / "m")


@pytest.mark.parametrize("remove, message", [("config.json", "no config.json"),
                                             ("model.safetensors", "neither model.safetensors")])
def test_missing_file(tmp_path, checkpoints, remove, message):
    shutil.copytree(checkpoints["llama"].path, tmp_path / "m")
    (tmp_path / "m" / remove).unlink()
    with pytest.raises(ConfigError, match=message) as err:
        load_runner_at(tmp_path / "m")
    assert err.value.field == "model_path"


def test_missing_shard(tmp_path):
    sharded = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    next(sharded.path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ConfigError, match="shards listed"):
        load_runner_at(sharded.path)


def test_missing_tensor_is_named(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file
    shutil.copytree(checkpoints["llama"].path, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight"):
        load_runner_at(tmp_path / "m")


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "int8", "num_blocks": 4}, "dtype"),
    ({"num_blocks": 4, "kv_cache_bytes": 4096}, "num_blocks"),
    ({}, "num_blocks"),
    ({"num_blocks": 4, "kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
    ({"num_blocks": 4, "tokens_per_block": 6}, "tokens_per_block"),
    ({"num_blocks": 4, "device": "mps"}, "device"),
])
def test_bad_load_arguments(checkpoints, kwargs, field):
    with pytest.raises(ConfigError) as err:
        ModelRunner.load(checkpoints["llama"].path, **kwargs)
    assert err.value.field == field


def load_runner_at(path):
    return ModelRunner.load(path, device="cpu", num_blocks=4)


def write_gguf(path, hf_model) -> None:
    """A float32 GGUF of the tiny Llama, with llama.cpp's Q/K row order and tensor names."""
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden = TINY["hidden_size"]
    for key, value in [("block_count", 2), ("context_length", 256), ("embedding_length", hidden),
                       ("feed_forward_length", 128), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("rope.dimension_count", hidden // 4), ("vocab_size", 300)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.numpy()
        heads = {"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2])
        if heads:  # llama.cpp interleaves each head's two rotary halves
            array = array.reshape(heads, 2, -1, hidden).swapaxes(1, 2).reshape(array.shape)
        parts = name.removesuffix(".weight").split(".")
        if name == "lm_head.weight":
            gguf_name = "output"
        elif parts[1] == "layers":
            gguf_name = f"blk.{parts[2]}.{names['.'.join(parts[3:])]}"
        else:
            gguf_name = names[parts[1]]
        writer.add_tensor(gguf_name + ".weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_loads_through_the_gguf_loader(tmp_path, checkpoints):
    write_gguf(tmp_path / "tiny.gguf", checkpoints["llama"].hf_model)
    assert load_model_config(tmp_path / "tiny.gguf").num_kv_heads == 2
    runner = ModelRunner.load(tmp_path / "tiny.gguf", device="cpu", num_blocks=8, tokens_per_block=4)
    ids = prompt(10, seed=2)
    [logits] = run(runner, chunk("r", ids, 0, [3, 4, 5], all_logits=True))
    torch.testing.assert_close(logits, checkpoints["llama"].hf_logits(ids), atol=1e-4, rtol=0)
    assert TINY["vocab_size"] == runner.config.vocab_size


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ConfigError, match="no such GGUF file"):
        load_runner_at(tmp_path / "absent.gguf")
