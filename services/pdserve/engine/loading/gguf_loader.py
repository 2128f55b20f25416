"""Read a GGUF file as a Hugging Face config dict and HF-named tensors.

GGUF stores llama.cpp's names (`blk.3.attn_q.weight`), its metadata keys
(`qwen3.embedding_length`) and quantized blocks (Q4_1, Q8_0, ...). `load_gguf` turns all
three into what the `config.json` + safetensors checkpoint of the same model would give, so
the model code has one loading path. Architectures: llama (Llama, and Mixtral where the file
has experts), qwen3, qwen3moe, gemma3, phi3 (`gguf_families` names their tensors,
`gguf_config` reads their metadata). The file is parsed by `models.gguf_file` and dequantized
by `dequant`, one tensor at a time straight into the serving dtype. With a `cache_dir`, the
result is kept there (`gguf_cache`) and later loads read it instead.
"""
import math
from typing import Any

import numpy as np
import torch

from pdserve.common.errors import ConfigError
from pdserve.models.conversion_cache import one_at_a_time
from pdserve.models.gguf_file import GgufFile, GgufTensorInfo, read_gguf
from pdserve.engine.loading import gguf_cache
from pdserve.engine.loading.dequant import dequantize, num_bytes
from pdserve.engine.loading.gguf_config import hf_config
from pdserve.engine.loading.gguf_families import GgufFamily, family_of, hf_target


def load_gguf(path: str, dtype: torch.dtype = torch.float32,
              cache_dir: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF `config.json`-style dict, {HF tensor name: tensor of `dtype`}) for a GGUF file.

    Tensors come back as the HF checkpoint holds them: Q and K rows in HF order (llama.cpp's
    interleaved rope layout undone), Gemma's norms without llama.cpp's + 1, each expert of a
    stack its own tensor. `lm_head.weight` is present only when the file has an untied output
    matrix; `config["tie_word_embeddings"]` says which. Raises ConfigError for other
    architectures, for tensors this mapping does not know and for options not served. With
    `cache_dir`, a valid cached conversion is returned as is; otherwise the conversion is done
    and stored there.
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
    family = family_of(gguf.metadata)
    config = hf_config(gguf, family)
    tensors = {}
    for info in gguf.tensors:
        if info.name in family.config_tensors:
            continue
        target = hf_target(family, info.name)
        if target.is_expert_stack:
            for expert, tensor in enumerate(_read_experts(gguf, info, dtype)):
                tensors[target.name.format(expert=expert)] = tensor
            continue
        shift = family.norm_shift if target.name.endswith("norm.weight") else 0.0
        tensors[target.name] = _read_tensor(gguf, info, dtype, _rope_heads(family, config, target.name), shift)
    return config, tensors


def load_gguf_config(path: str) -> dict[str, Any]:
    """Only the HF-style config of a GGUF file (no weight is read)."""
    gguf = read_gguf(path)
    return hf_config(gguf, family_of(gguf.metadata))


def _rope_heads(family: GgufFamily, config: dict[str, Any], hf_name: str) -> int | None:
    """The head count to un-permute `hf_name`'s rows by, where llama.cpp permuted them."""
    if family.is_rope_permuted and ".q_proj." in hf_name:
        return config["num_attention_heads"]
    if family.is_rope_permuted and ".k_proj." in hf_name:
        return config["num_key_value_heads"]
    return None


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


def _read_tensor(gguf: GgufFile, info: GgufTensorInfo, dtype: torch.dtype, rope_heads: int | None,
                 norm_shift: float) -> torch.Tensor:
    """One tensor as `dtype`, numpy/HF row-major order (out_features, in_features). With
    `rope_heads`, its rows are un-permuted first, as stored bytes (a row is whole blocks):
    numpy moves those single-threaded in microseconds, where a torch copy of the
    dequantized rows waits on a busy machine's OpenMP threads. A `norm_shift` is taken off
    in float32, before the cast: in bfloat16, 1 + w keeps too few of w's bits."""
    raw = np.frombuffer(gguf.data(info, num_bytes(info.ggml_type, info.dims)), dtype=np.uint8)
    if rope_heads is not None:
        num_rows = math.prod(info.dims[1:]) if len(info.dims) > 1 else info.dims[0]
        if raw.size % num_rows:
            raise ConfigError("tensor", info.name, "a quantized 1-D Q/K tensor cannot be un-permuted")
        raw = unpermute_rope_rows(raw.reshape(num_rows, -1), rope_heads).reshape(-1)
    if norm_shift:
        return (dequantize(torch.from_numpy(raw), info.ggml_type, info.dims, torch.float32) - norm_shift).to(dtype)
    return dequantize(torch.from_numpy(raw), info.ggml_type, info.dims, dtype)


def _read_experts(gguf: GgufFile, info: GgufTensorInfo, dtype: torch.dtype) -> list[torch.Tensor]:
    """A stack of experts, (num_experts, rows, cols), as one tensor per expert, each of its own
    memory: an expert's bytes are one contiguous run, dequantized alone."""
    *dims, num_experts = info.dims  # GGUF order: the expert index varies slowest
    size = num_bytes(info.ggml_type, tuple(dims))
    raw = np.frombuffer(gguf.data(info, size * num_experts), dtype=np.uint8)
    return [dequantize(torch.from_numpy(raw[e * size:(e + 1) * size]), info.ggml_type, tuple(dims), dtype)
            for e in range(num_experts)]
