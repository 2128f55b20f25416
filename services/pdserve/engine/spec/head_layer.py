"""A drafting head's decoder layer (EAGLE, EAGLE-3, MTP) and its K/V under the target's block ids.

    head K/V (num_blocks, 2, tokens_per_block, kv_heads, head_dim): block b holds the head's K/V
             for the positions the target's block b holds, so the KV cache manager's block
             tables, claims and frees govern both

A head's K/V at a position is computed from the target's hidden state there, which the head has
only for positions the target computed while it watched (`head_drafts.py`). So each sequence's
attention reads keys from its own first such position on (`Span.first_key`): positions before it
hold the K/V of whatever used the block last and are masked, never read.

The layer is a Llama/Qwen2 decoder layer whose attention input and residual stream its head
makes (`HeadLayer.__call__`): EAGLE feeds the fused input unnormed, EAGLE-3 the normed
embedding beside the normed hidden state (so q/k/v read twice the hidden width), MTP the
normed projection. Heads run in the target's dtype, their matrices multiplied as the target's
own are (`ModelRunner.linear_op`), the rest on torch ops.
"""
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.kv_tensor import FP8_DTYPE
from pdserve.engine.model.layers import RMSNorm, RotaryEmbedding

Take = Callable[..., torch.Tensor]  # take(name, *shape) -> the checkpoint's tensor, its shape checked
Linear = Callable[..., torch.Tensor]  # linear(x, bias=None) -> x . W^T + bias, for one matrix W
LinearOp = Callable[[torch.Tensor], Linear]  # W -> its product (`ModelRunner.linear_op`)


@dataclass(frozen=True, slots=True)
class Span:
    """One sequence's rows in a head step: rows `first_row ..`, at positions `start_pos ..`."""

    first_row: int
    num_rows: int
    start_pos: int
    first_key: int  # its attention reads the head's K/V from this position on
    block_table: tuple[int, ...]


def kv_storage(kv_dtype: torch.dtype) -> torch.dtype:
    """The head's K/V dtype beside a target KV cache of `kv_dtype`: the same, but an fp8 cache's
    head keeps bfloat16 (one layer: its scale is not worth keeping)."""
    return torch.bfloat16 if kv_dtype == FP8_DTYPE else kv_dtype


def head_kv_bytes_per_block(config: ModelConfig, tokens_per_block: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one layer's K and V for one block."""
    return 2 * tokens_per_block * config.num_kv_heads * config.head_dim * kv_storage(kv_dtype).itemsize


class HeadKv:
    """The head's K/V of one layer, indexed by the target's block ids."""

    def __init__(self, num_blocks: int, tokens_per_block: int, config: ModelConfig, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.tokens_per_block = tokens_per_block
        self.tensor = torch.zeros(num_blocks, 2, tokens_per_block, config.num_kv_heads, config.head_dim,
                                  dtype=kv_storage(kv_dtype), device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[Span], scale: float) -> torch.Tensor:
        """q (T, nh, hd), k and v (T, kvh, hd) -> (T, nh * hd): writes k, v at the rows'
        positions, then each row attends over its sequence's keys from `first_key` through its own."""
        self._write(k, v, spans)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for span in spans:
            rows = slice(span.first_row, span.first_row + span.num_rows)
            end = span.start_pos + span.num_rows
            keys, values = self._gather(span.block_table, span.first_key, end, q.dtype)  # (S, kvh, hd) each
            query_pos = torch.arange(span.start_pos, end, device=q.device).unsqueeze(1)  # (t, 1)
            key_pos = torch.arange(span.first_key, end, device=q.device).unsqueeze(0)  # (1, S)
            mask = None if span.num_rows == 1 else key_pos <= query_pos  # (t, S)
            attn = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)  # (1, nh, t, hd)
            out[rows] = attn[0].transpose(0, 1).reshape(span.num_rows, -1)
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, spans: list[Span]) -> None:
        tpb = self.tokens_per_block
        blocks, offsets = [], []
        for span in spans:
            for pos in range(span.start_pos, span.start_pos + span.num_rows):
                blocks.append(span.block_table[pos // tpb])
                offsets.append(pos % tpb)
        blocks_t, offsets_t = torch.tensor(blocks, device=k.device), torch.tensor(offsets, device=k.device)
        self.tensor[blocks_t, 0, offsets_t] = k.to(self.tensor.dtype)
        self.tensor[blocks_t, 1, offsets_t] = v.to(self.tensor.dtype)

    def _gather(self, table: tuple[int, ...], first: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V at positions first..end-1, each (end - first, kvh, hd)."""
        tpb = self.tokens_per_block
        blocks = torch.tensor(table[first // tpb:-(-end // tpb)], device=self.tensor.device)
        kv = self.tensor[blocks].transpose(0, 1).flatten(1, 2)  # (2, blocks * tpb, kvh, hd)
        kv = kv[:, first % tpb:first % tpb + end - first].to(dtype)
        return kv[0], kv[1]


class HeadLayer:
    """A decoder layer over an input its head makes: attention over `x`, added to `residual`, then
    the MLP over the post-attention norm, added again."""

    __slots__ = ("qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down", "activation", "num_heads",
                 "num_kv_heads", "head_dim", "scale", "rope")

    def __init__(self, take: Take, prefix: str, config: ModelConfig, input_width: int, device: torch.device,
                 linear: LinearOp) -> None:
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.attention_scale
        self.rope = RotaryEmbedding(c.rope_of(0), c.head_dim, device)
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        attn = prefix + "self_attn."
        self.qkv = linear(torch.cat([take(attn + "q_proj.weight", q_width, input_width),
                                     take(attn + "k_proj.weight", kv_width, input_width),
                                     take(attn + "v_proj.weight", kv_width, input_width)]))  # (q + 2 kv, X)
        self.qkv_bias = torch.cat([take(attn + "q_proj.bias", q_width), take(attn + "k_proj.bias", kv_width),
                                   take(attn + "v_proj.bias", kv_width)]) if c.qkv_bias else None
        self.o_proj = linear(take(attn + "o_proj.weight", c.hidden_size, q_width))
        self.post_norm = RMSNorm(take(prefix + "post_attention_layernorm.weight", c.hidden_size), c.rms_norm_eps)
        mlp = prefix + "mlp."
        self.gate_up = linear(torch.cat([take(mlp + "gate_proj.weight", c.intermediate_size, c.hidden_size),
                                         take(mlp + "up_proj.weight", c.intermediate_size, c.hidden_size)]))
        self.down = linear(take(mlp + "down_proj.weight", c.hidden_size, c.intermediate_size))
        self.activation = c.activation

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, spans: list[Span],
                 kv: HeadKv) -> torch.Tensor:
        """x (T, X), residual (T, H) -> (T, H); writes the rows' K/V into `kv`."""
        num_tokens, nh, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x, self.qkv_bias)  # (T, (nh + 2 kvh) hd)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        qk = RotaryEmbedding.apply(qkv[:, :(nh + kvh) * hd].view(num_tokens, nh + kvh, hd), cos, sin)
        v = qkv[:, (nh + kvh) * hd:].view(num_tokens, kvh, hd)
        attn = kv.attend(qk[:, :nh], qk[:, nh:], v, spans, self.scale)  # (T, nh hd)
        h = residual + self.o_proj(attn)
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)  # (T, I) each
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return h + self.down(act * up)


def tensor_taker(tensors: dict[str, torch.Tensor], field: str, source: str) -> Take:
    """take(name, *shape): the tensor, ConfigError naming `field` where it is missing or misshapen."""
    def take(name: str, *shape: int) -> torch.Tensor:
        tensor = tensors.get(name)
        if tensor is None:
            raise ConfigError(field, source, f"tensor {name!r} missing from the checkpoint")
        if tuple(tensor.shape) != shape:
            raise ConfigError(field, source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor
    return take


def read_hf_config(path: Path, field: str) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(field, str(path), f"no readable config.json: {err}") from None


def read_tensors(path: Path, field: str, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder whose names pass `wanted`: safetensors (one file or
    shards by index) or, as EAGLE heads are often published, PyTorch's pickled state dict
    (read with weights_only: tensors only, never code)."""
    files = _weight_files(path, field)
    tensors = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as shard:
                tensors |= {name: shard.get_tensor(name) for name in shard.keys() if wanted(name)}
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            tensors |= {name: t for name, t in state.items() if wanted(name)}
    return tensors


def _weight_files(path: Path, field: str) -> list[Path]:
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            return [path / name for name in sorted(set(json.loads((path / index).read_text())["weight_map"].values()))]
    raise ConfigError(field, str(path), "no model.safetensors or pytorch_model.bin (nor a sharded index)")
