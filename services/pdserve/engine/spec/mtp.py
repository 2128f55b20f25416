"""MTP: the next-token-prediction layers a checkpoint carries beside its body draft for it.

    {"method": "mtp", "num_speculative_tokens": 1}

Served for Xiaomi MiMo checkpoints (`MiMoForCausalLM`: a Qwen2 body with `num_nextn_predict_layers`
and `model.mtp_layers.N.*` in the same files), read as vLLM reads them (`mimo_mtp.py`): at
position p, with the body's final normed hidden state h there and the embedding e of the token
at p + 1 (zero at position 0),

    x = input_proj(hidden_layernorm(h) | token_layernorm(e))       one Qwen2 decoder layer over x
    out = final_layernorm(x + attention + MLP)                      the body's LM head over out

and `out` is the hidden state fed with the next draft: layer 0 drafts every token, as vLLM runs
MiMo's (more drafts than layers reuse it). Other MTP formats (DeepSeek-V3's `enorm`/`hnorm`/
`eh_proj`, Qwen3-Next's `mtp.*`) belong to families pdserve does not serve, and are refused by
name. The layer's K/V and the handling of positions the head did not watch are `head_drafts.py`'s
and `eagle.py`'s (the same choice on a decode worker: start from the first position seen).
"""
from pathlib import Path

import torch

from pdserve.common.errors import ConfigError
from pdserve.common.speculative import FIELD, SpeculativeConfig
from pdserve.engine.loading.family_config import MIMO
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.loading.weights import load_model_config
from pdserve.engine.model.batch import HiddenCapture, HiddenStates
from pdserve.engine.model.layers import RMSNorm
from pdserve.engine.spec.head_drafts import HeadDrafts
from pdserve.engine.spec.head_layer import HeadLayer, Take, head_kv_bytes_per_block, read_hf_config, read_tensors, tensor_taker
from pdserve.engine.spec.proposers import DrafterContext

MODEL_FIELD = f"{FIELD}.model"
PREFIX = "model.mtp_layers.0."


def kv_bytes_per_block(config: SpeculativeConfig, tokens_per_block: int, kv_dtype: torch.dtype) -> int:
    """One MTP layer's K/V for one of the manager's blocks (it has the body's shape)."""
    return head_kv_bytes_per_block(load_model_config(_checkpoint(config)), tokens_per_block, kv_dtype)


def load(config: SpeculativeConfig, context: DrafterContext) -> HeadDrafts:
    """The target checkpoint's first MTP layer; ConfigError where it has none we serve."""
    path, target = Path(_checkpoint(config)), context.target
    arch = target.config.architecture
    if arch != MIMO:
        raise ConfigError(f"{FIELD}.method", config.method, f"MTP layers are served for {MIMO} checkpoints "
                          f"(model.mtp_layers.*); {arch} has none pdserve reads")
    hf = read_hf_config(path, MODEL_FIELD)
    if int(hf.get("num_nextn_predict_layers") or 0) < 1:
        raise ConfigError(MODEL_FIELD, str(path), "num_nextn_predict_layers is 0: the checkpoint carries no MTP layer")
    tensors = read_tensors(path, MODEL_FIELD, lambda name: name.startswith(PREFIX))
    cast = {n: t.to(device=target.device, dtype=target.dtype) for n, t in tensors.items()}
    head = MimoMtpHead(tensor_taker(cast, MODEL_FIELD, str(path)), target.config, target)
    return HeadDrafts(head, target, context.kv)


def _checkpoint(config: SpeculativeConfig) -> str:
    if config.model is None:
        raise ConfigError(MODEL_FIELD, None, "MTP reads the target's checkpoint: give the worker's model")
    return config.model


class MimoMtpHead:
    """MiMo's MTP layer 0 (module docstring)."""

    def __init__(self, take: Take, config: ModelConfig, target) -> None:
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config, self.target = config, target
        self.capture = HiddenCapture(final=True)
        self.token_norm = RMSNorm(take(PREFIX + "token_layernorm.weight", hidden), eps)
        self.hidden_norm = RMSNorm(take(PREFIX + "hidden_layernorm.weight", hidden), eps)
        self.input_proj = target.linear_op(take(PREFIX + "input_proj.weight", hidden, 2 * hidden))  # over hidden | embed
        self.input_norm = RMSNorm(take(PREFIX + "input_layernorm.weight", hidden), eps)
        self.layer = HeadLayer(take, PREFIX, config, hidden, target.device, target.linear_op)
        self.final_norm = RMSNorm(take(PREFIX + "final_layernorm.weight", hidden), eps)

    def target_hidden(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden.final

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = embeds.masked_fill((positions == 0).unsqueeze(1), 0.0)  # as vLLM: position 0 reads no token
        x = self.input_proj(torch.cat((self.hidden_norm(hidden), self.token_norm(embeds)), dim=1))
        return self.input_norm(x), x

    def draft(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.final_norm(out)
        return self.target.lm_head_logits(normed).argmax(dim=1), normed
