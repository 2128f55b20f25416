"""What a peer's KV blocks look like, and the check that refuses a peer whose blocks differ.

Two workers may exchange KV blocks only when a block means the same thing on both sides:
same model weights, same storage dtype and scale, same shape per block, same byte layout.
Each worker describes its own KV tensor with a `KvLayoutSpec`, sends it to peers once inside
its transport metadata (`handshake.PeerMetadata`, as JSON), and `check_compatible` compares
the two before any byte moves.

The KV tensor is block-major, `(num_blocks, num_layers, 2, tokens_per_block, num_kv_heads,
head_dim)`, so one block of every layer is one contiguous range of `bytes_per_block` bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from pdserve.common.errors import ConfigError, IncompatiblePeerError
from pdserve.kvcache.windows import SlidingWindows

if TYPE_CHECKING:
    import torch

BLOCK_MAJOR_V1 = "block-major-v1"
PROTOCOL_VERSION = 1

DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
"""Storage dtypes a KV tensor may have, by torch name, with their size in bytes."""


@dataclass(frozen=True, slots=True)
class KvLayoutSpec:
    """One worker's KV block format. Equal specs mean blocks can be copied byte for byte.

    `model` names the weights (a name or a content fingerprint); `kv_scale` is the per-tensor
    scale of a float8 cache (1.0 otherwise), since bytes stored under different scales decode
    to different values. `layer_windows` is each layer's sliding window (None: global), kept
    empty when no layer has one: both sides derive from it which slices of a block a hand-off
    leaves behind (`kvcache/windows.py`), so they must agree on it.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    kv_scale: float = 1.0
    layer_windows: tuple[int | None, ...] = ()
    layout: str = BLOCK_MAJOR_V1
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "must name the model or its fingerprint")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError("dtype", self.dtype, f"supported: {', '.join(DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be a positive integer")
        if isinstance(self.kv_scale, bool) or not isinstance(self.kv_scale, (int, float)) \
                or not self.kv_scale > 0:
            raise ConfigError("kv_scale", self.kv_scale, "must be positive")
        if not isinstance(self.layer_windows, tuple) or len(self.layer_windows) not in (0, self.num_layers) \
                or not all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w > 0)
                           for w in self.layer_windows):
            raise ConfigError("layer_windows", self.layer_windows,
                              "must be empty or one positive window (or None) per layer")
        if all(w is None for w in self.layer_windows):
            object.__setattr__(self, "layer_windows", ())  # no windows: one spelling, as a peer told none

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: (num_layers, 2, tokens_per_block, num_kv_heads, head_dim)."""
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def windows(self) -> SlidingWindows:
        """The layers' sliding windows, as a hand-off reads them (`kvcache/windows.py`)."""
        return SlidingWindows(self.layer_windows, self.tokens_per_block)

    @property
    def bytes_per_layer(self) -> int:
        """Bytes of one layer's K and V in a block: a contiguous slice of it."""
        return self.bytes_per_block // self.num_layers

    @property
    def bytes_per_block(self) -> int:
        elements = self.num_layers * 2 * self.tokens_per_block * self.num_kv_heads * self.head_dim
        return elements * DTYPE_SIZES[self.dtype]

    @classmethod
    def for_tensor(cls, model: str, kv: torch.Tensor, kv_scale: float = 1.0,
                   layer_windows: tuple[int | None, ...] = ()) -> KvLayoutSpec:
        """The spec of a block-major KV tensor `(N, L, 2, tpb, kvh, hd)`."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ConfigError("kv_tensor.shape", tuple(kv.shape), "expected (N, L, 2, tpb, kvh, hd)")
        _, num_layers, _, tokens_per_block, num_kv_heads, head_dim = kv.shape
        return cls(model, dtype_name(kv), num_layers, num_kv_heads, head_dim, tokens_per_block, kv_scale,
                   layer_windows)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "bytes_per_block": self.bytes_per_block}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KvLayoutSpec:
        """Inverse of `to_dict`. A missing field or a spec that does not validate is refused."""
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in data]
        if missing:
            raise IncompatiblePeerError(f"peer layout spec lacks fields: {', '.join(missing)}")
        values = {name: data[name] for name in names}
        if isinstance(values["layer_windows"], list):  # JSON has no tuples
            values["layer_windows"] = tuple(values["layer_windows"])
        try:
            spec = cls(**values)
        except ConfigError as error:
            raise IncompatiblePeerError(f"peer layout spec is invalid: {error}") from error
        if data.get("bytes_per_block") != spec.bytes_per_block:
            raise IncompatiblePeerError(
                f"peer layout spec says bytes_per_block={data.get('bytes_per_block')!r} "
                f"but its fields give {spec.bytes_per_block}")
        return spec


def dtype_name(kv: torch.Tensor) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(kv.dtype).removeprefix("torch.")


def check_compatible(local: KvLayoutSpec, remote: KvLayoutSpec, peer: str = "peer") -> None:
    """Raise IncompatiblePeerError naming every field where `remote` differs from `local`.

    Every field of the spec is compared, `bytes_per_block` included, in declaration order.
    """
    local_fields, remote_fields = local.to_dict(), remote.to_dict()
    mismatches = [f"{name}: local={value!r} remote={remote_fields[name]!r}"
                  for name, value in local_fields.items() if remote_fields[name] != value]
    if mismatches:
        raise IncompatiblePeerError(f"{peer} has an incompatible KV layout; " + "; ".join(mismatches))
