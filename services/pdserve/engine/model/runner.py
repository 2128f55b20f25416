"""`ModelRunner`: the model, its KV tensor, and one forward per scheduler step.

The runner runs tensors; it never decides what runs or which blocks a sequence owns. It
checks a batch against the KV tensor before touching it, so a bad batch changes nothing.
"""
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.engine.model.attention import plan_attention
from pdserve.engine.model.batch import ForwardBatch, ForwardOutput, HiddenCapture, SeqChunk
from pdserve.engine.model.kv_tensor import (PagedKvCache, allocate_kv_tensor, bytes_per_block,
                                      kv_storage_dtype, num_blocks_for_budget)
from pdserve.engine.model.decoder import CausalLM
from pdserve.engine.model.lora import NO_LORA, LoraAdapters, LoraSettings
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.native_forward import NativeForward, build_native
from pdserve.engine.loading.weights import load_checkpoint, load_model_config, resolve_device, resolve_dtype


class ModelRunner:
    def __init__(self, model: CausalLM, kv: PagedKvCache, dtype: torch.dtype, device: torch.device,
                 native: NativeForward | None = None, lora: LoraAdapters | None = None) -> None:
        self.model = model
        self.kv = kv
        self.dtype = dtype
        self.device = device
        self.native = native  # None: every step runs the torch ops of `model`
        self.lora = lora  # None: LoRA is off and a chunk naming an adapter is refused
        self.capture: HiddenCapture | None = None  # the hidden states every step returns (a drafter's)

    @classmethod
    def load(cls, model_path: str | Path, dtype: str = "float32", device: str | torch.device | None = None,
             num_blocks: int | None = None, tokens_per_block: int = 16, kv_cache_dtype: str = "auto",
             kv_cache_bytes: int | None = None, kv_scale: float = 1.0,
             cache_dir: str | None = None, kernels: str = "auto",
             lora: LoraSettings | None = None) -> "ModelRunner":
        """Load weights and allocate the KV tensor: give `num_blocks` or a `kv_cache_bytes` budget.

        `model_path` is a Hugging Face checkpoint directory or a `.gguf` file; `cache_dir`
        keeps a GGUF file's conversion (and the just-in-time kernels' build) for the next load.
        `kernels` (native.KERNEL_CHOICES): `auto` runs the native CPU kernels where they apply,
        `native` or a level's name insists on them (ConfigError where they cannot run), `torch`
        runs plain torch ops. With `lora` (adapters enabled), each adapter's deltas are added to
        its own rows on either path.
        """
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ConfigError("num_blocks", num_blocks, "give exactly one of num_blocks and kv_cache_bytes")
        # Every setting is checked, and the KV tensor allocated, before the weights are read.
        config, target = load_model_config(model_path), resolve_device(device)
        model_dtype = resolve_dtype(dtype, config, target)
        storage = kv_storage_dtype(kv_cache_dtype, model_dtype)
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(config, tokens_per_block, storage, kv_cache_bytes)
        kv = PagedKvCache(allocate_kv_tensor(config, num_blocks, tokens_per_block, storage, target),
                          model_dtype, kv_scale)
        checkpoint = load_checkpoint(model_path, dtype, target, cache_dir)
        model = CausalLM(checkpoint.config, checkpoint.tensors, target)
        del checkpoint  # the model holds what it uses; a matrix it lets go of (packed) is freed
        native = build_native(model, kv, kernels, cache_dir)
        adapters = None if lora is None else LoraAdapters(config, lora, model_dtype, target,
                                                          native.lora_weights if native else None)
        return cls(model, kv, model_dtype, target, native, adapters)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def kv_tensor(self) -> torch.Tensor:
        """(num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim)."""
        return self.kv.tensor

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def tokens_per_block(self) -> int:
        return self.kv.tokens_per_block

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.config, self.tokens_per_block, self.kv.tensor.dtype)

    def capture_hidden(self, capture: HiddenCapture) -> None:
        """Return these hidden states of every token from each step on (`ForwardOutput.hidden`);
        an empty capture stops it. ConfigError for a layer the model does not have."""
        bad = [i for i in capture.layers if not 0 <= i < self.config.num_layers]
        if bad:
            raise ConfigError("hidden_state_layers", bad, f"the model has layers 0..{self.config.num_layers - 1}")
        self.capture = None if capture.is_empty else capture

    @torch.inference_mode()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (T,) -> the rows of the input embedding (T, H), unscaled (as a head reads them)."""
        return self.model.embed.index_select(0, token_ids)

    def linear_op(self, weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """x (R, K) -> x . weight^T + bias (R, N), multiplied as this runner's steps multiply a
        matrix of its dtype (a head's matrices: on the AVX2 kernels torch's bf16 products are
        several times slower than the kernels' panels)."""
        if self.native is not None:
            return self.native.linear_op(weight)
        return lambda x, bias=None: torch.nn.functional.linear(x, weight, bias)

    @torch.inference_mode()
    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (R, H) in the model's dtype -> float32 logits (R, vocab) through the target's LM
        head, on the path its own steps take (a head drafting with the target's LM head)."""
        if self.native is not None:
            return self.native.lm_head_logits(hidden)
        return torch.nn.functional.linear(hidden, self.model.lm_head).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Compute every chunk's tokens, writing their K/V; float32 logits per chunk, and the
        hidden states of every token where `capture_hidden` asked for them.

        Raises InvalidRequestError (changing nothing) when a chunk is empty, out of the
        vocabulary or position range, or its block table is short or out of range.
        """
        self._validate(batch)
        counts = [_num_logit_rows(c) for c in batch.chunks]
        lora = NO_LORA if self.lora is None else self.lora.plan([(c.lora_id, len(c.token_ids)) for c in batch.chunks])
        if self.native is not None:
            logits, hidden = self.native.forward(batch, self.kv, _logit_rows(batch.chunks), lora,
                                                 self.capture)  # (R, vocab)
        else:
            plans = {window: plan_attention(batch, self.kv, window) for window in self.model.windows}
            token_ids = torch.tensor([t for c in batch.chunks for t in c.token_ids], dtype=torch.int64)
            logit_rows = torch.tensor(_logit_rows(batch.chunks), dtype=torch.int64, device=self.device)
            logits, hidden = self.model.forward(token_ids.to(self.device), plans, self.kv, logit_rows, lora,
                                                self.capture)  # (R, vocab)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return ForwardOutput(list(torch.split(logits, counts)), hidden)

    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy whole blocks src_ids[i] -> dst_ids[i] (copy-on-write of a shared last block)."""
        with torch.inference_mode():
            self.kv.copy_blocks(src_ids, dst_ids)

    def _validate(self, batch: ForwardBatch) -> None:
        if not batch.chunks:
            raise InvalidRequestError("a forward batch needs at least one chunk", "chunks")
        for chunk in batch.chunks:
            self._validate_chunk(chunk)

    def _validate_chunk(self, chunk: SeqChunk) -> None:
        rid, tokens, tpb = chunk.request_id, chunk.token_ids, self.tokens_per_block
        if not tokens:
            raise InvalidRequestError(f"chunk of {rid!r} has no tokens", "token_ids")
        if chunk.lora_id is not None and (self.lora is None or chunk.lora_id not in self.lora):
            raise InvalidRequestError(f"chunk of {rid!r} names LoRA adapter {chunk.lora_id}, which is not loaded",
                                      "lora_id")
        if min(tokens) < 0 or max(tokens) >= self.config.vocab_size:
            raise InvalidRequestError(f"chunk of {rid!r} has token ids outside 0..{self.config.vocab_size - 1}",
                                      "token_ids")
        context_len = chunk.start_pos + len(tokens)
        if chunk.start_pos < 0 or context_len > self.config.max_position_embeddings:
            raise InvalidRequestError(f"chunk of {rid!r} spans positions {chunk.start_pos}..{context_len}, "
                                      f"max {self.config.max_position_embeddings}", "start_pos")
        if len(chunk.block_table) * tpb < context_len:
            raise InvalidRequestError(f"block_table of {rid!r} has {len(chunk.block_table)} blocks, "
                                      f"{context_len} tokens need {-(-context_len // tpb)}", "block_table")
        if min(chunk.block_table) < 0 or max(chunk.block_table) >= self.num_blocks:
            raise InvalidRequestError(f"block_table of {rid!r} names blocks outside 0..{self.num_blocks - 1}",
                                      "block_table")


def _num_logit_rows(chunk: SeqChunk) -> int:
    if chunk.all_logits:
        return len(chunk.token_ids)
    return 1 if chunk.needs_logits else 0


def _logit_rows(chunks: tuple[SeqChunk, ...]) -> list[int]:
    """Rows of the flattened batch whose logits are wanted, chunk by chunk."""
    rows, first = [], 0
    for chunk in chunks:
        end = first + len(chunk.token_ids)
        rows.extend(range(end - _num_logit_rows(chunk), end))
        first = end
    return rows
