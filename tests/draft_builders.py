"""Draft checkpoints for speculative decoding tests: tiny random Llamas that share a target
checkpoint's vocabulary (so its tokenizer's ids), saved with transformers."""
import copy
from pathlib import Path

import torch


def make_draft_checkpoint(directory: Path, target: Path, num_layers: int = 1, seed: int = 1, **overrides) -> Path:
    """A random Llama with `target`'s config (vocabulary, width, context) but `num_layers` layers
    and weights of its own (`seed`); `overrides` change other config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(target)
    config.num_hidden_layers = num_layers
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make_noisy_copy(directory: Path, model: torch.nn.Module, scale: float, seed: int = 1) -> Path:
    """`model` with Gaussian noise of `scale` times each weight's own spread added: a draft
    that agrees with its target often, but not always."""
    torch.manual_seed(seed)
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn_like(param) * param.std() * scale)
    noisy.save_pretrained(directory)
    return directory
