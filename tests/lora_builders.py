"""LoRA adapters for tests: random, non-zero PEFT adapters saved as PEFT saves them, and
PEFT's own greedy output as the reference."""
import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_PROJECTIONS = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def make_adapter(base: torch.nn.Module, directory: Path, seed: int, targets: tuple[str, ...] = ALL_PROJECTIONS,
                 r: int = 8, alpha: int = 16, use_rslora: bool = False, scale: float = 0.3) -> PeftModel:
    """Save a random adapter of `base` in `directory` (both halves random: `init_lora_weights=False`,
    so it changes the output; each half times `scale`, to suit the base's weights); returns the
    PEFT model (on a copy of `base`) for reference outputs."""
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    model.save_pretrained(directory)
    return model


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' (or PEFT's) greedy continuation of `prompt`, never stopping at EOS."""
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return ids[0, len(prompt):].tolist()
