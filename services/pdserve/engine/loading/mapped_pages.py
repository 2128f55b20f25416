"""Give back the resident pages of checkpoint tensors read through a file map, once copied.

A safetensors checkpoint in the serving dtype is read as views of one private file map: every
page a copy reads (q|k|v fused, weights packed) stays resident, counted in the process's
memory, until the last tensor of the file is gone. `release_copied_pages` drops the pages of
tensors already copied (`madvise(MADV_DONTNEED)`), so loading never holds a checkpoint twice.
This changes no value: a clean page of a file map that is read again is read back from the
file. Only clean maps are touched: a map holding a page written since it was mapped (its
private copy would be lost) is left as it is, and so is memory that is not a file's.
"""
import ctypes
import functools
import mmap
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

MADV_DONTNEED = 4  # Linux


def release_copied_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Drop the whole pages inside the given CPU tensors from this process's memory where they
    lie in a clean file map; returns the bytes released (0 off Linux)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in tensors if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel()]
    if not spans or not sys.platform.startswith("linux"):
        return 0
    maps = _clean_file_maps()
    page, released = mmap.PAGESIZE, 0
    for start, end in spans:
        if not any(lo <= start and end <= hi for lo, hi in maps):
            continue
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
        if last > first and _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0:
            released += last - first
    return released


def _clean_file_maps() -> list[tuple[int, int]]:
    """Address ranges of this process's maps of regular files with no page written (smaps)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    maps, current = [], None
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):  # a map's header: range perms offset dev inode path
            is_file = len(head) == 6 and head[4] != "0" and head[5].startswith("/")
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            current = (lo, hi) if is_file else None
        elif current is not None and head[0] == "Private_Dirty:":
            if head[1] == "0":
                maps.append(current)
            current = None
    return maps


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
