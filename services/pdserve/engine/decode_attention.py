"""Attention for decode: one new token per sequence, all sequences in one padded batch.

Both paths read K/V gathered block by block, `(B * blocks, tpb, kvh, hd)` in the stored
dtype, so a sequence's keys are `(S, kvh * hd)` rows. They differ in how heads are split:

- wide queries (few KV heads): each query head becomes a row of width kvh * hd holding its
  vector in its KV head's column block and zeros elsewhere. One matmul against the key rows
  scores every head with no transpose of K or V; the zeros cost a factor kvh in arithmetic,
  cheap next to two extra passes over the cache when kvh is small.
- head-major (many KV heads): copy K and V to (B, kvh, S, hd) and run per-head matmuls.

Matmul + softmax rather than SDPA: on CPU, SDPA with one query row per head was several
times slower (benchmarks/model_forward.py). A per-tensor fp8 scale is folded into the
softmax scale and the output, so stored values are never rescaled.
"""
import torch

from pdserve.engine.kv_tensor import PagedKvCache

WIDE_QUERY_MAX_KV_HEADS = 16  # above this the zeros cost more than the transposes save


def decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, bias: torch.Tensor,
                     kv: PagedKvCache) -> torch.Tensor:
    """q (B, nh, hd); k/v blocks (B * blocks, tpb, kvh, hd) as stored; bias (B, 1, S) -> (B, nh * hd)."""
    if k_blocks.shape[2] <= WIDE_QUERY_MAX_KV_HEADS:
        return _wide_query(q, k_blocks, v_blocks, bias, kv)
    return _head_major(q, k_blocks, v_blocks, bias, kv)


def _wide_query(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, bias: torch.Tensor,
                kv: PagedKvCache) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_blocks.shape[2]
    group = num_heads // num_kv_heads
    k = kv.values_in_compute_dtype(k_blocks, "k_values").view(num_seqs, -1, num_kv_heads * head_dim)  # (B, S, kvh hd)
    v = kv.values_in_compute_dtype(v_blocks, "v_values").view(num_seqs, -1, num_kv_heads * head_dim)
    # selector[i, j] = 1 where query head i reads KV head j (heads j*G .. j*G+G-1 share head j)
    selector = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device).repeat_interleave(group, dim=0)
    wide_q = (q.unsqueeze(2) * selector.view(1, num_heads, num_kv_heads, 1)).view(num_seqs, num_heads, -1)
    probs = _softmax(torch.bmm(wide_q, k.transpose(1, 2)), head_dim, bias, kv)  # (B, nh, S)
    wide_out = torch.bmm(probs, v)  # (B, nh, kvh hd): only each head's own KV block is meaningful
    own = wide_out.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim).diagonal(dim1=1, dim2=3)
    out = own.permute(0, 3, 1, 2).reshape(num_seqs, num_heads * head_dim)  # (B, kvh, G, hd) -> (B, nh hd)
    return out.mul_(kv.value_scale) if kv.is_quantized else out


def _head_major(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, bias: torch.Tensor,
                kv: PagedKvCache) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_blocks.shape[2]
    shape = (num_seqs, num_kv_heads, bias.shape[-1], head_dim)  # (B, kvh, S, hd)
    k = kv.scratch.take("k_heads", shape, kv.compute_dtype)
    v = kv.scratch.take("v_heads", shape, kv.compute_dtype)
    k.copy_(k_blocks.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2))
    v.copy_(v_blocks.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2))
    # Query heads sharing a KV head become that head's query rows: no K/V repeat needed.
    grouped_q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, kvh, G, hd)
    probs = _softmax(torch.matmul(grouped_q, k.transpose(2, 3)), head_dim, bias.unsqueeze(1), kv)
    out = torch.matmul(probs, v).reshape(num_seqs, num_heads * head_dim)  # (B, kvh, G, hd) -> (B, nh hd)
    return out.mul_(kv.value_scale) if kv.is_quantized else out


def _softmax(scores: torch.Tensor, head_dim: int, bias: torch.Tensor, kv: PagedKvCache) -> torch.Tensor:
    """Raw q.k scores -> attention weights in the compute dtype (softmax taken in float32)."""
    scores = scores.float().mul_(head_dim ** -0.5 * kv.value_scale).add_(bias)
    return torch.softmax(scores, dim=-1).to(kv.compute_dtype)
