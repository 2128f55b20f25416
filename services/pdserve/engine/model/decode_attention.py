"""Attention for decode: one new token per sequence, sequences batched in cache-sized groups.

Each group's K/V is gathered block by block into scratch, `(g * blocks, tpb, kvh, hd)` in
the stored dtype, so a sequence's keys are `(S, kvh * hd)` rows. Groups are sized so that
gathered K+V stay in the CPU's cache while attention reads them back (measured: 8 sequences
of 256 tokens ran in 60% of the time of one 64-sequence batch). Two ways to split heads:

- wide queries (few KV heads): each query head becomes a row of width kvh * hd holding its
  vector in its KV head's column block and zeros elsewhere. One matmul against the key rows
  scores every head with no transpose of K or V; the zeros cost a factor kvh in arithmetic,
  cheap next to two extra passes over K/V when kvh is small.
- head-major (many KV heads): copy K and V to (g, kvh, S, hd) and run per-head matmuls.

Matmul + softmax rather than SDPA: on CPU, SDPA with one query row per head was several
times slower. A per-tensor fp8 scale is folded into the softmax scale and the output.
"""
from dataclasses import dataclass

import torch

from pdserve.engine.model.kv_tensor import PagedKvCache

WIDE_QUERY_MAX_KV_HEADS = 16  # above this the zeros cost more than the transposes save
GROUP_BYTES = 8 << 20  # gathered K+V per group


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    seqs: slice  # rows of the decode batch
    block_rows: torch.Tensor  # (g * blocks,) layer-0 block rows; padding points at block 0
    bias: torch.Tensor  # (g, 1, blocks * tpb) float32: 0 attend, -inf masked


@dataclass(frozen=True, slots=True)
class DecodeAttention:
    token_index: torch.Tensor | None  # (B,) rows in the flattened batch; None: all rows, in order
    num_seqs: int
    groups: tuple[DecodeGroup, ...]


def plan_decode(context_lens: torch.Tensor, block_rows: torch.Tensor, token_index: torch.Tensor | None,
                kv: PagedKvCache, window: int | None) -> DecodeAttention:
    """context_lens (B,) include the new token; block_rows (B, width) layer-0 rows of each table."""
    tpb, device = kv.tokens_per_block, kv.tensor.device
    _, _, _, _, num_kv_heads, head_dim = kv.tensor.shape
    bytes_per_seq = int(context_lens.max()) * 2 * num_kv_heads * head_dim * kv.compute_dtype.itemsize
    size = max(1, GROUP_BYTES // bytes_per_seq)
    groups = []
    for first in range(0, len(context_lens), size):
        lens = context_lens[first:first + size]
        num_blocks = -(-int(lens.max()) // tpb)
        key_pos = torch.arange(num_blocks * tpb).unsqueeze(0)  # (1, S)
        mask = key_pos < lens.unsqueeze(1)  # (g, S)
        if window is not None:
            mask &= key_pos >= (lens - window).unsqueeze(1)
        bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).unsqueeze(1)
        rows = block_rows[first:first + size, :num_blocks].reshape(-1)
        groups.append(DecodeGroup(slice(first, first + len(lens)), rows.to(device), bias.to(device)))
    return DecodeAttention(token_index, len(context_lens), tuple(groups))


def decode_attention(layer: int, q: torch.Tensor, plan: DecodeAttention, kv: PagedKvCache,
                     scale: float | None = None) -> torch.Tensor:
    """q (B, nh, hd), one token per sequence -> (B, nh * hd); scores scaled by `scale` (None: hd ** -0.5)."""
    num_seqs, num_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    num_kv_heads = kv.tensor.shape[4]
    is_wide = num_kv_heads <= WIDE_QUERY_MAX_KV_HEADS
    queries = _wide_queries(q, num_kv_heads) if is_wide else q  # (B, nh, kvh hd) or (B, nh, hd)
    attend = _wide_query if is_wide else _head_major
    out = q.new_empty(num_seqs, num_heads * head_dim) if len(plan.groups) > 1 else None
    for group in plan.groups:
        k_blocks, v_blocks = kv.gather_blocks(layer, group.block_rows)  # (g * blocks, tpb, kvh, hd)
        result = attend(queries[group.seqs], k_blocks, v_blocks, group.bias, head_dim, kv, scale)
        if out is None:
            return result
        out[group.seqs] = result
    return out


def _wide_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, nh, hd) -> (B, nh, kvh * hd): head i's vector in its KV head's column block, zeros elsewhere."""
    num_seqs, num_heads, _ = q.shape
    # selector[i, j] = 1 where query head i reads KV head j (heads j*G .. j*G+G-1 share head j)
    selector = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device).repeat_interleave(
        num_heads // num_kv_heads, dim=0)
    return (q.unsqueeze(2) * selector.view(1, num_heads, num_kv_heads, 1)).view(num_seqs, num_heads, -1)


def _wide_query(wide_q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, bias: torch.Tensor,
                head_dim: int, kv: PagedKvCache, scale: float) -> torch.Tensor:
    num_seqs, num_heads, width = wide_q.shape
    num_kv_heads = width // head_dim
    k = kv.values_in_compute_dtype(k_blocks, "k_values").view(num_seqs, -1, width)  # (g, S, kvh hd)
    v = kv.values_in_compute_dtype(v_blocks, "v_values").view(num_seqs, -1, width)
    probs = _softmax(torch.bmm(wide_q, k.transpose(1, 2)), scale, bias, kv)  # (g, nh, S)
    wide_out = torch.bmm(probs, v)  # (g, nh, kvh hd): only each head's own KV block is meaningful
    group = num_heads // num_kv_heads
    own = wide_out.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim).diagonal(dim1=1, dim2=3)
    out = own.permute(0, 3, 1, 2).reshape(num_seqs, num_heads * head_dim)  # (g, kvh, G, hd) -> (g, nh hd)
    return out.mul_(kv.value_scale) if kv.is_quantized else out


def _head_major(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, bias: torch.Tensor,
                head_dim: int, kv: PagedKvCache, scale: float) -> torch.Tensor:
    num_seqs, num_heads, _ = q.shape
    num_kv_heads = k_blocks.shape[2]
    shape = (num_seqs, num_kv_heads, bias.shape[-1], head_dim)  # (g, kvh, S, hd)
    k = kv.scratch.take("k_heads", shape, kv.compute_dtype)
    v = kv.scratch.take("v_heads", shape, kv.compute_dtype)
    k.copy_(k_blocks.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2))
    v.copy_(v_blocks.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2))
    # Query heads sharing a KV head become that head's query rows: no K/V repeat needed.
    grouped_q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (g, kvh, G, hd)
    probs = _softmax(torch.matmul(grouped_q, k.transpose(2, 3)), scale, bias.unsqueeze(1), kv)
    out = torch.matmul(probs, v).reshape(num_seqs, num_heads * head_dim)  # (g, kvh, G, hd) -> (g, nh hd)
    return out.mul_(kv.value_scale) if kv.is_quantized else out


def _softmax(scores: torch.Tensor, scale: float, bias: torch.Tensor, kv: PagedKvCache) -> torch.Tensor:
    """Raw q.k scores -> attention weights in the compute dtype (softmax taken in float32)."""
    scores = scores.float().mul_(scale * kv.value_scale).add_(bias)
    return torch.softmax(scores, dim=-1).to(kv.compute_dtype)
