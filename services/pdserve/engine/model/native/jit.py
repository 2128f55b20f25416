"""The just-in-time build of the native kernels, a developer's path (`--kernels jit`): `model.cpp`
compiled on first use for the CPU it runs on (`-march=native`, so it needs a C++ compiler at run
time and ~40 s on first start), cached under `<cache_dir>/kernels/<key>`. Served installs use the
kernels built ahead of time (setup.py, `native/__init__.py`).

The key covers the sources, torch's version and the CPU's flags, so a changed source or a cache
copied to another CPU rebuilds instead of crashing. The sources are copied into that folder and
compiled from there, so checkouts in other places share one build; one process builds at a time,
under a lock the system releases when its holder dies (torch's own lock file, left behind by a
process killed mid-build, made every later start wait for ever), and a start waits at most
BUILD_WAIT_S for another's build.
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

HERE = Path(__file__).parent
SOURCES = tuple(sorted(str(p.relative_to(HERE)) for p in (*HERE.glob("*.cpp"), *HERE.rglob("*.h"))))
CFLAGS = ("-O3", "-march=native", "-fopenmp")
BUILD_WAIT_S = 600.0  # for another process's build of the same kernels
_loaded: dict[str, ModuleType] = {}


class JitBuildError(RuntimeError):
    """The kernels could not be compiled here (the message says why)."""


def load_jit(cache_dir: str | None) -> ModuleType:
    """The kernels compiled for this CPU, building them on first use; JitBuildError if that fails."""
    # resolved: the build names its paths, so the same folder reached by another path (a
    # symlinked cache) would rebuild, and rewrite the build for every other path
    build_dir = (Path(cache_dir or default_cache_dir()) / "kernels" / _cache_key()).resolve()
    key = str(build_dir)
    if key not in _loaded:
        _loaded[key] = _build(build_dir)
    return _loaded[key]


def _build(build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    is_cached = any(build_dir.glob("*.so"))
    compiler = os.environ.get("CXX", "c++")  # the one torch's extension builder calls
    if not is_cached and shutil.which(compiler) is None:
        raise JitBuildError(f"no C++ compiler ({compiler}) on PATH")
    if not is_cached:
        log.info("compiling native CPU kernels into %s (first start only, about 30-60 s)", build_dir)
    start = time.monotonic()
    try:
        with _build_lock(build_dir, BUILD_WAIT_S), _ninja_on_path():
            module = cpp_extension.load(
                name=f"pdserve_native_{build_dir.name}", sources=[str(_staged_sources(build_dir) / "model.cpp")],
                extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                verbose=False)
    except Exception as exc:  # any build failure: say why
        raise JitBuildError(" ".join(str(exc).strip().splitlines()[-1:])) from exc
    if not is_cached:
        log.info("native CPU kernels compiled in %.1f s", time.monotonic() - start)
    return module


def _cache_key() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + (HERE / name).read_bytes())
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
    staged = build_dir / "src"
    for name in SOURCES:
        text = (HERE / name).read_bytes()
        target = staged / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_bytes() != text:
            target.write_bytes(text)
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
