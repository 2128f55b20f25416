"""Give back the resident pages of checkpoint tensors read through a file map, once copied.

A safetensors checkpoint in the serving dtype is read as views of one private file map: every
page a copy reads (q|k|v fused, weights packed) stays resident, counted in the process's
memory, until the last tensor of the file is gone. `release_copied_pages` drops the pages of
tensors already copied (`madvise(MADV_DONTNEED)`), so loading never holds a checkpoint twice.
This changes no value: a clean page of a file map that is read again is read back from the
file. Only clean pages are dropped: a tensor with a page written since it was mapped (its
private copy would be lost) or swapped out is left as it is, and so is memory that is not a
file's.
"""
import array
import ctypes
import functools
import mmap
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

MADV_DONTNEED = 4  # Linux


def release_copied_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Drop the whole pages inside the given CPU tensors from this process's memory where they
    lie in a file map and none of them was written; returns the bytes released (0 off Linux)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in tensors if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel()]
    if not spans or not sys.platform.startswith("linux"):
        return 0
    maps, page, released = _file_maps(), mmap.PAGESIZE, 0
    try:
        pagemap = open("/proc/self/pagemap", "rb")
    except OSError:
        return 0
    with pagemap:
        for start, end in spans:
            first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
            if last <= first or not any(lo <= start and end <= hi for lo, hi in maps):
                continue
            if _all_clean(pagemap, first // page, (last - first) // page) and _libc().madvise(
                    ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0:
                released += last - first
    return released


def _file_maps() -> list[tuple[int, int]]:
    """Address ranges of this process's maps of regular files (/proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    maps = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            maps.append((lo, hi))
    return maps


def _all_clean(pagemap: BinaryIO, first_page: int, num_pages: int) -> bool:
    """No page of the range is a private copy (a page written since it was mapped is anonymous
    memory) or swapped out (/proc/self/pagemap: bit 63 present, 62 swapped, 61 a file's page)."""
    pagemap.seek(first_page * 8)
    entries = array.array("Q", pagemap.read(num_pages * 8))
    return len(entries) == num_pages and not any(
        e >> 62 & 1 or (e >> 63 & 1 and not e >> 61 & 1) for e in entries)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
