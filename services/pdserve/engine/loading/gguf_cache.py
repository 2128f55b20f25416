"""A GGUF file's conversion kept on disk: its HF config and its tensors in the serving dtype.

One entry is one safetensors file, `<key>.<dtype>.safetensors`, whose header metadata also
holds the HF config, so an entry is written (and replaced) in a single atomic rename. The
key covers the GGUF file's path, size and mtime and `CONVERTER_VERSION`. `safetensors`
writes it; it is read back here with plain reads (see `_read` for why not a map).

An entry that cannot be read back whole (truncated, header garbled, wrong dtype or tensor
count) counts as absent: the caller converts again and overwrites it. Tensor bytes carry no
checksum; a flipped bit inside the data is not detected.
"""
import json
import logging
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from pdserve.models.conversion_cache import cache_key, write_file_atomically

CONVERTER_VERSION = 1  # bump when the conversion's output changes, to invalidate old entries
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_log = logging.getLogger(__name__)


def entry_path(gguf_path: str, dtype: torch.dtype, cache_dir: str) -> Path:
    """Where the conversion of `gguf_path` to `dtype` is kept (whether or not it exists)."""
    dtype_name = str(dtype).removeprefix("torch.")
    key = cache_key(gguf_path, "weights", CONVERTER_VERSION, dtype_name)
    return Path(cache_dir) / f"{key}.{dtype_name}.safetensors"


def read_entry(gguf_path: str, dtype: torch.dtype,
               cache_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The cached (HF config, tensors) of `gguf_path` in `dtype`, or None when there is no
    valid entry."""
    path = entry_path(gguf_path, dtype, cache_dir)
    if not path.is_file():
        return None
    try:
        return _read(path, dtype)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:  # ValueError covers bad JSON
        _log.warning("ignoring damaged cache entry %s (%s); converting again", path, err)
        return None


def write_entry(gguf_path: str, dtype: torch.dtype, cache_dir: str,
                config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Store a conversion. Failing to write (disk full, no permission) is logged, not raised:
    the conversion in hand is still good."""
    path = entry_path(gguf_path, dtype, cache_dir)
    metadata = {"format": "pt", "config": json.dumps(config), "dtype": str(dtype), "num_tensors": str(len(tensors))}
    try:
        write_file_atomically(path, lambda scratch: save_file(tensors, str(scratch), metadata=metadata))
    except (OSError, SafetensorError) as err:
        _log.warning("could not cache the converted model at %s: %s", path, err)
        return
    _log.info("cached the converted model at %s", path)


def _read(path: Path, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The entry's config and tensors, read (not mapped) into fresh tensors: a mapped entry
    would keep every page of the file resident for as long as any one tensor lived, including
    those of weights the model has already copied into fused matrices.

    Layout: | header length u64 | JSON header {name: {dtype, shape, data_offsets}, __metadata__} | data |
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        metadata = header.pop("__metadata__", {})
        if metadata.get("dtype") != str(dtype) or metadata.get("num_tensors") != str(len(header)):
            raise ValueError(f"header says dtype {metadata.get('dtype')} and {metadata.get('num_tensors')} tensors, "
                             f"wanted {dtype} and found {len(header)}")
        tensors = {name: _read_tensor(f, 8 + header_len, entry, dtype) for name, entry in header.items()}
        if f.read(1):
            raise ValueError("bytes after the last tensor")
    return json.loads(metadata["config"]), tensors


def _read_tensor(f: BinaryIO, data_start: int, entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    if _SAFETENSORS_DTYPES.get(entry["dtype"]) != dtype:
        raise ValueError(f"a tensor is {entry['dtype']}, not {dtype}")
    begin, end = entry["data_offsets"]
    tensor = torch.empty(entry["shape"], dtype=dtype)
    if tensor.numel() * tensor.element_size() != end - begin:
        raise ValueError(f"a tensor of shape {entry['shape']} spans {end - begin} bytes")
    f.seek(data_start + begin)
    if f.readinto(tensor.view(-1).view(torch.uint8).numpy()) != end - begin:
        raise ValueError("the file ends inside a tensor")
    return tensor
