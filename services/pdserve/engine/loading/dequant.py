"""GGML tensor bytes → a torch tensor of the serving dtype.

Q4_0, Q4_1 and Q8_0 (what small llama.cpp checkpoints use) are dequantized here with torch,
a bounded chunk of blocks at a time straight into the output tensor, so no float32 copy of a
whole tensor is ever held. Each value is computed in float32 with the same operations, in
the same order, as `gguf.quants` (then rounded once to the serving dtype), so the result is
bit-identical to `gguf.quants.dequantize(...)` followed by a cast. Other quantized types go
through `gguf.quants` itself.

A block of 32 values, as stored:
    Q4_0: | d f16 | 16 bytes: value i in the low nibble of byte i, value i+16 in the high one |  x = d·(q − 8)
    Q4_1: | d f16 | m f16 | 16 bytes, as Q4_0 |                                                    x = d·q + m
    Q8_0: | d f16 | 32 × int8 |                                                                    x = q·d
"""
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as GgmlType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from pdserve.common.errors import ConfigError

# Blocks per step: 32k values stay in cache and under torch's parallel grain size (32768), so
# each op runs on one thread without an OpenMP fork/join; on a busy machine that is ~5x faster.
CHUNK_BLOCKS = 1024


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start+2) of each block, as float32: (n, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes → (n, 32) values: all low nibbles, then all high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()  # (n, 32)
    return _scale(blocks, 0) * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).float()  # (n, 32)
    return _scale(blocks, 0) * q + _scale(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n, 32)
    return q * _scale(blocks, 0)


_BLOCK_KERNELS: dict[GgmlType, Callable[[torch.Tensor], torch.Tensor]] = {
    GgmlType.Q4_0: _q4_0, GgmlType.Q4_1: _q4_1, GgmlType.Q8_0: _q8_0,
}
_PLAIN_DTYPES = {GgmlType.F32: torch.float32, GgmlType.F16: torch.float16, GgmlType.BF16: torch.bfloat16}


def num_bytes(ggml_type: int, dims: tuple[int, ...]) -> int:
    """Bytes a tensor of `dims` (GGUF order) takes. ConfigError for an unknown type or a row
    that is not a whole number of blocks."""
    kind = ggml_type_of(ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    if dims and dims[0] % block_size:
        raise ConfigError("tensor", dims, f"row length is not a multiple of {kind.name}'s block of {block_size}")
    return int(np.prod(dims, dtype=np.int64)) * type_size // block_size


def ggml_type_of(ggml_type: int) -> GgmlType:
    try:
        return GgmlType(ggml_type)
    except ValueError:
        raise ConfigError("tensor type", ggml_type, "not a GGML tensor type") from None


def dequantize(raw: torch.Tensor, ggml_type: int, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`raw` (uint8, the tensor's bytes) as a new tensor of `dtype`, shaped `dims` reversed
    (numpy/HF row-major: (out_features, in_features) for a matrix). `raw` is only read.
    ConfigError for a type with no dequantization (integer tensors, Q8_K, ...)."""
    kind = ggml_type_of(ggml_type)
    shape = tuple(reversed(dims))
    if kind in _PLAIN_DTYPES:
        return raw.view(_PLAIN_DTYPES[kind]).reshape(shape).to(dtype, copy=True)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = raw.view(-1, type_size)  # (num_blocks, type_size)
    kernel = _BLOCK_KERNELS.get(kind)
    if kernel is None:  # rarer types: gguf's numpy code, one float32 copy of the tensor
        try:
            values = gguf_dequantize(blocks.numpy(), kind)  # (num_blocks, block_size)
        except NotImplementedError:
            raise ConfigError("tensor type", kind.name, "not a weight type pdserve can dequantize") from None
        return torch.from_numpy(values).reshape(shape).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    out_blocks = out.view(-1, block_size)  # (num_blocks, block_size)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        stop = start + CHUNK_BLOCKS
        out_blocks[start:stop].copy_(kernel(blocks[start:stop]))
    return out
