"""EAGLE and EAGLE-3 heads: one decoder layer drafting from the target's hidden states.

    {"method": "eagle",  "model": "/path/to/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3}
    {"method": "eagle3", "model": "/path/to/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}

A head checkpoint is read as vLLM reads it (`llama_eagle.py`, `llama_eagle3.py`); at position p
it reads the target's hidden state there and the embedding of the token at p + 1:

- EAGLE-1 (`fc.weight`, `layers.0.*`): x = fc(embed | hidden), the target's final normed hidden
  state; one Llama layer without an input norm (its residual stream is x); its output goes
  through the target's LM head unnormed, and is itself the hidden state fed with the next draft.
- EAGLE-3 (`LlamaForCausalLMEagle3`: `fc.weight`, `midlayer.*`, `norm`, `lm_head`, `d2t`): the
  target's hidden state is fc(low | mid | high), the residual stream entering three of its layers
  (`eagle_aux_hidden_state_layer_ids` in the head's config, else vLLM's 2, L/2 and L-3); the
  layer's attention reads input_layernorm(embed) | hidden_norm(hidden) (q/k/v of twice the
  hidden width) over the residual stream hidden; the output, normed, goes through the head's LM
  head over a draft vocabulary whose id i is target id i + d2t[i]; the output before that norm
  is the hidden state fed with the next draft. The head's own `embed_tokens`, where it has
  one, replaces the target's.

Both run over the target's embedding (EAGLE-3: unless its own), in the target's dtype, with K/V
of their own one layer under the target's block ids (`head_layer.py`).

Disaggregated (and any prefix the target did not compute under the head's eyes): the decode
worker's head starts at the first position whose hidden state it sees, the first decode step's,
and attends only over what it wrote from there (`head_drafts.py`); the first step drafts nothing.
The other choice, a target pass over the prompt on the decode worker to recover its hidden
states, would redo the prefill there.
"""
from pathlib import Path

import torch

from pdserve.common.errors import ConfigError
from pdserve.common.speculative import FIELD, SpeculativeConfig
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.batch import HiddenCapture, HiddenStates
from pdserve.engine.model.layers import RMSNorm
from pdserve.engine.spec.head_drafts import HeadDrafts
from pdserve.engine.spec.head_layer import (HeadLayer, Take, head_kv_bytes_per_block, read_hf_config, read_tensors,
                                            tensor_taker)
from pdserve.engine.spec.proposers import DrafterContext

MODEL_FIELD = f"{FIELD}.model"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


def kv_bytes_per_block(config: SpeculativeConfig, tokens_per_block: int, kv_dtype: torch.dtype) -> int:
    """The head's one layer of K/V for one of the manager's blocks."""
    return head_kv_bytes_per_block(_head_config(Path(config.model)), tokens_per_block, kv_dtype)


def load(config: SpeculativeConfig, context: DrafterContext) -> HeadDrafts:
    """The head of `config.model` beside the target; ConfigError naming `speculative_config.model`
    for a head of another layout or shape than the method and the target need."""
    path, target = Path(config.model), context.target
    hf = read_hf_config(path, MODEL_FIELD)
    tensors = {_plain_name(n): t for n, t in read_tensors(path, MODEL_FIELD, lambda name: True).items()}
    is_eagle3 = (hf.get("architectures", [None])[0] in EAGLE3_ARCHITECTURES
                 or any(n.startswith("midlayer.") or n.endswith(".hidden_norm.weight") for n in tensors))
    if config.method == "eagle3" and not is_eagle3:
        raise ConfigError(MODEL_FIELD, config.model, "not an EAGLE-3 head (no midlayer.* tensors): use method 'eagle'")
    if config.method == "eagle" and is_eagle3:
        raise ConfigError(MODEL_FIELD, config.model, "an EAGLE-3 head: use method 'eagle3'")
    _check_served(hf)
    head_config = _head_config(path)
    _check_fits(head_config, target.config, config.model)
    dtype, device = target.dtype, target.device
    cast = {n: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for n, t in tensors.items()}
    take = tensor_taker(cast, MODEL_FIELD, config.model)
    head = (Eagle3Head(take, cast, hf, head_config, target, config.model) if config.method == "eagle3"
            else Eagle1Head(take, cast, head_config, target))
    return HeadDrafts(head, target, context.kv)


def _plain_name(name: str) -> str:
    """Some conversions keep the heads' tensors under `model.`; the published ones do not."""
    return name.removeprefix("model.") if not name.startswith("model.lm_head") else name


def _head_config(path: Path) -> ModelConfig:
    """The head's layer shape, read as a Llama layer's (an EAGLE-3 config names its own architecture)."""
    hf = read_hf_config(path, MODEL_FIELD)
    try:
        return ModelConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"]})
    except ConfigError as err:
        raise ConfigError(MODEL_FIELD, str(path), f"{err.field}: {err.reason}") from None


def _check_served(hf: dict) -> None:
    """Variants vLLM reads that these heads do not compute: refused by name, never drafted wrong."""
    if hf.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"{MODEL_FIELD}.num_hidden_layers", hf["num_hidden_layers"], "heads of one layer are served")
    if hf.get("add_para_norm"):
        raise ConfigError(f"{MODEL_FIELD}.add_para_norm", True, "HASS-style heads (norms of embed and hidden "
                          "before fc) are not served")
    if (hf.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ConfigError(f"{MODEL_FIELD}.eagle_config.use_aux_hidden_state", False, "EAGLE-3 heads read the "
                          "three target layers' states (use_aux_hidden_state true)")


def _check_fits(head: ModelConfig, target: ModelConfig, source: str) -> None:
    if head.vocab_size != target.vocab_size:
        raise ConfigError(MODEL_FIELD, source, f"its vocabulary has {head.vocab_size} tokens, the target's "
                          f"{target.vocab_size}: a head drafts in its target's vocabulary")
    if head.hidden_size != target.hidden_size:
        raise ConfigError(MODEL_FIELD, source, f"its hidden size is {head.hidden_size}, the target's "
                          f"{target.hidden_size}")


class Eagle1Head:
    """EAGLE-1 (module docstring)."""

    def __init__(self, take: Take, tensors: dict[str, torch.Tensor], config: ModelConfig, target) -> None:
        hidden = config.hidden_size
        self.config, self.target = config, target
        self.capture = HiddenCapture(final=True)
        self.fc = target.linear_op(take("fc.weight", hidden, 2 * hidden))  # (H, 2H) over embed | hidden
        self.fc_bias = take("fc.bias", hidden) if "fc.bias" in tensors else None  # the original EAGLE's
        self.layer = HeadLayer(take, "layers.0.", config, hidden, target.device, target.linear_op)

    def target_hidden(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden.final

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((embeds, hidden), dim=1), self.fc_bias)  # (T, H)
        return x, x  # no input norm: the layer attends over its residual stream itself

    def draft(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target.lm_head_logits(out).argmax(dim=1), out


class Eagle3Head:
    """EAGLE-3 (module docstring)."""

    def __init__(self, take: Take, tensors: dict[str, torch.Tensor], hf: dict, config: ModelConfig, target,
                 source: str) -> None:
        hidden, t = config.hidden_size, target.config
        self.config, self.target = config, target
        self.capture = HiddenCapture(layers=_aux_layers(hf, t.num_layers))
        target_hidden = int(hf.get("target_hidden_size") or t.hidden_size)
        self.fc = target.linear_op(take("fc.weight", hidden, len(self.capture.layers) * target_hidden))  # (H, 3 H_t)
        prefix = "midlayer." if any(n.startswith("midlayer.") for n in tensors) else "layers.0."
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(take(prefix + "input_layernorm.weight", hidden), eps)
        self.hidden_norm = RMSNorm(take(prefix + "hidden_norm.weight", hidden), eps)
        self.norm_before_residual = bool(hf.get("norm_before_residual", False))
        self.layer = HeadLayer(take, prefix, config, 2 * hidden, target.device, target.linear_op)
        self.norm = RMSNorm(take("norm.weight", hidden), eps)
        draft_vocab = int(hf.get("draft_vocab_size") or config.vocab_size)
        self.lm_head = target.linear_op(take("lm_head.weight", draft_vocab, hidden))
        self.to_target = torch.arange(draft_vocab, device=target.device) + (
            take("d2t", draft_vocab).long() if "d2t" in tensors else 0)  # draft id -> target id
        if not bool(((self.to_target >= 0) & (self.to_target < t.vocab_size)).all()):
            raise ConfigError(MODEL_FIELD, source, "its d2t maps draft ids outside the target's vocabulary")
        self.embed = take("embed_tokens.weight", t.vocab_size, hidden) if "embed_tokens.weight" in tensors else None

    def target_hidden(self, hidden: HiddenStates) -> torch.Tensor:
        return self.fc(hidden.layers)  # (T, H)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids) if self.embed is None else self.embed.index_select(0, token_ids)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat((self.input_norm(embeds), normed), dim=1), residual  # (T, 2H), (T, H)

    def draft(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(self.norm(out))  # (R, draft vocab)
        return self.to_target[logits.argmax(dim=1)], out


def _aux_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads: its config's, else low, mid and high."""
    layers = tuple(hf.get(AUX_LAYERS_KEY) or (2, num_layers // 2, num_layers - 3))
    if len(set(layers)) != len(layers) or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
        raise ConfigError(f"{MODEL_FIELD}.{AUX_LAYERS_KEY}", list(layers),
                          f"distinct layers of the target's 0..{num_layers - 1} (set it in the head's config.json "
                          "for a target this shallow)")
    return layers
