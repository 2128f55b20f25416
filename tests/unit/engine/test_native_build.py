"""The just-in-time build of the native kernels (`--kernels jit`, a developer's path): one builder
at a time, no wait for ever, shared sources, one folder however it is reached, and a clear error
without a compiler."""
import fcntl
import multiprocessing
import time

import pytest
import torch

from pdserve.engine.model.native import KernelsUnavailable, jit, load_native


def test_a_lock_file_left_by_a_killed_build_is_removed_not_waited_on(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's builder leaves when killed mid-build
    with jit._build_lock(tmp_path, wait_s=1.0):
        assert not (tmp_path / "lock").exists()


def _hold(folder, ready, release):
    with open(folder / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        ready.set()
        release.wait(30)


def test_another_process_building_is_waited_on_within_a_bound(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        (tmp_path / "lock").write_text("")  # the holder's build in progress
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            with jit._build_lock(tmp_path, wait_s=0.5):
                pass
        assert 0.5 <= time.monotonic() - start < 10
        assert (tmp_path / "lock").exists()  # a live builder's file is left alone
    finally:
        release.set()
        holder.join(30)
    with jit._build_lock(tmp_path, wait_s=5.0):  # the lock died with its holder's release
        pass


def test_sources_are_staged_once_and_rewritten_only_when_changed(tmp_path):
    staged = jit._staged_sources(tmp_path)
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()) == sorted(jit.SOURCES)
    assert {"model.cpp", "avx2/attention.h", "avx512/attention.h", "paged.h"} <= set(jit.SOURCES)
    before = {name: (staged / name).stat().st_mtime_ns for name in jit.SOURCES}
    (staged / "avx2/vec.h").write_text("stale")
    time.sleep(0.01)
    jit._staged_sources(tmp_path)
    after = {name: (staged / name).stat().st_mtime_ns for name in jit.SOURCES}
    assert {n for n in jit.SOURCES if after[n] != before[n]} == {"avx2/vec.h"}
    assert (staged / "avx2/vec.h").read_text() != "stale"


def test_a_cache_reached_through_a_symlink_builds_in_the_folder_it_names(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(jit, "_build", lambda build_dir: built.append(build_dir) or object())
    monkeypatch.setattr(jit, "_loaded", {})
    (tmp_path / "cache").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "cache", target_is_directory=True)
    first, second = jit.load_jit(str(tmp_path / "cache")), jit.load_jit(str(tmp_path / "link"))
    assert first is second
    assert built == [(tmp_path / "cache").resolve() / "kernels" / jit._cache_key()]


def test_without_a_compiler_the_jit_build_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(KernelsUnavailable, match=r"no C\+\+ compiler \(no-such-c\+\+-compiler\) on PATH"):
        load_native("jit", str(tmp_path))
    assert not any((tmp_path / "kernels").glob("*/*.so"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_prebuilt_kernels_compute_the_bits_of_the_ones_compiled_for_this_cpu(checkpoints, tmp_path_factory, dtype):
    """The prebuilt level this CPU runs and the just-in-time build for it (`-march=native`, the
    kernels as they were built before levels) do the same arithmetic: the same logits, bit for bit."""
    from model_builders import chunk, load_runner, prompt, run
    from native_levels import LEVELS_HERE

    if not LEVELS_HERE:
        pytest.skip("this CPU runs none of the levels")
    cache = tmp_path_factory.getbasetemp() / "jit-kernels"  # one build per session
    ids, blocks = prompt(37, seed=9), list(range(12))

    def logits(kernels: str) -> list[torch.Tensor]:
        runner = load_runner(checkpoints["llama"], dtype=dtype, kernels=kernels, cache_dir=str(cache))
        [last] = run(runner, chunk("r", ids, 0, blocks, is_prompt=True))
        [after] = run(runner, chunk("r", [int(last.argmax())], len(ids), blocks))
        return [last, after]

    jit, prebuilt = logits("jit"), logits(LEVELS_HERE[-1])
    assert load_native("jit", str(cache)).LEVEL == LEVELS_HERE[-1]
    assert all(torch.equal(a, b) for a, b in zip(jit, prebuilt, strict=True))
