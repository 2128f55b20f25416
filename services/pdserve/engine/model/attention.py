"""Paged attention: write each new token's K/V into its block slot, attend over the context.

`plan_attention` turns a `ForwardBatch` into index tensors once per step; every layer reuses
them. Chunks of one token (decode) are attended together, in padded groups of sequences
(`decode_attention`); longer chunks (prefill, chunked prefill, prefill over a cached prefix)
are attended one by one with SDPA. A sliding window only masks: blocks older than the
window are still gathered.

    # | start_pos tokens already in KV | chunk tokens |   context_len = start_pos + len(chunk)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.model.batch import ForwardBatch
from pdserve.engine.model.decode_attention import DecodeAttention, decode_attention, plan_decode
from pdserve.engine.model.kv_tensor import PagedKvCache


@dataclass(frozen=True, slots=True)
class ChunkAttention:
    """One multi-token chunk, attended on its own."""

    tokens: slice  # its rows in the flattened batch
    block_rows: torch.Tensor | None  # (num_blocks,) layer-0 block rows; None: no prefix, use own K/V
    context_len: int
    mask: torch.Tensor | None  # (T, context_len) bool, True = attend; None = plain causal


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    token_rows: torch.Tensor  # (T,) layer-0 token rows receiving each new token's K/V
    positions: torch.Tensor  # (T,) absolute position of each new token
    chunks: tuple[ChunkAttention, ...]
    decode: DecodeAttention | None


def plan_attention(batch: ForwardBatch, kv: PagedKvCache, sliding_window: int | None) -> AttentionPlan:
    """Index tensors for one step. The batch must already be validated against `kv`."""
    device = kv.tensor.device
    tpb, rows_per_block = kv.tokens_per_block, kv.num_layers * 2
    chunks = batch.chunks
    lengths = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)
    starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
    width = max(len(c.block_table) for c in chunks)
    tables = torch.tensor([c.block_table + (0,) * (width - len(c.block_table)) for c in chunks],
                          dtype=torch.int64)  # (C, width), padded with block 0
    chunk_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lengths)  # (T,)
    first_token = torch.cumsum(lengths, 0) - lengths  # (C,)
    positions = starts[chunk_of_token] + torch.arange(len(chunk_of_token)) - first_token[chunk_of_token]
    blocks = tables[chunk_of_token, positions // tpb]  # (T,)
    token_rows = blocks * (rows_per_block * tpb) + positions % tpb
    block_rows = tables * rows_per_block  # (C, width)
    multi, single = [], []
    for i, chunk in enumerate(chunks):
        (multi if len(chunk.token_ids) > 1 else single).append(i)
    row_starts = first_token.tolist()
    plans = tuple(_chunk_plan(chunks[i].start_pos, len(chunks[i].token_ids), row_starts[i],
                              block_rows[i], tpb, sliding_window, device) for i in multi)
    decode = None
    if single:
        index = torch.tensor(single, dtype=torch.int64)
        token_index = None if len(single) == len(chunk_of_token) else first_token[index].to(device)
        decode = plan_decode(starts[index] + 1, block_rows[index], token_index, kv, sliding_window)
    return AttentionPlan(token_rows.to(device), positions.to(device), plans, decode)


def _chunk_plan(start: int, length: int, first_row: int, block_rows: torch.Tensor, tpb: int,
                window: int | None, device: torch.device) -> ChunkAttention:
    context_len = start + length
    tokens = slice(first_row, first_row + length)
    if start == 0 and window is None:
        return ChunkAttention(tokens, None, context_len, None)
    query_pos = torch.arange(start, context_len).unsqueeze(1)  # (T, 1)
    key_pos = torch.arange(context_len).unsqueeze(0)  # (1, S)
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    num_blocks = -(-context_len // tpb)
    rows = None if start == 0 else block_rows[:num_blocks].to(device)
    return ChunkAttention(tokens, rows, context_len, mask.to(device))


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    plan: AttentionPlan, kv: PagedKvCache, scale: float | None = None) -> torch.Tensor:
    """q (T, nh, hd), k and v (T, kvh, hd) -> (T, nh * hd); writes k, v into the cache first.
    Scores are scaled by `scale` (None: hd ** -0.5)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kv.write(layer, k, v, plan.token_rows)
    num_tokens, num_heads, head_dim = q.shape
    if plan.decode is not None and plan.decode.token_index is None:
        return decode_attention(layer, q, plan.decode, kv, scale)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for chunk in plan.chunks:
        out[chunk.tokens] = _attend_chunk(layer, q[chunk.tokens], k[chunk.tokens], v[chunk.tokens],
                                          chunk, kv, scale)
    if plan.decode is not None:
        decode_q = q.index_select(0, plan.decode.token_index)
        out.index_copy_(0, plan.decode.token_index, decode_attention(layer, decode_q, plan.decode, kv, scale))
    return out


def _attend_chunk(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  chunk: ChunkAttention, kv: PagedKvCache, scale: float) -> torch.Tensor:
    """q (T, nh, hd) over the chunk's context -> (T, nh * hd)."""
    value_scale = 1.0  # the chunk's own K/V are true values; stored ones are scaled by the cache's
    if chunk.block_rows is not None:
        k_blocks, v_blocks = kv.gather_blocks(layer, chunk.block_rows)  # (blocks, tpb, kvh, hd) each
        k = kv.values_in_compute_dtype(k_blocks, "k_values").flatten(0, 1)[:chunk.context_len]  # (S, kvh, hd)
        v = kv.values_in_compute_dtype(v_blocks, "v_values").flatten(0, 1)[:chunk.context_len]
        value_scale = kv.value_scale
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, nh, T, hd)
        k.transpose(0, 1).unsqueeze(0),  # (1, kvh, S, hd)
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask, is_causal=chunk.mask is None, enable_gqa=True,
        scale=scale * value_scale,
    )  # (1, nh, T, hd)
    out = out[0].transpose(0, 1).reshape(q.shape[0], -1)
    return out if value_scale == 1.0 else out.mul_(value_scale)
