"""The decoder of every served family over flattened tokens and the paged KV cache.

Projections that read the same input are fused at load time (q|k|v, gate|up), so a layer
runs four matmuls over all tokens of the step at once; only attention looks at sequences.
"""
import torch
import torch.nn.functional as F

from pdserve.common.errors import ConfigError
from pdserve.engine.model.attention import AttentionPlan, paged_attention
from pdserve.engine.model.batch import HiddenCapture, HiddenStates
from pdserve.engine.model.kv_tensor import PagedKvCache
from pdserve.engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pdserve.engine.model.lora import NO_LORA, O_PROJ, QKV, LoraStep
from pdserve.engine.model.moe import MoeMLP, load_moe_mlp
from pdserve.engine.loading.mapped_pages import release_copied_pages
from pdserve.engine.loading.model_config import ModelConfig


class _Weights:
    """Hands out checkpoint tensors by HF name, checking each one's shape."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def take(self, name: str, *shape: int) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ConfigError("checkpoint", name, "tensor missing from the checkpoint")
        if tuple(tensor.shape) != shape:
            raise ConfigError(name, tuple(tensor.shape), f"expected shape {shape}")
        return tensor

    def take_optional(self, is_present: bool, name: str, *shape: int) -> torch.Tensor | None:
        return self.take(name, *shape) if is_present else None


class DecoderLayer:
    """One decoder layer. Optional parts are None where the family has none: q/k norms (Qwen3,
    Gemma 3) and the norms of the attention's and the MLP's outputs (Gemma's sandwich). Each
    layer has its own window (None: global) and rope (an index into `CausalLM.ropes`)."""

    __slots__ = ("index", "num_heads", "num_kv_heads", "head_dim", "scale", "window", "rope", "input_norm", "qkv",
                 "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "attn_out_norm", "post_norm", "mlp",
                 "mlp_out_norm")

    def __init__(self, index: int, config: ModelConfig, weights: _Weights, rope: int) -> None:
        c, prefix = config, f"model.layers.{index}."
        self.index, self.window, self.rope, self.scale = index, c.window_of(index), rope, c.attention_scale
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        attn = prefix + "self_attn."
        norm = _norms(c, weights)
        self.input_norm = norm(prefix + "input_layernorm.weight", c.hidden_size)
        self.q_norm = norm(attn + "q_norm.weight", c.head_dim) if c.qk_norm else None
        self.k_norm = norm(attn + "k_norm.weight", c.head_dim) if c.qk_norm else None
        if c.sandwich_norms:
            self.attn_out_norm = norm(prefix + "post_attention_layernorm.weight", c.hidden_size)
            self.post_norm = norm(prefix + "pre_feedforward_layernorm.weight", c.hidden_size)
            self.mlp_out_norm = norm(prefix + "post_feedforward_layernorm.weight", c.hidden_size)
        else:
            self.attn_out_norm = self.mlp_out_norm = None
            self.post_norm = norm(prefix + "post_attention_layernorm.weight", c.hidden_size)
        if c.fused_projections:
            self.qkv = weights.take(attn + "qkv_proj.weight", q_width + 2 * kv_width, c.hidden_size)
        else:
            self.qkv = _fused([weights.take(attn + "q_proj.weight", q_width, c.hidden_size),
                               weights.take(attn + "k_proj.weight", kv_width, c.hidden_size),
                               weights.take(attn + "v_proj.weight", kv_width, c.hidden_size)])  # (q+2kv, H)
        self.qkv_bias = torch.cat([weights.take(attn + "q_proj.bias", q_width),
                                   weights.take(attn + "k_proj.bias", kv_width),
                                   weights.take(attn + "v_proj.bias", kv_width)]) if c.qkv_bias else None
        self.o_proj = weights.take(attn + "o_proj.weight", c.hidden_size, q_width)
        self.o_bias = weights.take_optional(c.o_bias, attn + "o_proj.bias", c.hidden_size)
        self.mlp = load_moe_mlp(prefix, c, weights.take) if c.is_moe_layer(index) else _mlp(prefix + "mlp.", c, weights)

    def drop_matrices(self) -> None:
        """Let go of the four matrices (see `CausalLM.drop_matrices`)."""
        self.qkv = self.o_proj = None
        for mlp in _gated_mlps(self.mlp):
            mlp.gate_up = mlp.down = None

    def own_vectors(self) -> None:
        """Norm weights and biases copied into memory of their own (see `CausalLM.drop_matrices`)."""
        for norm in (self.input_norm, self.post_norm, self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm):
            if norm is not None:
                norm.weight = _owned(norm.weight)
        self.qkv_bias, self.o_bias = _owned(self.qkv_bias), _owned(self.o_bias)
        for mlp in _gated_mlps(self.mlp):
            mlp.gate_up_bias, mlp.down_bias = _owned(mlp.gate_up_bias), _owned(mlp.down_bias)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 plan: AttentionPlan, kv: PagedKvCache, lora: LoraStep = NO_LORA) -> torch.Tensor:
        """h (T, H) -> (T, H); writes this layer's K/V for the step's tokens into `kv`."""
        num_tokens, nh, kvh, hd = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = self.input_norm(h)
        qkv = lora.add(F.linear(x, self.qkv, self.qkv_bias), x, self.index, QKV)  # (T, (nh + 2 kvh) hd)
        qk = qkv[:, :(nh + kvh) * hd].view(num_tokens, nh + kvh, hd)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
        qk = RotaryEmbedding.apply(qk, cos, sin)  # (T, nh + kvh, hd): q and k share one rotation
        v = qkv[:, (nh + kvh) * hd:].view(num_tokens, kvh, hd)
        attn = paged_attention(self.index, qk[:, :nh], qk[:, nh:], v, plan, kv, self.scale)  # (T, nh hd)
        out = lora.add(F.linear(attn, self.o_proj, self.o_bias), attn, self.index, O_PROJ)
        h = h + (out if self.attn_out_norm is None else self.attn_out_norm(out))
        out = self.mlp(self.post_norm(h), lora, self.index)
        return h + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))


def _norms(c: ModelConfig, weights: _Weights):
    """RMSNorm maker; Gemma's (1 + w) scaling is folded into the weight here, once."""
    def norm(name: str, width: int) -> RMSNorm:
        weight = weights.take(name, width)
        return RMSNorm(weight + c.norm_offset if c.norm_offset else weight, c.rms_norm_eps)
    return norm


def _gated_mlps(mlp: GatedMLP | MoeMLP) -> list[GatedMLP]:
    """The dense MLP, or a mixture's experts (its router is owned already)."""
    return mlp.experts if isinstance(mlp, MoeMLP) else [mlp]


def _owned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _fused(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked into one matrix; their pages of a checkpoint's file map, read for the
    copy and never again, are given back."""
    fused = torch.cat(parts)
    release_copied_pages(parts)
    return fused


def _mlp(prefix: str, c: ModelConfig, weights: _Weights) -> GatedMLP:
    if c.fused_projections:
        gate_up = weights.take(prefix + "gate_up_proj.weight", 2 * c.intermediate_size, c.hidden_size)
    else:
        gate_up = _fused([weights.take(prefix + "gate_proj.weight", c.intermediate_size, c.hidden_size),
                          weights.take(prefix + "up_proj.weight", c.intermediate_size, c.hidden_size)])
    gate_up_bias = torch.cat([weights.take(prefix + "gate_proj.bias", c.intermediate_size),
                              weights.take(prefix + "up_proj.bias", c.intermediate_size)]) if c.mlp_bias else None
    down = weights.take(prefix + "down_proj.weight", c.hidden_size, c.intermediate_size)
    return GatedMLP(gate_up, down, gate_up_bias,
                    weights.take_optional(c.mlp_bias, prefix + "down_proj.bias", c.hidden_size), c.activation)


class CausalLM:
    """Embedding, decoder layers, final norm and LM head; weights are plain tensors."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        c, weights = config, _Weights(tensors)
        self.config = config
        self.embed = weights.take("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
        ropes = list(dict.fromkeys(c.rope_of(i) for i in range(c.num_layers)))  # distinct, in layer order
        self.ropes = [RotaryEmbedding(rope, c.head_dim, device) for rope in ropes]
        self.layers = [DecoderLayer(i, c, weights, ropes.index(c.rope_of(i))) for i in range(c.num_layers)]
        self.norm = _norms(c, weights)("model.norm.weight", c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else weights.take(
            "lm_head.weight", c.vocab_size, c.hidden_size)
        # Gemma multiplies embeddings by sqrt(hidden), the factor rounded to the model's dtype first
        self.embed_scale = None if c.embed_scale is None else float(torch.tensor(c.embed_scale, dtype=self.embed.dtype))
        self.matrices_dropped = False

    def drop_matrices(self) -> None:
        """Let go of every layer's matrices and an untied LM head, once the native kernels hold
        packed copies of them (one copy of the weights in memory); `forward` then refuses.

        What stays (embedding, norms, biases) is copied into memory of its own: a checkpoint
        read through a file map gives all its tensors one storage, which any of them keeps."""
        tied = self.lm_head is self.embed
        self.embed = self.embed.clone()
        self.lm_head = self.embed if tied else None
        self.norm.weight = self.norm.weight.clone()
        for layer in self.layers:
            layer.drop_matrices()
            layer.own_vectors()
        self.matrices_dropped = True

    @property
    def windows(self) -> set[int | None]:
        """The distinct windows of the layers (None: global); one attention plan each per step."""
        return {layer.window for layer in self.layers}

    def forward(self, token_ids: torch.Tensor, plans: dict[int | None, AttentionPlan], kv: PagedKvCache,
                logit_rows: torch.Tensor, lora: LoraStep = NO_LORA,
                capture: HiddenCapture | None = None) -> tuple[torch.Tensor, HiddenStates | None]:
        """token_ids (T,) -> float32 logits (R, vocab) of the hidden rows `logit_rows` (R,), and
        the hidden states `capture` asks for (None without it); `plans` has the step's attention
        plan for each of `windows`; `lora` adds each adapter's deltas to its own rows."""
        if self.matrices_dropped:
            raise RuntimeError("this model's matrices were handed to the native kernels; run it through them")
        h = F.embedding(token_ids, self.embed)  # (T, H)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        positions = next(iter(plans.values())).positions
        rotations = [rope.cos_sin(positions, h.dtype) for rope in self.ropes]  # (cos, sin), (T, 1, hd) each
        inputs = []  # the residual stream entering each captured layer, in `capture.layers` order
        for layer in self.layers:
            if capture is not None and layer.index in capture.layers:
                inputs.append((layer.index, h))
            h = layer(h, *rotations[layer.rope], plans[layer.window], kv, lora)
        hidden = None if capture is None else _captured(capture, inputs, self.norm(h) if capture.final else None)
        if logit_rows.numel() == 0:
            return h.new_empty(0, self.config.vocab_size, dtype=torch.float32), hidden
        last = self.norm(h.index_select(0, logit_rows))  # (R, H)
        return F.linear(last, self.lm_head).float(), hidden


def _captured(capture: HiddenCapture, inputs: list[tuple[int, torch.Tensor]], final: torch.Tensor | None) -> HiddenStates:
    by_layer = dict(inputs)
    layers = torch.cat([by_layer[i] for i in capture.layers], dim=1) if capture.layers else None  # (T, n H)
    return HiddenStates(final, layers)
