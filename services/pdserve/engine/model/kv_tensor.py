"""The worker's one KV tensor, block-major, and the row arithmetic to write and read it.

Layout: `(num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim)`, 2 = (K, V).
One block of every layer is one contiguous byte range, so a block moves between tiers or
workers as a single copy. Two flat views address it without Python loops:

    token rows (N*L*2*tpb, kvh, hd): row ((block*L + layer)*2 + kind)*tpb + offset
    block rows (N*L*2, tpb, kvh, hd): row  (block*L + layer)*2 + kind

With `kv_cache_dtype="fp8"` values are stored as float8_e4m3fn divided by one per-tensor
scale and multiplied back on read.
"""
import math
import mmap
from collections.abc import Sequence

import torch

from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.engine.loading.model_config import ModelConfig

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto` stores KV in the model dtype; `fp8` in float8_e4m3fn."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError("kv_cache_dtype", kv_cache_dtype, f"supported: {', '.join(KV_CACHE_DTYPES)}")
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def bytes_per_block(config: ModelConfig, tokens_per_block: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    _check_tokens_per_block(tokens_per_block)
    elements = config.num_layers * 2 * tokens_per_block * config.num_kv_heads * config.head_dim
    return elements * dtype.itemsize


def num_blocks_for_budget(config: ModelConfig, tokens_per_block: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    """How many whole blocks fit in `budget_bytes` (at least one, else ConfigError)."""
    num_blocks = budget_bytes // bytes_per_block(config, tokens_per_block, dtype)
    if num_blocks < 1:
        raise ConfigError("kv_cache_bytes", budget_bytes, "smaller than one KV block")
    return num_blocks


def allocate_kv_tensor(config: ModelConfig, num_blocks: int, tokens_per_block: int,
                       dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeroed (num_blocks, L, 2, tpb, kvh, hd) tensor. On a CPU, fresh anonymous pages: the
    kernel hands them out zeroed as they are first touched, so a start does not write the whole
    cache (512 MiB zeroed took ~1.2 s of a worker's start) and no byte of another allocation's
    past is ever read."""
    _check_tokens_per_block(tokens_per_block)
    if num_blocks < 1:
        raise ConfigError("num_blocks", num_blocks, "must be a positive integer")
    shape = (num_blocks, config.num_layers, 2, tokens_per_block, config.num_kv_heads, config.head_dim)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    # the tensor holds `pages` alive; a memoryview of it would otherwise outlive the map
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def _check_tokens_per_block(tokens_per_block: int) -> None:
    if tokens_per_block < 1 or tokens_per_block & (tokens_per_block - 1):
        raise ConfigError("tokens_per_block", tokens_per_block, "must be a power of two")


class Scratch:
    """Buffers reused across layers and steps, so a per-layer gather does not fault in fresh
    pages every time (on CPU that costs more than the copy itself).

    Contract: the tensor returned by `take(name, ...)` is overwritten by the next `take` of
    the same name; callers finish with it before then.
    """

    __slots__ = ("device", "_buffers")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            # Headroom: decode contexts grow a block at a time.
            buffer = torch.empty(numel + numel // 4, dtype=dtype, device=self.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


class PagedKvCache:
    """Owns the KV tensor; writes new tokens' K/V and gathers whole blocks back.

    Contract: `write` and `gather_blocks` take row indices for layer 0 (see module doc) and
    add the layer's offset themselves, so one index tensor built per step serves all layers.
    """

    __slots__ = ("tensor", "compute_dtype", "scale", "scratch", "_token_rows", "_block_rows", "_block_bytes")

    def __init__(self, tensor: torch.Tensor, compute_dtype: torch.dtype, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ConfigError("kv_scale", scale, "must be positive")
        self.tensor = tensor  # (N, L, 2, tpb, kvh, hd)
        self.compute_dtype = compute_dtype
        self.scale = scale
        self.scratch = Scratch(tensor.device)
        num_blocks, num_layers, _, tpb, kvh, hd = tensor.shape
        # index_copy_ has no float8 kernel; bytes move the same values.
        storage = tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor
        self._token_rows = storage.view(num_blocks * num_layers * 2 * tpb, kvh, hd)
        self._block_rows = storage.view(num_blocks * num_layers * 2, tpb, kvh, hd)
        self._block_bytes = tensor.view(torch.uint8).view(num_blocks, -1)

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def num_layers(self) -> int:
        return self.tensor.shape[1]

    @property
    def tokens_per_block(self) -> int:
        return self.tensor.shape[3]

    @property
    def is_quantized(self) -> bool:
        return self.tensor.dtype == FP8_DTYPE

    @property
    def value_scale(self) -> float:
        """What a gathered stored value is multiplied by to give the true value."""
        return self.scale if self.is_quantized else 1.0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_rows: torch.Tensor) -> None:
        """Store k, v (T, kvh, hd) at layer-0 token rows (T,) shifted to `layer`."""
        tpb = self.tokens_per_block
        self._token_rows.index_copy_(0, token_rows + (2 * layer) * tpb, self._encode(k))
        self._token_rows.index_copy_(0, token_rows + (2 * layer + 1) * tpb, self._encode(v))

    def gather_blocks(self, layer: int, block_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """layer-0 block rows (M,) -> K, V each (M, tpb, kvh, hd) in the storage dtype (float8 when
        quantized), in scratch buffers valid until the next gather."""
        shape = (block_rows.shape[0],) + tuple(self._block_rows.shape[1:])
        dtype = self._block_rows.dtype
        k = torch.index_select(self._block_rows, 0, block_rows + 2 * layer, out=self.scratch.take("k", shape, dtype))
        v = torch.index_select(self._block_rows, 0, block_rows + (2 * layer + 1),
                               out=self.scratch.take("v", shape, dtype))
        return self._stored_view(k), self._stored_view(v)

    def _stored_view(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(FP8_DTYPE) if self.is_quantized else x

    def values_in_compute_dtype(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Gathered values in the compute dtype, NOT yet multiplied by `value_scale` (callers
        fold it into their arithmetic). Quantized values convert into scratch buffer `name`."""
        if not self.is_quantized:
            return x
        return self.scratch.take(name, tuple(x.shape), self.compute_dtype).copy_(x)

    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy whole blocks (all layers, K and V) src_ids[i] -> dst_ids[i]."""
        if len(src_ids) != len(dst_ids):
            raise InvalidRequestError(f"{len(src_ids)} sources for {len(dst_ids)} destinations", "dst_ids")
        if len(set(dst_ids)) != len(dst_ids):
            raise InvalidRequestError(f"duplicate destination blocks {dst_ids}", "dst_ids")
        for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
            bad = [b for b in ids if not 0 <= b < self.num_blocks]
            if bad:
                raise InvalidRequestError(f"block ids {bad} outside [0, {self.num_blocks})", name)
        device = self.tensor.device
        src = torch.tensor(src_ids, dtype=torch.int64, device=device)
        dst = torch.tensor(dst_ids, dtype=torch.int64, device=device)
        self._block_bytes.index_copy_(0, dst, self._block_bytes.index_select(0, src))

    def zero_layers(self, slices: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Zero the K and V of layers `layers` of block `block_id`, for each (block_id, layers): the
        slices a peer did not send. Their bytes were another block's, or anything a failed write
        left; a masked key still meets its value in the torch path's products (0 * NaN is NaN)."""
        num_blocks, num_layers = self.num_blocks, self.num_layers
        by_layers: dict[tuple[int, ...], list[int]] = {}
        for block_id, layers in slices:
            if not 0 <= block_id < num_blocks or not all(0 <= layer < num_layers for layer in layers):
                raise InvalidRequestError(f"block {block_id} layers {list(layers)} outside the KV tensor", "slices")
            by_layers.setdefault(tuple(layers), []).append(block_id)
        per_layer = self._block_bytes.view(num_blocks, num_layers, -1)  # (N, L, bytes of a layer's K and V)
        device = self.tensor.device
        for layers, block_ids in by_layers.items():
            rows = torch.tensor(block_ids, dtype=torch.int64, device=device).unsqueeze(1)  # (B, 1)
            columns = torch.tensor(layers, dtype=torch.int64, device=device).unsqueeze(0)  # (1, l)
            per_layer[rows, columns] = 0

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_quantized:
            return x
        # float8_e4m3fn has no infinity: out-of-range values would become NaN, so saturate.
        scaled = (x.float() / self.scale).clamp_(-FP8_MAX, FP8_MAX)
        return scaled.to(FP8_DTYPE).view(torch.uint8)
