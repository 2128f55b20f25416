"""`NativeForward`: a `CausalLM`'s forward through the native CPU kernels (`engine/native`).

Same weights, same KV tensor, same logits as `CausalLM.forward` up to float rounding: each
step Python hands over four small tensors (and the step's LoRA rows) and the C++ side runs
every layer.

    segments (S, 4) int32: | q_start (row in the step) | q_len | start_pos (tokens already in KV) | prompt |
"""
import torch

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.mapped_pages import release_copied_pages
from pdserve.engine.model.batch import ForwardBatch, HiddenCapture, HiddenStates
from pdserve.engine.model.decoder import CausalLM, DecoderLayer
from pdserve.engine.model.kv_tensor import PagedKvCache
from pdserve.engine.model.layers import RMSNorm, RotaryEmbedding
from pdserve.engine.model.lora import NO_LORA, AdapterLayer, LoraStep
from pdserve.engine.model.moe import MoeMLP
from pdserve.engine.model.native import KERNEL_CHOICES, KernelsUnavailable, load_native

# oneDNN chooses its blocked weight layout for a row count; measured the same speed with the
# layout for 1 row and for 64 from 1 to 128 rows, so one packing serves decode and prefill.
PACK_FOR_ROWS = 64
# Steps of up to this many rows read the packed weights with the native `blocked_linear`
# (native/avx512/blocked_linear.h), larger ones run oneDNN's kernel. On a 2-core AMD EPYC
# (AVX512-BF16), SmolLM2-135M's products took 0.47-0.6x oneDNN's time at 1-10 rows, 0.85-0.92x at
# 64, 0.94x at 128 and 0.98-1.02x at 2,048. Where the CPU has AMX tiles oneDNN multiplies on them
# and packs in blocks of 32 columns; a variant of the kernel reading those took, on a 2-core Xeon
# with AMX, 0.91-0.99x oneDNN's time at 1 row (both bound by reading the weights), 1.2-1.5x at 2-8
# rows and 2-4.9x at 16-64: there every step stays on oneDNN (one kernel, so a prompt's bits do
# not depend on how it is chunked either).
BLOCKED_ROWS = 128
BLOCK_COLUMNS = 64  # of the packed layout `blocked_linear` reads; matrices of other widths run oneDNN's kernel


def packs_weights(dtype: torch.dtype) -> bool:
    """bf16 matrices run packed on oneDNN where it has bf16 kernels for this CPU; float32 ones
    stay plain and run through `at::linear` (the fidelity path)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) plain -> the same matrix in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)


def blocked_kernel_may_run() -> bool:
    """False on CPUs with AMX tiles, where every product stays on oneDNN (see BLOCKED_ROWS)."""
    return torch.backends.cpu.get_cpu_capability() != "AMX"


def blocked_rows(layouts_read: list[bool]) -> int:
    """The most rows a step may have for `blocked_linear`: 0 unless every packed matrix of whole
    64-column blocks is laid out as it reads (none are checked where it may not run)."""
    return BLOCKED_ROWS if layouts_read and all(layouts_read) else 0


def weight_form(module, dtype: torch.dtype) -> str:
    """How the kernels of `module` take the model's matrices in `dtype`: "panels" (the AVX2
    level's own packing, bf16 and float32: those CPUs have no bf16 products, and `at::linear`
    reads float32 at 0.4x the memory's pace for one row), "onednn" (bf16 where oneDNN has bf16
    kernels) or "plain" (float32 through `at::linear`)."""
    if module.LEVEL == "avx2":
        return "panels"
    return "onednn" if packs_weights(dtype) else "plain"


def native_unsupported_reason(model: CausalLM, kv: PagedKvCache) -> str | None:
    """Why the native kernels cannot run this model and cache, or None when they can."""
    c = model.config
    if kv.tensor.device.type != "cpu":
        return f"device {kv.tensor.device.type} (the native kernels are for CPUs)"
    if model.embed.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.embed.dtype} (float32 and bfloat16 are supported)"
    if kv.tensor.dtype != model.embed.dtype:
        return f"KV cache dtype {kv.tensor.dtype} differs from the model's"
    if c.head_dim % 32 or c.hidden_size % 16 or c.intermediate_size % 16:
        return "head_dim must be a multiple of 32, hidden and intermediate sizes of 16"
    if c.head_dim > 256:  # the AVX-512 attention kernels read heads of up to 16 chunks of 16
        return f"head_dim {c.head_dim} (the native attention runs heads of up to 256)"
    if c.moe is not None and c.moe.expert_intermediate_size % 16:
        return "a mixture's expert intermediate size must be a multiple of 16"
    return None


def build_native(model: CausalLM, kv: PagedKvCache, kernels: str, cache_dir: str | None) -> "NativeForward | None":
    """The native forward for `kernels` (KERNEL_CHOICES); None means the torch path.

    `auto` falls back to torch ops quietly where no kernels run (the reason is logged); any other
    choice but `torch` raises ConfigError where its kernels cannot run."""
    if kernels not in KERNEL_CHOICES:
        raise ConfigError("kernels", kernels, f"supported: {', '.join(KERNEL_CHOICES)}")
    if kernels == "torch":
        return None
    reason = native_unsupported_reason(model, kv)
    if reason is not None:
        if kernels != "auto":
            raise ConfigError("kernels", kernels, reason)
        return None
    try:
        module = load_native(kernels, cache_dir)
    except KernelsUnavailable as exc:
        raise ConfigError("kernels", kernels, str(exc)) from None
    return None if module is None else NativeForward(model, module)


def layer_spec(layer: DecoderLayer, matrices: list[torch.Tensor]) -> tuple:
    """A layer as `NativeModel` takes it (native/layer.h): its weight slots in the order the
    layer reads them (None where absent), its window, its rope's index and its activation."""
    qkv, o_proj, gate_up, down = matrices  # a mixture's layer: no dense gate_up and down (moe_spec)
    mlp = layer.mlp.experts[0] if isinstance(layer.mlp, MoeMLP) else layer.mlp
    slots = [layer.input_norm.weight, qkv, layer.qkv_bias, _weight(layer.q_norm), _weight(layer.k_norm), o_proj,
             layer.o_bias, _weight(layer.attn_out_norm), layer.post_norm.weight, gate_up, mlp.gate_up_bias,
             down, mlp.down_bias, _weight(layer.mlp_out_norm)]
    return slots, layer.window, layer.rope, mlp.activation


def moe_spec(mlp: MoeMLP, matrix) -> tuple:
    """A mixture as `NativeModel` takes it (native/moe.h), its matrices made by `matrix`."""
    return (matrix(mlp.router), [matrix(e.gate_up) for e in mlp.experts], [matrix(e.down) for e in mlp.experts],
            mlp.top_k, mlp.normalize_top_k, mlp.weights_in_float32)


def rope_spec(rope: RotaryEmbedding) -> tuple:
    """A rope variant as `NativeModel` takes it (native/rope.h)."""
    return rope.inv_freq, rope.long_inv_freq, rope.long_from, rope.attention_factor


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


class NativeForward:
    """Runs every step of `model` in one native call. Where the kernels take bf16 matrices
    packed (oneDNN's layout or panels), they are packed here and the model's plain copies
    dropped, so the model's own torch forward no longer runs."""

    def __init__(self, model: CausalLM, module) -> None:
        c = model.config
        self.level: str = module.LEVEL
        self._module = module
        form = weight_form(module, model.embed.dtype)
        checks_layout = form == "onednn" and blocked_kernel_may_run()
        layouts_read: list[bool] = []  # per packed matrix: laid out as `blocked_linear` reads it

        def matrix(weight: torch.Tensor) -> torch.Tensor:
            if form == "panels":
                return module.to_panels(weight)
            if form == "plain":
                return weight
            packed_weight = pack(weight)
            if checks_layout and weight.shape[0] % BLOCK_COLUMNS == 0 and weight.shape[1] % 2 == 0:
                layouts_read.append(module.blocked_layout(packed_weight, weight))
            return packed_weight

        matrices, mixtures = [], []
        for layer in model.layers:
            mixture = layer.mlp if isinstance(layer.mlp, MoeMLP) else None
            plain = [layer.qkv, layer.o_proj] + ([None, None] if mixture else [layer.mlp.gate_up, layer.mlp.down])
            matrices.append([None if w is None else matrix(w) for w in plain])
            mixtures.append(None if mixture is None else moe_spec(mixture, matrix))
            experts = [w for e in mixture.experts for w in (e.gate_up, e.down)] if mixture else []
            if form != "plain":  # a plain copy of its own (cast, dequantized) is freed here, a file map's pages given back
                release_copied_pages(plain + experts)
                layer.drop_matrices()
        lm_head = matrix(model.lm_head)
        self._lm_head = lm_head  # the kernels' own (packed) copy, shared: for `lm_head_logits`
        self._vocab_size = c.vocab_size
        if form != "plain":
            if model.lm_head is not model.embed:
                release_copied_pages([model.lm_head])
            model.drop_matrices()
        self._model = module.NativeModel(
            embed=model.embed, final_norm=model.norm.weight, lm_head=lm_head,
            layers=[layer_spec(layer, m) for layer, m in zip(model.layers, matrices, strict=True)],
            ropes=[rope_spec(rope) for rope in model.ropes], num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, eps=c.rms_norm_eps, attention_scale=c.attention_scale,
            embed_scale=model.embed_scale, packed=form == "onednn", blocked_rows=blocked_rows(layouts_read),
            moe=mixtures)
        self._threads: torch.Tensor | None = None  # the count a step follows, kept alive here

    def lora_weights(self, layers: tuple[AdapterLayer, ...]) -> object:
        """An adapter's pairs as the kernels hold them (made once, when the adapter loads)."""
        return self._module.LoraWeights([[None if pair is None else list(pair) for pair in layer] for layer in layers])

    def follow_threads(self, count) -> None:
        """Start each layer of a step on `count[0]` torch threads (a writable buffer of one int32
        that another thread may raise mid-step; `worker/cpu/core_share.py`)."""
        self._threads = torch.frombuffer(count, dtype=torch.int32)
        self._model.follow_threads(self._threads)

    def linear_op(self, weight: torch.Tensor):
        """x (R, K) -> x . weight^T + bias: on the kernels' panels where this level multiplies the
        model's matrices in them (AVX2), else torch's product (see `ModelRunner.linear_op`)."""
        if weight_form(self._module, weight.dtype) != "panels":
            return lambda x, bias=None: torch.nn.functional.linear(x, weight, bias)
        panels, columns = self._module.to_panels(weight), weight.shape[0]
        return lambda x, bias=None: self._model.linear(x, panels, bias, None, columns)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (R, H) -> float32 logits (R, vocab) through the LM head as the kernels hold it."""
        return self._model.linear(hidden, self._lm_head, None, None, self._vocab_size).float()

    def forward(self, batch: ForwardBatch, kv: PagedKvCache, logit_rows: list[int], lora: LoraStep = NO_LORA,
                capture: HiddenCapture | None = None) -> tuple[torch.Tensor, HiddenStates | None]:
        """float32 logits (len(logit_rows), vocab) of the step's flattened rows `logit_rows`, and
        the hidden states `capture` asks for (None without it); `lora` adds each adapter's deltas
        to its own rows."""
        chunks = batch.chunks
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        segments, first = [], 0
        for chunk in chunks:
            segments.append((first, len(chunk.token_ids), chunk.start_pos, int(chunk.is_prompt)))
            first += len(chunk.token_ids)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor([c.block_table + (0,) * (width - len(c.block_table)) for c in chunks],
                              dtype=torch.int32)  # (S, width), padding never read
        groups = [(rows, adapter.kernel_weights) for adapter, rows in lora.groups]
        args = (token_ids, torch.tensor(segments, dtype=torch.int32), tables,
                torch.tensor(logit_rows, dtype=torch.int64), kv.tensor, groups)
        if capture is None:
            return self._model.forward(*args), None
        logits, final, layers = self._model.forward_hidden(*args, list(capture.layers), capture.final)
        return logits, HiddenStates(final, layers)
