"""Native CPU kernels: the whole decoder forward in one C++ call per step (every dense family).

What they replace, and why (profiled on a 2-core AVX-512 CPU, SmolLM2-135M in bf16): eager
torch spent most of a batch-1 decode step in oneDNN's matmuls, which reordered every weight
on every call, and in ~1,200 small ops; batched decode spent 40% in gathering every
sequence's KV blocks and in attention widened across KV heads. Here: weights packed once, at
load (oneDNN's blocked layout where oneDNN has bf16 kernels for the CPU, panels of our own on
AVX2), paged attention reading the KV blocks in place (grouped-query heads together, online
softmax), and fused RMSNorm (and q/k head norms), rotary + KV store and the gated MLP's
activation (SiLU or tanh GELU) times up.

The kernels are compiled when pdserve is installed (or its wheel built), once per ISA level
(`levels.py`): `_kernels_avx2`, `_kernels_avx512`, `_kernels_avx512_bf16`, `_kernels_amx`. A
worker imports the highest level this CPU has (its flags, and for AMX the OS lending the tile
state), logs the choice once and reports it as a metric label; no compiler is needed at run time.
`--kernels` may force a level; `jit` compiles them at start for this CPU instead (`jit.py`, a
developer's path).
"""
import ctypes
import importlib
import importlib.util
import logging
import platform
from functools import cache
from pathlib import Path
from types import ModuleType

from pdserve.common.settings import KERNEL_CHOICES
from pdserve.engine.model.native.levels import LEVELS, MODULE_PREFIX

log = logging.getLogger(__name__)

LEVEL_NAMES = tuple(LEVELS)  # lowest first; each also a choice of KERNEL_CHOICES
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64
_loaded: dict[tuple[str, str | None], ModuleType | None] = {}  # None: torch ops (logged once)


class KernelsUnavailable(RuntimeError):
    """The kernels asked for cannot run here; the message says why."""


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as Linux names them (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def amx_lent() -> bool:
    """Whether Linux lends this process AMX's tile state (it asks, as oneDNN does)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def levels_for(flags: frozenset[str], tiles_lent: bool) -> tuple[str, ...]:
    """The levels a CPU with `flags` runs, lowest first: each needs its own flags and those of
    every level below; AMX also needs the tile state lent (`tiles_lent`)."""
    found = []
    for level, (needs, _) in LEVELS.items():
        if not flags.issuperset(needs) or (level == "amx" and not tiles_lent):
            break
        found.append(level)
    return tuple(found)


@cache
def cpu_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first."""
    flags = cpu_flags()
    return levels_for(flags, "amx_tile" in flags and amx_lent())


def installed_levels() -> tuple[str, ...]:
    """The levels this CPU runs whose prebuilt kernels are installed, lowest first."""
    return tuple(level for level in cpu_levels()
                 if importlib.util.find_spec(f"{__name__}.{MODULE_PREFIX}{level}") is not None)


def load_level(level: str) -> ModuleType:
    """The prebuilt kernels of `level`; KernelsUnavailable where the CPU lacks it or this
    install has no build of it."""
    if level not in LEVELS:
        raise KernelsUnavailable(f"no ISA level {level!r} (levels: {', '.join(LEVEL_NAMES)})")
    if level not in cpu_levels():
        missing = sorted(set(LEVELS[level][0]) - cpu_flags())
        why = f"lacks {', '.join(missing)}" if missing else "does not lend this process its AMX tile state"
        raise KernelsUnavailable(f"this CPU {why}, so it cannot run the {level} kernels")
    import torch  # noqa: F401  (the kernels link against torch's libraries, loaded with it)
    name = f"{__name__}.{MODULE_PREFIX}{level}"
    if importlib.util.find_spec(name) is None:
        raise KernelsUnavailable(f"this install has no {level} kernels (pdserve was installed without compiling "
                                 "them: install it from a wheel built with a C++ compiler, or run --kernels jit)")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise KernelsUnavailable(f"the {level} kernels failed to load: {exc}") from exc


def load_native(choice: str = "auto", cache_dir: str | None = None) -> ModuleType | None:
    """The kernels `choice` names, logged once per process.

    auto: the highest level this CPU has whose build is installed (a missing build is logged
    and the next level down taken), None where there is none (torch ops); native: the same, but
    KernelsUnavailable where there is none; a level's name: that level or KernelsUnavailable;
    jit: compiled here for this CPU (`jit.py`); torch: None."""
    if choice not in KERNEL_CHOICES:
        raise KernelsUnavailable(f"no kernels {choice!r} (choices: {', '.join(KERNEL_CHOICES)})")
    if choice == "torch":
        return None
    key = (choice, cache_dir if choice == "jit" else None)
    if key not in _loaded:
        module = _load(choice, cache_dir)
        _loaded[key] = module
        if module is None:
            return None
        log.info("native CPU kernels: %s (%s); this CPU runs %s", module.LEVEL,
                 "compiled here" if choice == "jit" else "prebuilt", ", ".join(cpu_levels()) or "none of the levels")
    return _loaded[key]


def _load(choice: str, cache_dir: str | None) -> ModuleType | None:
    if choice == "jit":
        from pdserve.engine.model.native.jit import JitBuildError, load_jit
        try:
            return load_jit(cache_dir)
        except JitBuildError as exc:
            raise KernelsUnavailable(f"the just-in-time build failed: {exc}") from exc
    if choice in LEVELS:
        return load_level(choice)
    reasons = []
    for level in reversed(cpu_levels()):
        try:
            return load_level(level)
        except KernelsUnavailable as exc:
            log.warning("native CPU kernels: %s", exc)
            reasons.append(str(exc))
    why = reasons[-1] if reasons else "this CPU has none of the ISA levels they are built for " \
                                      f"({', '.join(LEVEL_NAMES)}; AVX2 with FMA and F16C at least)"
    if choice == "native":
        raise KernelsUnavailable(why)
    log.warning("native CPU kernels unavailable, using torch ops: %s", why)
    return None
