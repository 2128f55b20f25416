"""LoRA adapters on the decoder's fused projections, applied grouped by adapter per step.

A step's tokens may belong to the base model and to several adapters at once. Once per step,
`LoraAdapters.plan` groups the rows by adapter; every projection of every layer then adds,
for each adapter present,

    y[rows] += (x[rows] @ A.T) @ B.T        (index_select, two matmuls, index_add)

so the cost is a few small matmuls per adapter in the batch, never a Python loop over requests.
An adapter's q/k/v pairs are fused like the base weights (A stacked, B block-diagonal), and
so are gate/up: the four fused projections each take one pair per adapter.

On the native CPU kernels the same deltas are added in C++ after each projection
(`native/lora.h`), from a copy of every adapter's pairs made when it loads (`kernel_weights`).

All loaded adapters stay on the model's device; `max_loras` bounds how many are loaded at
once, so it also bounds the adapters in one batch (vLLM's meaning of the flag).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.engine.loading.lora_files import TARGET_MODULES, LoraCheckpoint
from pdserve.engine.loading.model_config import ModelConfig

QKV, O_PROJ, GATE_UP, DOWN = range(4)  # the decoder's fused projections, in `AdapterLayer` order
_FUSED = {QKV: ("q_proj", "k_proj", "v_proj"), O_PROJ: ("o_proj",), GATE_UP: ("gate_proj", "up_proj"),
          DOWN: ("down_proj",)}
Pair = tuple[torch.Tensor, torch.Tensor]  # (A (r, in), B (out, r))
AdapterLayer = tuple[Pair | None, Pair | None, Pair | None, Pair | None]


@dataclass(frozen=True, slots=True)
class LoraSettings:
    max_loras: int = 1
    max_lora_rank: int = 16


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    lora_id: int
    rank: int
    layers: tuple[AdapterLayer, ...]
    kernel_weights: object = None  # the same pairs as the native kernels hold them (None: torch path only)


KernelWeights = Callable[[tuple[AdapterLayer, ...]], object]  # an adapter's layers -> the native kernels' copy


class LoraStep:
    """One step's rows grouped by adapter; `add` puts each group's low-rank delta into `y`."""

    __slots__ = ("groups",)

    def __init__(self, groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]) -> None:
        self.groups = groups  # (adapter, its rows (R,), or None when it has every row)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: int) -> torch.Tensor:
        """y (T, out) += the adapters' deltas of x (T, in), in place; returns y."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer][projection]
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y.addmm_(F.linear(x, a), b.t())  # (T, r) @ (r, out)
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))  # (R, out)
        return y


NO_LORA = LoraStep(())  # a step without adapter rows: every `add` returns y as it was


class LoraAdapters:
    """The adapters loaded on one model, by id; at most `settings.max_loras` of them."""

    def __init__(self, config: ModelConfig, settings: LoraSettings, dtype: torch.dtype, device: torch.device,
                 kernel_weights: KernelWeights | None = None) -> None:
        if settings.max_loras < 1 or settings.max_lora_rank < 1:
            raise ConfigError("max_loras", settings, "max_loras and max_lora_rank must be at least 1")
        self._config = config
        self.settings = settings
        self._dtype = dtype
        self._device = device
        self._kernel_weights = kernel_weights  # set where steps run on the native kernels
        self._adapters: dict[int, LoraAdapter] = {}


    @property
    def max_weights_bytes(self) -> int:
        """The most an adapter's weights file may hold: every projection of every layer at
        `max_lora_rank` in float32, and 1 MiB of header (a larger file is not read)."""
        c = self._config
        per_layer = sum(sum(projection_shape(c, name)) for name in TARGET_MODULES)
        return self.settings.max_lora_rank * per_layer * c.num_layers * 4 + (1 << 20)
    def __contains__(self, lora_id: object) -> bool:
        return lora_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def can_add(self, checkpoint: LoraCheckpoint) -> None:
        """ConfigError when `checkpoint` cannot be added (full, rank too high, shapes of another model)."""
        if checkpoint.lora_id not in self._adapters and len(self._adapters) >= self.settings.max_loras:
            raise ConfigError("max_loras", self.settings.max_loras,
                              f"{len(self._adapters)} adapters are loaded already; unload one first")
        if checkpoint.rank > self.settings.max_lora_rank:
            raise ConfigError("lora_path", checkpoint.path, f"rank {checkpoint.rank} exceeds --max-lora-rank "
                              f"{self.settings.max_lora_rank}")
        for (layer, name), module in checkpoint.modules.items():
            if layer >= self._config.num_layers:
                raise ConfigError("lora_path", checkpoint.path, f"layer {layer}: the model has "
                                  f"{self._config.num_layers} layers (an adapter of another model?)")
            if name in _FUSED[GATE_UP] + _FUSED[DOWN] and self._config.is_moe_layer(layer):
                raise ConfigError("lora_path", checkpoint.path, f"layer {layer} {name}: the layer's MLP is a mixture "
                                  "of experts, and experts are not LoRA targets (an adapter of another model?)")
            expected = projection_shape(self._config, name)
            if (module.b.shape[0], module.a.shape[1]) != expected:
                raise ConfigError("lora_path", checkpoint.path, f"layer {layer} {name}: shape "
                                  f"{(module.b.shape[0], module.a.shape[1])}, the model's is {expected} "
                                  "(an adapter of another model?)")

    def add(self, checkpoint: LoraCheckpoint) -> None:
        """Load the adapter onto the device; adding one already loaded changes nothing."""
        self.can_add(checkpoint)
        if checkpoint.lora_id in self._adapters:
            return
        layers = tuple(self._fuse_layer(checkpoint, i) for i in range(self._config.num_layers))
        native = self._kernel_weights(layers) if self._kernel_weights else None
        self._adapters[checkpoint.lora_id] = LoraAdapter(checkpoint.lora_id, checkpoint.rank, layers, native)

    def remove(self, lora_id: int) -> None:
        self._adapters.pop(lora_id, None)

    def plan(self, segments: list[tuple[int | None, int]]) -> LoraStep:
        """Group a step's rows by adapter: `segments` are its chunks in row order, each (adapter
        id or None for the base model, number of rows). InvalidRequestError, changing nothing,
        for an id that is not loaded."""
        rows: dict[int, list[int]] = {}
        first = 0
        for lora_id, num_rows in segments:
            if lora_id is not None:
                rows.setdefault(lora_id, []).extend(range(first, first + num_rows))
            first += num_rows
        groups = []
        for lora_id, its_rows in rows.items():
            adapter = self._adapters.get(lora_id)
            if adapter is None:
                raise InvalidRequestError(f"LoRA adapter {lora_id} is not loaded", "model")
            index = None if len(its_rows) == first else torch.tensor(its_rows, device=self._device)
            groups.append((adapter, index))
        return LoraStep(tuple(groups)) if groups else NO_LORA

    def _fuse_layer(self, checkpoint: LoraCheckpoint, layer: int) -> AdapterLayer:
        return tuple(self._fuse(checkpoint, layer, _FUSED[p]) for p in (QKV, O_PROJ, GATE_UP, DOWN))

    def _fuse(self, checkpoint: LoraCheckpoint, layer: int, names: tuple[str, ...]) -> Pair | None:
        """A stacked, B block-diagonal over the fused projection's outputs (zeros where the
        adapter leaves a projection alone); None when it touches none of them."""
        present = [(name, checkpoint.modules.get((layer, name))) for name in names]
        if all(module is None for _, module in present):
            return None
        widths = [projection_shape(self._config, name)[0] for name in names]
        total_rank = sum(m.rank for _, m in present if m is not None)
        a = torch.zeros(total_rank, projection_shape(self._config, names[0])[1])
        b = torch.zeros(sum(widths), total_rank)
        out, rank = 0, 0
        for (_, module), width in zip(present, widths):
            if module is not None:
                a[rank:rank + module.rank] = module.a
                b[out:out + width, rank:rank + module.rank] = module.b
                rank += module.rank
            out += width
        return self._place(a), self._place(b)

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self._device, dtype=self._dtype).contiguous()


def projection_shape(c: ModelConfig, name: str) -> tuple[int, int]:
    """(out, in) of projection `name` in the base model."""
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (q_width, c.hidden_size), "k_proj": (kv_width, c.hidden_size),
            "v_proj": (kv_width, c.hidden_size), "o_proj": (c.hidden_size, q_width),
            "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size)}[name]
