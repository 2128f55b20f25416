"""Read a Llama-architecture GGUF file as a Hugging Face config dict and HF-named tensors.

GGUF stores llama.cpp's names (`blk.3.attn_q.weight`), its metadata keys
(`llama.embedding_length`) and quantized blocks (Q4_1, Q8_0, ...). `load_gguf` turns all
three into what a `config.json` + safetensors checkpoint would give, so the model code
has one loading path. Dequantization is done by the `gguf` package; the result is cast
to the serving dtype one tensor at a time.
"""
import re
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from pdserve.common.errors import ConfigError

SUPPORTED_ARCHITECTURE = "llama"

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF `config.json`-style dict, {HF tensor name: tensor of `dtype`}) for a Llama GGUF file.

    Q and K projection rows come back in HF order (llama.cpp's interleaved rope layout
    undone). `lm_head.weight` is present only when the file has an untied output matrix;
    `config["tie_word_embeddings"]` says which. Raises ConfigError for other architectures
    and for tensors this mapping does not know.
    """
    reader = GGUFReader(path)
    config = _llama_config(reader)
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weight = _dequantize(tensor)
        if ".q_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif ".k_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[name] = weight.to(dtype)
    return config, tensors


def load_gguf_config(path: str) -> dict[str, Any]:
    """Only the HF-style config of a GGUF file (no tensor is read)."""
    return _llama_config(GGUFReader(path))


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; ConfigError if unknown."""
    if match := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif match := _GLOBAL_NAME.fullmatch(gguf_name):
        part, kind = match.groups()
        if part in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[part]}.{kind}"
    raise ConfigError("tensor", gguf_name, "not a Llama tensor this loader maps to a Hugging Face name")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (weights and biases), giving the HF (rotate-half)
    layout back.

    llama.cpp's converter reorders each head's rows from [first half | second half] to
    interleaved pairs (row i of the first half next to row i of the second). Per head:
        gguf rows: (half, 2)  →  hf rows: (2, half)
    """
    rows = weight.shape[0]  # weight (num_heads * head_dim, hidden) or bias (num_heads * head_dim,)
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, -1)  # (nh, half, 2, hidden or 1)
    return per_head.transpose(1, 2).reshape(weight.shape)  # (nh * 2 * half, ...)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor as float32, numpy/HF row-major order (out_features, in_features)."""
    array = dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:  # a view into the memory-mapped file
        array = np.array(array)
    return torch.from_numpy(array)


def _llama_config(reader: GGUFReader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise ConfigError("general.architecture", arch, f"only {SUPPORTED_ARCHITECTURE!r} GGUF files are supported")
    hidden = _field(reader, "llama.embedding_length")
    num_heads = _field(reader, "llama.attention.head_count")
    head_dim = _field(reader, "llama.attention.key_length", hidden // num_heads)
    _check_rope(reader, head_dim)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "vocab_size": _vocab_size(reader),
        "tie_word_embeddings": not has_output,
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
    }


def _check_rope(reader: GGUFReader, head_dim: int) -> None:
    rope_dim = _field(reader, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ConfigError("llama.rope.dimension_count", rope_dim,
                          f"partial rotary (head_dim={head_dim}) is not supported")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError("llama.rope.scaling.type", scaling, "rope scaling from GGUF is not supported")


def _vocab_size(reader: GGUFReader) -> int:
    if "llama.vocab_size" in reader.fields:
        return _field(reader, "llama.vocab_size")
    return len(reader.fields["tokenizer.ggml.tokens"].data)


_REQUIRED = object()


def _field(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ConfigError(key, None, "missing from the GGUF metadata")
        return default
    return field.contents()
