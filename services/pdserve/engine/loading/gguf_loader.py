"""Read a Llama-architecture GGUF file as a Hugging Face config dict and HF-named tensors.

GGUF stores llama.cpp's names (`blk.3.attn_q.weight`), its metadata keys
(`llama.embedding_length`) and quantized blocks (Q4_1, Q8_0, ...). `load_gguf` turns all
three into what a `config.json` + safetensors checkpoint would give, so the model code
has one loading path. The file is parsed by `common.gguf_file` and dequantized by
`dequant`, one tensor at a time straight into the serving dtype. With a `cache_dir`, the
result is kept there (`gguf_cache`) and later loads read it instead.
"""
import math
import re
from typing import Any

import numpy as np
import torch

from pdserve.common.errors import ConfigError
from pdserve.models.conversion_cache import one_at_a_time
from pdserve.models.gguf_file import GgufFile, GgufTensorInfo, read_gguf
from pdserve.engine.loading import gguf_cache
from pdserve.engine.loading.dequant import dequantize, num_bytes

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


def load_gguf(path: str, dtype: torch.dtype = torch.float32,
              cache_dir: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF `config.json`-style dict, {HF tensor name: tensor of `dtype`}) for a Llama GGUF file.

    Q and K projection rows come back in HF order (llama.cpp's interleaved rope layout
    undone). `lm_head.weight` is present only when the file has an untied output matrix;
    `config["tie_word_embeddings"]` says which. Raises ConfigError for other architectures
    and for tensors this mapping does not know. With `cache_dir`, a valid cached conversion
    is returned as is; otherwise the conversion is done and stored there.
    """
    if cache_dir is None:
        return convert_gguf(path, dtype)
    cached = gguf_cache.read_entry(path, dtype, cache_dir)
    if cached is not None:
        return cached
    with one_at_a_time(gguf_cache.entry_path(path, dtype, cache_dir)):
        cached = gguf_cache.read_entry(path, dtype, cache_dir)  # a peer's, made while this one waited
        if cached is not None:
            return cached
        config, tensors = convert_gguf(path, dtype)
        gguf_cache.write_entry(path, dtype, cache_dir, config, tensors)
    return config, tensors


def convert_gguf(path: str, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """`load_gguf` without a cache: parse, dequantize and rename every tensor of the file."""
    gguf = read_gguf(path)
    config = _llama_config(gguf)
    tensors = {}
    rope_heads = {".q_proj.": config["num_attention_heads"], ".k_proj.": config["num_key_value_heads"]}
    for info in gguf.tensors:
        name = hf_tensor_name(info.name)
        heads = next((n for part, n in rope_heads.items() if part in name), None)
        tensors[name] = _read_tensor(gguf, info, dtype, heads)
    return config, tensors


def load_gguf_config(path: str) -> dict[str, Any]:
    """Only the HF-style config of a GGUF file (no tensor is read)."""
    return _llama_config(read_gguf(path))


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


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (of weights or biases), giving the HF (rotate-half)
    row order back. `rows` is (num_rows, ...): values, or a row's stored bytes.

    llama.cpp's converter reorders each head's rows from [first half | second half] to
    interleaved pairs (row i of the first half next to row i of the second). Per head:
        gguf rows: (half, 2)  →  hf rows: (2, half)
    """
    half = rows.shape[0] // num_heads // 2  # rows: (num_heads * head_dim, ...)
    per_head = rows.reshape(num_heads, half, 2, -1)  # (nh, half, 2, rest)
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(rows.shape)  # (nh * 2 * half, ...)


def _read_tensor(gguf: GgufFile, info: GgufTensorInfo, dtype: torch.dtype, rope_heads: int | None) -> torch.Tensor:
    """One tensor as `dtype`, numpy/HF row-major order (out_features, in_features). With
    `rope_heads`, its rows are un-permuted first, as stored bytes (a row is whole blocks):
    numpy moves those single-threaded in microseconds, where a torch copy of the
    dequantized rows waits on a busy machine's OpenMP threads."""
    raw = np.frombuffer(gguf.data(info, num_bytes(info.ggml_type, info.dims)), dtype=np.uint8)
    if rope_heads is not None:
        num_rows = math.prod(info.dims[1:]) if len(info.dims) > 1 else info.dims[0]
        if raw.size % num_rows:
            raise ConfigError("tensor", info.name, "a quantized 1-D Q/K tensor cannot be un-permuted")
        raw = unpermute_rope_rows(raw.reshape(num_rows, -1), rope_heads).reshape(-1)
    return dequantize(torch.from_numpy(raw), info.ggml_type, info.dims, dtype)


def _llama_config(gguf: GgufFile) -> dict[str, Any]:
    meta = gguf.metadata
    arch = _field(meta, "general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise ConfigError("general.architecture", arch, f"only {SUPPORTED_ARCHITECTURE!r} GGUF files are supported")
    hidden = _field(meta, "llama.embedding_length")
    num_heads = _field(meta, "llama.attention.head_count")
    head_dim = _field(meta, "llama.attention.key_length", hidden // num_heads)
    _check_rope(meta, head_dim)
    names = {t.name for t in gguf.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _field(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _field(meta, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(meta, "llama.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _field(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(meta, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(meta, "llama.context_length"),
        "vocab_size": _field(meta, "llama.vocab_size", None) or len(_field(meta, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(name.endswith("attn_q.bias") for name in names),
        "bos_token_id": _field(meta, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(meta, "tokenizer.ggml.eos_token_id", None),
        # GGUF weights are mostly quantized and name no float dtype; `--dtype auto` serves them
        # in bfloat16 (half the memory of float32; native on CPUs with AVX-512 BF16 and on GPUs).
        "torch_dtype": "bfloat16",
    }


def _check_rope(meta: dict[str, Any], head_dim: int) -> None:
    rope_dim = _field(meta, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ConfigError("llama.rope.dimension_count", rope_dim,
                          f"partial rotary (head_dim={head_dim}) is not supported")
    scaling = _field(meta, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError("llama.rope.scaling.type", scaling, "rope scaling from GGUF is not supported")


_REQUIRED = object()


def _field(meta: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    if key in meta:
        return meta[key]
    if default is _REQUIRED:
        raise ConfigError(key, None, "missing from the GGUF metadata")
    return default
