"""Tiny random checkpoints of every served family with a real tokenizer (SmolLM2's, so the
server's text and token handling are the real ones), saved with transformers, and their greedy
continuations as the reference."""
import os
from pathlib import Path

import torch

# head_dim 32 (the least the native kernels run); the window of 16 is one block of the default
# size, so prompts of 3x the window leave whole blocks out of the window layers' reach.
WINDOW = 16
_COMMON = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.1)


def _families() -> dict:
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MixtralConfig, MixtralForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    return {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
            "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0, "tie_word_embeddings": False}),
        "phi3": (Phi3Config, Phi3ForCausalLM, {"original_max_position_embeddings": 256, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 16 for i in range(16)],
            "long_factor": [2.0 + i / 4 for i in range(16)]}}),
        "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}),
    }


FAMILIES = ("qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe")


def make_family_checkpoint(directory: Path, kind: str, seed: int = 0) -> torch.nn.Module:
    """Save a tiny `kind` model and SmolLM2's tokenizer in `directory`; returns the model."""
    from transformers import AutoTokenizer

    from pdserve.common.model_source import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config_cls, model_cls, extra = _families()[kind]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **_COMMON, **extra)
    model = model_cls(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model
