"""Keep the C heap's freed memory for the next engine step.

A step allocates its activations afresh (a 2,048-token step of SmolLM2-135M: ~35 MB per layer)
and frees them by the layer's end. glibc's default policy hands memory of that size back to the
kernel and takes it again: chunks above a threshold that adapts to what was freed are mapped
and unmapped per call, and a heap whose free top grows past twice that threshold is trimmed.
Each time, the pages fault in again and are zeroed (huge pages too: `THP_MEM_ALLOC_ENABLE`).
The aggregated worker took ~113,000 page faults serving a burst of 64 prompts, ~7,500 with its
heap kept, and served the burst 3-14 % faster (benchmarks/README.md, "The C heap").

Fixed thresholds instead: chunks up to glibc's largest mapping threshold (32 MiB) come from the
heap, and a heap is trimmed only when 1 GiB of it lies free at its top. The worker sets them
once its model is loaded, so the loader's own garbage was already given back. The process then
holds its largest step's activations between steps (its peak, not more). Other allocators
(tcmalloc, jemalloc in LD_PRELOAD) are left to themselves: glibc's settings then govern nothing.
"""
import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 1 << 30
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_step_memory() -> str:
    """Fix the C heap's thresholds as above; a phrase on what was done, for the start-up log."""
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "C heap: as the environment sets it"
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl has no mallopt; macOS has none)
        mallopt = None
    if mallopt is None:
        return "C heap: the C library's defaults (no mallopt)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "C heap: the C library's defaults (mallopt refused)"
    return f"C heap kept between steps (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim at {TRIM_THRESHOLD >> 20} MiB)"
