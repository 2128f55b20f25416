"""Native CPU kernels: the whole Llama-family forward in one C++ call per step.

What they replace, and why (profiled on a 2-core AVX-512 CPU, SmolLM2-135M in bf16): eager
torch spent most of a batch-1 decode step in oneDNN's matmuls, which reordered every weight
on every call, and in ~1,200 small ops; batched decode spent 40% in gathering every
sequence's KV blocks and in attention widened across KV heads. Here: bf16 weights packed once,
at load, into oneDNN's blocked layout (no reorder per call, one copy of the weights), paged
attention reading the KV blocks in place (grouped-query heads together, online softmax), and
fused RMSNorm, rotary + KV store and SiLU-and-mul.

The extension is compiled on first use for the CPU it runs on (`-march=native`) and cached
under `<cache_dir>/kernels/<key>`; the key covers the sources, torch's version and the CPU's
flags, so a changed source or a cache copied to another CPU rebuilds instead of crashing. The
sources are copied into that folder and compiled from there, so checkouts in other places
share one build; one process builds at a time, under a lock the system releases when its
holder dies (torch's own lock file, left behind by a process killed mid-build, made every
later start wait for ever), and a start waits at most BUILD_WAIT_S for another's build.
"""
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from pdserve.common.settings import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = ("model.cpp", "attention.h", "amx_attention.h", "prefill_attention.h", "elementwise.h", "linear.h",
           "blocked_linear.h", "vec.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
BUILD_WAIT_S = 600.0  # for another process's build of the same kernels, then the torch path
_loaded: dict[str, ModuleType | None] = {}


def is_supported() -> bool:
    """The kernels are written with AVX-512 intrinsics: x86-64 CPUs that have it."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def load_native(cache_dir: str | None) -> ModuleType | None:
    """The compiled extension, building it on first use; None where the CPU lacks AVX-512 or
    the build fails (the caller then runs the torch path, and the reason is logged)."""
    if not is_supported():
        return None
    # resolved: the build names its paths, so the same folder reached by another path (a
    # symlinked cache) would rebuild, and rewrite the build for every other path
    build_dir = (Path(cache_dir or default_cache_dir()) / "kernels" / _cache_key()).resolve()
    key = str(build_dir)
    if key not in _loaded:
        _loaded[key] = _build(build_dir)
    return _loaded[key]


def _build(build_dir: Path) -> ModuleType | None:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    is_cached = any(build_dir.glob("*.so"))
    compiler = os.environ.get("CXX", "c++")  # the one torch's extension builder calls
    if not is_cached and shutil.which(compiler) is None:
        log.warning("native CPU kernels unavailable, using torch ops: no C++ compiler (%s) on PATH", compiler)
        return None
    if not is_cached:
        log.info("compiling native CPU kernels into %s (first start only, about 30-60 s)", build_dir)
    start = time.monotonic()
    try:
        with _build_lock(build_dir, BUILD_WAIT_S), _ninja_on_path():
            module = cpp_extension.load(
                name=f"pdserve_native_{build_dir.name}", sources=[str(_staged_sources(build_dir) / "model.cpp")],
                extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                verbose=False)
    except Exception as exc:  # any build failure: serve on the torch path, say why
        log.warning("native CPU kernels unavailable, using torch ops: %s", str(exc).strip().splitlines()[-1:])
        return None
    if not is_cached:
        log.info("native CPU kernels compiled in %.1f s", time.monotonic() - start)
    return module


def _cache_key() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(" ".join((torch.__version__, sys.version, *CFLAGS, _cpu_signature())).encode())
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    """The CPU's model and flags: what -march=native compiled for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


@contextmanager
def _build_lock(build_dir: Path, wait_s: float):
    """Hold `build_dir`'s lock (TimeoutError after `wait_s`); while held, no other process is
    building there, so a lock file torch's builder left behind is stale and is removed."""
    with open(build_dir / "build.flock", "w") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process held {build_dir} for {wait_s:g} s") from None
                time.sleep(0.2)
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staged_sources(build_dir: Path) -> Path:
    """The sources copied into `build_dir/src` (rewritten only when changed, so an unchanged
    build is not redone): the build then names the same paths from every checkout."""
    here, staged = Path(__file__).parent, build_dir / "src"
    staged.mkdir(exist_ok=True)
    for name in SOURCES:
        text = (here / name).read_bytes()
        if not (staged / name).exists() or (staged / name).read_bytes() != text:
            (staged / name).write_bytes(text)
    return staged


@contextmanager
def _ninja_on_path():
    """torch's extension builder runs `ninja` from PATH; the `ninja` package installs it next to
    this interpreter, which is not on PATH when pdserve runs as `.venv/bin/pdserve`."""
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), saved))
    try:
        yield
    finally:
        os.environ["PATH"] = saved
