"""Which ISA level of the prebuilt native kernels a worker runs: chosen from the CPU's flags (and
for AMX the OS lending the tile state), forced by `--kernels`, refused with the reason where the
CPU lacks it, a missing build stepped over, the choice logged once; and the kernels import with
no compiler anywhere."""
import logging
import re
from pathlib import Path
import os
import subprocess
import sys

import pytest

from pdserve.common.settings import KERNEL_CHOICES
from pdserve.engine.model import native
from pdserve.engine.model.native import (KernelsUnavailable, LEVEL_NAMES, cpu_levels, installed_levels, levels_for,
                                         load_level, load_native)

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})  # an AMD EPYC Zen 3
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # a Skylake-SP Xeon
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}  # an AMD EPYC Zen 4
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}  # a Sapphire Rapids Xeon


@pytest.mark.parametrize("flags, tiles_lent, expected", [
    (AVX2, False, ("avx2",)),
    (AVX512, False, ("avx2", "avx512")),
    (AVX512_BF16, False, ("avx2", "avx512", "avx512_bf16")),
    (AMX, True, ("avx2", "avx512", "avx512_bf16", "amx")),
    (AMX, False, ("avx2", "avx512", "avx512_bf16")),  # the OS keeps the tile state: no AMX
    (AVX512_BF16, True, ("avx2", "avx512", "avx512_bf16")),  # lent, but no tiles
    (AVX2 - {"f16c"}, False, ()),  # AVX2 without F16C: not even the lowest level
    (AMX - {"avx512bw"}, True, ("avx2",)),  # a level needs every level below it
    (frozenset(), False, ()),
])
def test_a_level_is_chosen_only_where_the_flags_say_so(flags, tiles_lent, expected):
    assert levels_for(frozenset(flags), tiles_lent) == expected


def test_every_level_is_a_kernels_choice_and_the_levels_run_low_to_high():
    assert LEVEL_NAMES == ("avx2", "avx512", "avx512_bf16", "amx")
    assert set(LEVEL_NAMES) <= set(KERNEL_CHOICES)
    assert set(KERNEL_CHOICES) - set(LEVEL_NAMES) == {"auto", "native", "torch", "jit"}


def test_every_level_this_cpu_runs_is_installed_and_reports_itself():
    """A build that failed quietly (setup.py's extensions are optional) is caught here."""
    assert installed_levels() == cpu_levels()
    for level in cpu_levels():
        assert load_level(level).LEVEL == level


def test_a_level_the_cpu_lacks_is_refused_naming_what_it_lacks(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2)
    monkeypatch.setattr(native, "cpu_levels", lambda: ("avx2",))
    with pytest.raises(KernelsUnavailable, match="this CPU lacks avx512bw, avx512dq, avx512f, avx512vl, so it "
                                                 "cannot run the avx512 kernels"):
        load_level("avx512")
    monkeypatch.setattr(native, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(native, "cpu_levels", lambda: ("avx2", "avx512", "avx512_bf16"))
    with pytest.raises(KernelsUnavailable, match="does not lend this process its AMX tile state"):
        load_level("amx")
    with pytest.raises(KernelsUnavailable, match="no kernels 'sse2'"):
        load_native("sse2")


def test_auto_takes_the_highest_level_steps_over_a_missing_build_and_logs_once(monkeypatch, caplog):
    here = cpu_levels()
    if not here:
        pytest.skip("this CPU runs none of the levels")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "cpu_levels", lambda: (*here, "future"))  # a level above, not installed
    real_load_level = native.load_level

    def load(level: str):
        if level == "future":
            raise KernelsUnavailable("this install has no future kernels")
        return real_load_level(level)

    monkeypatch.setattr(native, "load_level", load)
    with caplog.at_level(logging.INFO, logger=native.__name__):
        first, second = load_native("auto"), load_native("auto")
    assert first is second and first.LEVEL == here[-1]
    assert "native CPU kernels: this install has no future kernels" in caplog.text
    assert caplog.text.count(f"native CPU kernels: {here[-1]} (prebuilt)") == 1


def test_without_any_level_auto_is_torch_ops_and_native_an_error(monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "cpu_levels", lambda: ())
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert load_native("auto") is None
    assert "using torch ops: this CPU has none of the ISA levels" in caplog.text
    with pytest.raises(KernelsUnavailable, match="AVX2 with FMA and F16C at least"):
        load_native("native")
    assert load_native("torch") is None


def test_the_prebuilt_kernels_load_with_no_compiler_anywhere(tmp_path):
    """What a container image without build tools does: no compiler on PATH, CC and CXX unusable."""
    if not cpu_levels():
        pytest.skip("this CPU runs none of the levels")
    env = {"PATH": os.path.dirname(sys.executable), "CC": "/bin/false", "CXX": "/bin/false", "HOME": str(tmp_path)}
    code = "from pdserve.engine.model.native import load_native; print(load_native('auto').LEVEL)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [cpu_levels()[-1]]


def test_each_levels_build_is_its_own_module_whatever_the_cpu():
    """Every level's extension file exports its own module (and no other level's): read from the
    files, so it holds for levels this CPU cannot load (levels built side by side once shared one
    object file, and a level's file could carry another level's code)."""
    folder = Path(native.__file__).parent
    for level in LEVEL_NAMES:
        (built,) = folder.glob(f"_kernels_{level}.*.so")
        exported = set(re.findall(rb"PyInit__kernels_[a-z0-9_]+(?![A-Za-z0-9_])", built.read_bytes()))
        assert exported == {f"PyInit__kernels_{level}".encode()}, (level, exported)
