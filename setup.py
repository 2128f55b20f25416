"""pdserve's build: the package (pyproject.toml) plus its native CPU kernels, compiled here, ahead
of time, once per ISA level (services/pdserve/engine/model/native/levels.py), so that no machine
that runs pdserve needs a compiler. Each level is an extension of its own,
`pdserve.engine.model.native._kernels_<level>`, built from the same `model.cpp` (through
`units/<level>.cpp`, so that each level's object file is its own) with that level's instructions
enabled and linked against the pinned torch (so the build needs torch installed:
`pip install --no-build-isolation` where torch is already in the environment).

A build without a C++ compiler, or off x86-64, gives a package without kernels; it then serves on
torch ops and says so when a worker starts. PDSERVE_KERNEL_LEVELS=avx2,avx512 builds only those
levels (a quicker build for a developer).
"""
import os
import platform
import runpy
from pathlib import Path

from setuptools import setup

NATIVE = Path("services/pdserve/engine/model/native")


def kernel_extensions() -> tuple[list, dict]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    table = runpy.run_path(str(NATIVE / "levels.py"))
    chosen = os.environ.get("PDSERVE_KERNEL_LEVELS", ",".join(table["LEVELS"])).split(",")
    unknown = set(chosen) - set(table["LEVELS"])
    if unknown:
        raise SystemExit(f"PDSERVE_KERNEL_LEVELS: no level {', '.join(sorted(unknown))}")
    headers = sorted(str(p) for p in NATIVE.rglob("*.h"))  # a changed header (or flag) builds again
    extensions = [
        CppExtension(f"pdserve.engine.model.native.{table['MODULE_PREFIX']}{level}", [str(NATIVE / "units" / f"{level}.cpp")],
                     depends=[str(NATIVE / "model.cpp"), str(NATIVE / "levels.py"), *headers], extra_compile_args=[*table["COMMON_FLAGS"], *compiler_flags],
                     extra_link_args=["-fopenmp"], optional=True)
        for level, (_, compiler_flags) in table["LEVELS"].items() if level in chosen]
    # Without ninja: torch's ninja build writes one build.ninja per build folder, which the levels,
    # built side by side (build_ext's `parallel`), would overwrite in each other's hands.
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=False, no_python_abi_suffix=False)}


extensions, commands = kernel_extensions()
setup(ext_modules=extensions, cmdclass=commands, options={"build_ext": {"parallel": os.cpu_count() or 1}})
