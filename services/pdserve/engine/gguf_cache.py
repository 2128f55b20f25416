"""A GGUF file's conversion kept on disk: its HF config and its tensors in the serving dtype.

One entry is one safetensors file, `<key>.<dtype>.safetensors`, whose header metadata also
holds the HF config, so an entry is written (and replaced) in a single atomic rename. The
key covers the GGUF file's path, size and mtime and `CONVERTER_VERSION`.

An entry that cannot be read back whole (truncated, header garbled, wrong dtype or tensor
count) counts as absent: the caller converts again and overwrites it. Tensor bytes carry no
checksum; a flipped bit inside the data is not detected.
"""
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pdserve.common.conversion_cache import cache_key, write_file_atomically

CONVERTER_VERSION = 1  # bump when the conversion's output changes, to invalidate old entries
_log = logging.getLogger(__name__)


def entry_path(gguf_path: str, dtype: torch.dtype, cache_dir: str) -> Path:
    dtype_name = str(dtype).removeprefix("torch.")
    return Path(cache_dir) / f"{cache_key(gguf_path, 'weights', CONVERTER_VERSION, dtype_name)}.{dtype_name}.safetensors"


def read_entry(gguf_path: str, dtype: torch.dtype,
               cache_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The cached (HF config, tensors) of `gguf_path` in `dtype`, or None when there is no
    valid entry."""
    path = entry_path(gguf_path, dtype, cache_dir)
    if not path.is_file():
        return None
    try:
        return _read(path, dtype)
    except (OSError, SafetensorError, ValueError, KeyError) as err:  # ValueError covers bad JSON
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
    with safe_open(str(path), framework="pt") as entry:
        metadata = entry.metadata() or {}
        if metadata.get("dtype") != str(dtype):
            raise ValueError(f"entry holds {metadata.get('dtype')}, not {dtype}")
        names = list(entry.keys())
        if str(len(names)) != metadata.get("num_tensors"):
            raise ValueError(f"entry holds {len(names)} tensors, its header says {metadata.get('num_tensors')}")
        config = json.loads(metadata["config"])
        tensors = {name: entry.get_tensor(name) for name in names}
    wrong = [name for name, tensor in tensors.items() if tensor.dtype != dtype]
    if wrong:
        raise ValueError(f"tensors {wrong[:3]} are not {dtype}")
    return config, tensors
