"""The metadata a worker sends each peer once (over gRPC) so the peer can move its KV blocks.

Wire format, versioned by `layout.PROTOCOL_VERSION` inside the header:

    | b"PDKV" | header length (u32, big-endian) | header (JSON) | transport blob (raw bytes) |

The header names the worker, its layout spec and where its registered KV tensor lives; the
blob is opaque to everyone but the transport that made it (NIXL agent metadata).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.errors import IncompatiblePeerError
from pdserve.common.ids import WorkerId
from pdserve.transfer.layout import KvLayoutSpec

if TYPE_CHECKING:
    import torch

MAGIC = b"PDKV"
_LENGTH = struct.Struct(">I")
_HEADER_FIELDS = ("worker_id", "spec", "num_blocks", "base_addr", "mem_type", "device_id")
MEM_TYPES = ("DRAM", "VRAM")
"""Where a KV tensor lives: host memory, or a GPU's memory (NIXL's names)."""


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    """Everything a peer needs to address this worker's KV blocks.

    Block `i` of the worker is the byte range
    `[base_addr + i * spec.bytes_per_block, base_addr + (i + 1) * spec.bytes_per_block)`
    of memory `mem_type` on device `device_id`, for `0 <= i < num_blocks`.
    """

    worker_id: WorkerId
    spec: KvLayoutSpec
    num_blocks: int
    base_addr: int
    mem_type: str
    device_id: int
    transport_blob: bytes

    def encode(self) -> bytes:
        header = json.dumps({
            "worker_id": self.worker_id,
            "spec": self.spec.to_dict(),
            "num_blocks": self.num_blocks,
            "base_addr": self.base_addr,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }, sort_keys=True).encode()
        return MAGIC + _LENGTH.pack(len(header)) + header + self.transport_blob

    @staticmethod
    def mem_type_of(kv: torch.Tensor) -> str:
        return "DRAM" if kv.device.type == "cpu" else "VRAM"

    @classmethod
    def decode(cls, raw: bytes) -> PeerMetadata:
        """Inverse of `encode`; anything malformed raises IncompatiblePeerError."""
        header, blob = _split(raw)
        missing = [name for name in _HEADER_FIELDS if name not in header]
        if missing:
            raise IncompatiblePeerError(f"peer metadata lacks fields: {', '.join(missing)}")
        if not isinstance(header["spec"], dict):
            raise IncompatiblePeerError(f"peer metadata spec is not an object: {header['spec']!r}")
        for name in ("num_blocks", "base_addr", "device_id"):
            value = header[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise IncompatiblePeerError(f"peer metadata {name}={value!r}: not a non-negative integer")
        if header["mem_type"] not in MEM_TYPES:
            raise IncompatiblePeerError(f"peer metadata mem_type={header['mem_type']!r}: not one of {MEM_TYPES}")
        if header["num_blocks"] < 1:
            raise IncompatiblePeerError(f"peer metadata num_blocks={header['num_blocks']}: no blocks")
        return cls(WorkerId(str(header["worker_id"])), KvLayoutSpec.from_dict(header["spec"]),
                   header["num_blocks"], header["base_addr"], header["mem_type"],
                   header["device_id"], blob)


def _split(raw: bytes) -> tuple[dict[str, object], bytes]:
    """(header, blob) of an encoded PeerMetadata."""
    prefix = len(MAGIC) + _LENGTH.size
    if len(raw) < prefix or not raw.startswith(MAGIC):
        raise IncompatiblePeerError(f"peer metadata does not start with {MAGIC!r}")
    (length,) = _LENGTH.unpack_from(raw, len(MAGIC))
    if len(raw) < prefix + length:
        raise IncompatiblePeerError(f"peer metadata is truncated: header of {length} bytes announced, "
                                    f"{len(raw) - prefix} present")
    try:
        header = json.loads(raw[prefix:prefix + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IncompatiblePeerError(f"peer metadata header is not JSON: {error}") from error
    if not isinstance(header, dict):
        raise IncompatiblePeerError(f"peer metadata header is not an object: {header!r}")
    return header, raw[prefix + length:]
