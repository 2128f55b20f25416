"""The drafting heads' arithmetic written plainly, one position at a time, over transformers'
hidden states of the target: what `engine/spec/eagle.py` and `mtp.py` must draft, teacher-forced
on the same tokens (the tests compare drafts, not acceptance: the heads are random)."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x (n, hd) rotated to `position`, halves paired (Llama's layout)."""
    half = x.shape[-1] // 2
    angles = position / theta ** (torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])
    cos, sin = angles.cos(), angles.sin()
    first, second = x[:, :half], x[:, half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Layer:
    """One decoder layer with a growing list of keys and values, one position per call."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, config: dict) -> None:
        self.w, self.p, self.c = w, prefix, config
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.heads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        bias = self.w.get(self.p + name + ".bias")
        y = x @ self.w[self.p + name + ".weight"].T
        return y if bias is None else y + bias

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, position: int) -> torch.Tensor:
        """x (X,) the attention's input, residual (H,) -> (H,)."""
        theta, hd = self.c.get("rope_theta", 10000.0), self.head_dim
        q = _rotate(self._linear("self_attn.q_proj", x).view(self.heads, hd), position, theta)
        self.keys.append(_rotate(self._linear("self_attn.k_proj", x).view(self.kv_heads, hd), position, theta))
        self.values.append(self._linear("self_attn.v_proj", x).view(self.kv_heads, hd))
        keys = torch.stack(self.keys).repeat_interleave(self.heads // self.kv_heads, dim=1)  # (S, nh, hd)
        values = torch.stack(self.values).repeat_interleave(self.heads // self.kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,shd->hs", q, keys) / hd ** 0.5, dim=-1)  # (nh, S)
        attn = torch.einsum("hs,shd->hd", weights, values).reshape(-1)
        h = residual + self._linear("self_attn.o_proj", attn)
        y = _rms(h, self.w[self.p + "post_attention_layernorm.weight"], self.c["rms_norm_eps"])
        gate, up = self._linear("mlp.gate_proj", y), self._linear("mlp.up_proj", y)
        return h + self._linear("mlp.down_proj", torch.nn.functional.silu(gate) * up)


class ReferenceHead:
    """`kind` is eagle, eagle3 or mtp; `head_dir` the head's checkpoint (mtp: the target's)."""

    def __init__(self, kind: str, head_dir: Path, target) -> None:
        self.kind, self.target = kind, target  # target: a transformers causal LM
        self.config = json.loads((head_dir / "config.json").read_text())
        self.eps = self.config["rms_norm_eps"]
        if kind == "eagle":
            raw = torch.load(head_dir / "pytorch_model.bin", weights_only=True)
        else:
            raw = load_file(str(head_dir / "model.safetensors"))
        self.w = {n: t.float() if t.is_floating_point() else t for n, t in raw.items()}
        self.embed = self.w.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
        self.lm_head = target.lm_head.weight.detach()
        num_layers = target.config.num_hidden_layers
        self.aux = tuple(self.config.get("eagle_aux_hidden_state_layer_ids") or (2, num_layers // 2, num_layers - 3))

    def drafts(self, token_ids: list[int], num_computed: int, num_drafts: int, first: int = 0) -> list[int]:
        """Greedy drafts after the first `num_computed` tokens, token_ids[num_computed] being the
        last sampled one; the head reads its own K/V from position `first` on."""
        with torch.no_grad():
            states = self.target(torch.tensor([token_ids[:num_computed]]), output_hidden_states=True).hidden_states
            features = self._features(states)
            layer = Layer(self.w, {"eagle": "layers.0.", "eagle3": "midlayer.", "mtp": "model.mtp_layers.0."}[self.kind],
                          self.config)
            out = None
            for p in range(first, num_computed):
                out = self._row(layer, token_ids[p + 1], features[p], p)
            drafts = []
            for i in range(num_drafts):
                token, carried = self._draft(out)
                drafts.append(token)
                if i + 1 < num_drafts:
                    out = self._row(layer, token, carried, num_computed + i)
            return drafts

    def _features(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.kind == "eagle3":
            return torch.cat([states[i][0] for i in self.aux], dim=-1) @ self.w["fc.weight"].T
        return states[-1][0]

    def _row(self, layer: Layer, token: int, hidden: torch.Tensor, position: int) -> torch.Tensor:
        e, w = self.embed[token], self.w
        if self.kind == "eagle":
            x = torch.cat((e, hidden)) @ w["fc.weight"].T
            return layer(x, x, position)
        if self.kind == "eagle3":
            x = torch.cat((_rms(e, w["midlayer.input_layernorm.weight"], self.eps),
                           _rms(hidden, w["midlayer.hidden_norm.weight"], self.eps)))
            return layer(x, hidden, position)
        p = "model.mtp_layers.0."
        e = torch.zeros_like(e) if position == 0 else e
        x = torch.cat((_rms(hidden, w[p + "hidden_layernorm.weight"], self.eps),
                       _rms(e, w[p + "token_layernorm.weight"], self.eps))) @ w[p + "input_proj.weight"].T
        return layer(_rms(x, w[p + "input_layernorm.weight"], self.eps), x, position)

    def _draft(self, out: torch.Tensor) -> tuple[int, torch.Tensor]:
        if self.kind == "eagle":
            return int((out @ self.lm_head.T).argmax()), out
        if self.kind == "eagle3":
            draft = int((_rms(out, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T).argmax())
            return draft + int(self.w["d2t"][draft]), out
        normed = _rms(out, self.w["model.mtp_layers.0.final_layernorm.weight"], self.eps)
        return int((normed @ self.lm_head.T).argmax()), normed
