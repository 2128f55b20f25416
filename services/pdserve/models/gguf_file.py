"""A GGUF file's header, metadata and tensor directory, parsed with `struct` over an `mmap`.

`gguf.GGUFReader` wraps every metadata value, down to each character count of a 49k-entry
vocabulary, in its own numpy view: 2-5 s per open of SmolLM2. This reader builds plain Python
values instead (about 0.05 s) and leaves tensor bytes in place: `GgufFile.data`
returns a zero-copy view of one tensor's bytes. Torch- and numpy-free, so the router can
read a tokenizer with it. Little-endian GGUF versions 2 and 3.

File layout (all little-endian):
    | magic "GGUF" | version u32 | n_tensors u64 | n_kv u64 | n_kv × (key, type u32, value) |
    | n_tensors × (name, n_dims u32, dims u64[n_dims], ggml type u32, offset u64) |
    | padding to `alignment` | tensor data (each tensor at data_offset + its offset) |
"""
import enum
import mmap
import struct
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import ConfigError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class GgufValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS = {
    GgufValueType.UINT8: "B", GgufValueType.INT8: "b", GgufValueType.UINT16: "H", GgufValueType.INT16: "h",
    GgufValueType.UINT32: "I", GgufValueType.INT32: "i", GgufValueType.FLOAT32: "f", GgufValueType.BOOL: "?",
    GgufValueType.UINT64: "Q", GgufValueType.INT64: "q", GgufValueType.FLOAT64: "d",
}


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] varies fastest (the numpy shape is reversed)
    ggml_type: int  # a `gguf.GGMLQuantizationType` value
    offset: int  # absolute position of the first byte in the file


@dataclass(frozen=True, slots=True)
class GgufFile:
    """One parsed GGUF file. Its map is released once this object and every view of it are gone.

    The map is private (copy-on-write), so torch and numpy take views of it without a copy or
    a read-only warning; nothing written to a view ever reaches the file.
    """

    path: str
    version: int
    metadata: dict[str, Any]  # key → str | int | float | bool | list (arrays, nested as lists)
    value_types: dict[str, GgufValueType]  # key → the type the file stores it as
    tensors: tuple[GgufTensorInfo, ...]  # in file order
    alignment: int
    data_offset: int  # where the tensor data section starts
    buffer: mmap.mmap

    def data(self, tensor: GgufTensorInfo, num_bytes: int) -> memoryview:
        """The `num_bytes` bytes of `tensor`, without a copy. ConfigError if they run past the file."""
        end = tensor.offset + num_bytes
        if end > len(self.buffer):
            raise ConfigError("model", self.path, f"tensor {tensor.name!r} ends at byte {end}, past the file's end")
        return memoryview(self.buffer)[tensor.offset:end]


def read_gguf(path: str) -> GgufFile:
    """Parse `path`'s header, metadata and tensor directory. ConfigError (naming the file) for a
    file that is not a supported GGUF file or is cut short."""
    with open(path, "rb") as f:
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:  # an empty file cannot be mapped
            raise ConfigError("model", path, "empty file, not a GGUF file") from None
    try:
        return _parse(path, buffer)
    except ConfigError:
        buffer.close()
        raise
    except (struct.error, UnicodeDecodeError, ValueError) as err:  # ValueError: an unknown value type
        buffer.close()
        raise ConfigError("model", path, f"malformed GGUF file: {err}") from None


def _parse(path: str, buffer: mmap.mmap) -> GgufFile:
    cursor = _Cursor(buffer)
    if cursor.take(4) != GGUF_MAGIC:
        raise ConfigError("model", path, "not a GGUF file (bad magic bytes)")
    version = cursor.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        reason = "a big-endian GGUF file" if version & 0xFFFF == 0 else f"GGUF version {version}"
        raise ConfigError("model", path, f"{reason} is not supported (little-endian versions 2 and 3 are)")
    num_tensors, num_kv = cursor.scalar("Q"), cursor.scalar("Q")
    metadata, value_types = {}, {}
    for _ in range(num_kv):
        key = cursor.string()
        value_type = GgufValueType(cursor.scalar("I"))
        if key in metadata:
            raise ConfigError("model", path, f"metadata key {key!r} appears twice")
        metadata[key], value_types[key] = cursor.value(value_type), value_type
    directory = [_tensor_entry(cursor) for _ in range(num_tensors)]
    alignment = _alignment(path, metadata, value_types)
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors = tuple(GgufTensorInfo(name, dims, kind, data_offset + offset) for name, dims, kind, offset in directory)
    if len({t.name for t in tensors}) != len(tensors):
        raise ConfigError("model", path, "a tensor name appears twice")
    return GgufFile(path, version, metadata, value_types, tensors, alignment, data_offset, buffer)


def _tensor_entry(cursor: "_Cursor") -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    num_dims = cursor.scalar("I")
    dims = cursor.array_of("Q", num_dims)
    return name, tuple(dims), cursor.scalar("I"), cursor.scalar("Q")


def _alignment(path: str, metadata: dict[str, Any], value_types: dict[str, GgufValueType]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    alignment = metadata["general.alignment"]
    if value_types["general.alignment"] != GgufValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
        raise ConfigError("general.alignment", alignment, f"in {path}: must be a uint32 power of two")
    return alignment


class _Cursor:
    """Reads little-endian values from `buffer`, advancing `offset`; struct.error past the end."""

    __slots__ = ("buffer", "offset")

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def take(self, num_bytes: int) -> bytes:
        end = self.offset + num_bytes
        if end > len(self.buffer):
            raise struct.error(f"{num_bytes} bytes wanted at offset {self.offset}, past the end")
        chunk = self.buffer[self.offset:end]
        self.offset = end
        return chunk

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def array_of(self, fmt: str, count: int) -> list[Any]:
        values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
        self.offset += struct.calcsize(fmt) * count
        return list(values)

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings; the vocabulary's hot loop, so it avoids a call per string."""
        buffer, offset, unpack_length = self.buffer, self.offset, struct.Struct("<Q").unpack_from
        values = []
        for _ in range(count):
            (length,) = unpack_length(buffer, offset)
            end = offset + 8 + length
            if end > len(buffer):
                raise struct.error(f"string at offset {offset} runs past the end")
            values.append(buffer[offset + 8:end].decode("utf-8"))
            offset = end
        self.offset = offset
        return values

    def value(self, value_type: GgufValueType) -> Any:
        if value_type == GgufValueType.STRING:
            return self.string()
        if value_type == GgufValueType.ARRAY:
            item_type, count = GgufValueType(self.scalar("I")), self.scalar("Q")
            if item_type in _SCALAR_FORMATS:
                return self.array_of(_SCALAR_FORMATS[item_type], count)
            if item_type == GgufValueType.STRING:
                return self.strings(count)
            if count > len(self.buffer) - self.offset:  # each item takes at least one byte
                raise struct.error(f"array of {count} items at offset {self.offset} runs past the end")
            return [self.value(item_type) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[value_type])
