"""Builders for tiny random-weight checkpoints (saved with transformers) and forward batches.

A module of its own (not conftest) so tests import it by a name no other test folder uses.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from pdserve.common.ids import RequestId
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.model.runner import ModelRunner

# head_dim 32: the smallest the native CPU kernels run, so both forward paths are exercised.
TINY = dict(vocab_size=300, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.1)  # wide init: logits far apart, so greedy argmax has no near-ties
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    "llama3_rope": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, "rope_theta": 500000.0}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    # A window layer then a global one, each with its own rope base; a score scale that is not
    # head_dim's; soft-capped logits. The window of 8 is shorter than the tests' prompts. Untied (the
    # tied head, with sqrt(hidden)-scaled embeddings, makes greedy output echo the input more than
    # depend on the layers; tests/family_builders.py serves the tied form).
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "head_dim": 32, "tie_word_embeddings": False, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # LongRoPE: positions below 64 take the short factors (the tests' prompts), then the long ones.
    "phi3": (Phi3Config, Phi3ForCausalLM, {
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0 + i / 16 for i in range(16)],
                            "long_factor": [2.0 + i / 4 for i in range(16)]}}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # A dense layer after a sparse one; top-2 of 4 experts renormalised.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True, "mlp_only_layers": [1]}),
}
TOKENS_PER_BLOCK = 4


@dataclass(frozen=True)
class TinyCheckpoint:
    path: Path
    hf_model: torch.nn.Module

    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        """(len(token_ids), vocab) teacher-forced logits from transformers."""
        with torch.no_grad():
            return self.hf_model(torch.tensor([token_ids])).logits[0].float()


def make_checkpoint(directory: Path, kind: str, seed: int = 0, **save_kwargs) -> TinyCheckpoint:
    config_cls, model_cls, extra = ARCHITECTURES[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    model.save_pretrained(directory, **save_kwargs)
    return TinyCheckpoint(directory, model)


def load_runner(checkpoint: TinyCheckpoint, num_blocks: int = 64, **kwargs) -> ModelRunner:
    return ModelRunner.load(checkpoint.path, dtype=kwargs.pop("dtype", "float32"), device="cpu",
                            num_blocks=num_blocks, tokens_per_block=TOKENS_PER_BLOCK, **kwargs)


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY["vocab_size"], (length,), generator=generator).tolist()


def chunk(rid: str, token_ids: list[int], start_pos: int, blocks: list[int], *, all_logits: bool = False,
          needs_logits: bool = True, is_prompt: bool = False) -> SeqChunk:
    return SeqChunk(RequestId(rid), tuple(token_ids), start_pos, tuple(blocks),
                    needs_logits=needs_logits, all_logits=all_logits, is_prompt=is_prompt)


def run(runner: ModelRunner, *chunks: SeqChunk) -> list[torch.Tensor]:
    return runner.forward(ForwardBatch(tuple(chunks))).logits


def blocks_for(first: int, num_tokens: int) -> list[int]:
    """Consecutive block ids from `first`, enough for `num_tokens` tokens."""
    return list(range(first, first + -(-num_tokens // TOKENS_PER_BLOCK)))
