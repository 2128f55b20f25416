"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE) over a step's flattened tokens.

A router product gives each token a softmax (float32) over the experts; the token takes its
`top_k` largest, renormalised to sum to 1 where the family does (`MoeConfig.normalize_top_k`).
The step's (token, slot) pairs are then sorted by expert, so each expert that any token chose
runs its gated MLP once, over all its rows together (a Python loop over experts, never over
tokens), and one index_add sums the weighted outputs back into their tokens, expert by expert
in ascending order, as transformers adds them.

    sorted rows (T k, H): | expert 0's tokens | expert 1's tokens | ... |   (`counts` rows each)

Experts are not LoRA targets (`lora.py` refuses adapters on them); the call takes `lora` and
`layer` only to be called as the dense `GatedMLP` is.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.loading.family_config import MIXTRAL
from pdserve.engine.loading.mapped_pages import release_copied_pages
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.layers import GatedMLP
from pdserve.engine.model.lora import NO_LORA, LoraStep

Take = Callable[..., torch.Tensor]  # (HF name, *expected shape) -> the checkpoint's tensor


@dataclass(frozen=True, slots=True)
class Routes:
    """Each token's experts and their weights, and the step's (token, slot) pairs by expert."""

    weights: torch.Tensor  # (T, k) float32, each token's weights of its experts
    order: torch.Tensor  # (T k,) int64: flat (token * k + slot) indices, sorted by expert (stable)
    counts: list[int]  # (E,) rows of each expert in `order`


class MoeMLP:
    """Router (E, H) and E experts, each a gated MLP with no biases. `weights_in_float32`: the
    expert outputs are scaled by the float32 routing weights and then rounded to the model's
    dtype (Mixtral); otherwise the weights are rounded first (Qwen3-MoE), as transformers does."""

    __slots__ = ("router", "experts", "top_k", "normalize_top_k", "weights_in_float32")

    def __init__(self, router: torch.Tensor, experts: list[GatedMLP], top_k: int, normalize_top_k: bool,
                 weights_in_float32: bool) -> None:
        self.router = router  # (E, H)
        self.experts = experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.weights_in_float32 = weights_in_float32

    def route(self, x: torch.Tensor) -> Routes:
        """x (T, H) -> the step's routes."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.normalize_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()  # (T k,)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        return Routes(weights, order, counts)

    def __call__(self, x: torch.Tensor, lora: LoraStep = NO_LORA, layer: int = 0) -> torch.Tensor:
        """(T, H) -> (T, H)."""
        routes = self.route(x)
        tokens = routes.order // self.top_k  # (T k,) the token of each sorted row
        rows = x.index_select(0, tokens)  # (T k, H)
        out = torch.empty_like(rows)
        first = 0
        for expert, count in zip(self.experts, routes.counts):
            if count:
                out[first:first + count] = expert(rows[first:first + count])
                first += count
        weights = routes.weights.flatten().index_select(0, routes.order).unsqueeze(1)  # (T k, 1)
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, (out * weights).to(x.dtype))


def load_moe_mlp(layer_prefix: str, c: ModelConfig, take: Take) -> MoeMLP:
    """Layer `layer_prefix`'s ("model.layers.N.") router and experts; each expert's gate and up
    are fused into one matrix, as the dense MLP's are. The router is copied into memory of its
    own (it is small), so it never keeps a checkpoint's file map alive."""
    moe, hidden = c.moe, c.hidden_size
    inter = moe.expert_intermediate_size
    if c.architecture == MIXTRAL:
        block, (gate, up, down) = layer_prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, (gate, up, down) = layer_prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    experts = []
    for e in range(moe.num_experts):
        name = f"{block}experts.{e}."
        parts = [take(name + gate + ".weight", inter, hidden), take(name + up + ".weight", inter, hidden)]
        gate_up = torch.cat(parts)  # (2I, H)
        release_copied_pages(parts)
        experts.append(GatedMLP(gate_up, take(name + down + ".weight", hidden, inter), activation=c.activation))
    router = take(block + "gate.weight", moe.num_experts, hidden).clone()
    return MoeMLP(router, experts, moe.top_k, moe.normalize_top_k, weights_in_float32=c.architecture == MIXTRAL)
