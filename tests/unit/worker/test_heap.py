"""The worker keeps its C heap between steps: a step's activations stop faulting pages in."""
import ctypes.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.worker.cpu.heap import keep_step_memory

# On a thread of its own, as in a worker: one layer's activations of a 2,048-token step of
# SmolLM2-135M (normed input, q|k|v, gate|up, the SiLU product), written and then freed;
# prints the anonymous resident MiB they added, and how many of those the process still holds
# after. A small tensor first (100 KB: parallel, under glibc's initial mmap threshold), so that the
# op's first use and the OpenMP threads it starts are not counted.
STEP = textwrap.dedent("""
    import json, sys, threading, torch
    from pdserve.worker.cpu.heap import keep_step_memory
    if sys.argv[1] == "keep":
        keep_step_memory()
    def anonymous_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024
    result = []
    def step():
        torch.ones(200, 256, dtype=torch.bfloat16)
        before = anonymous_mib()
        rows = [torch.ones(2048, width, dtype=torch.bfloat16) for width in (576, 960, 3072, 1536)]
        added = anonymous_mib() - before
        del rows
        result.extend([added, anonymous_mib() - before])
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    print(json.dumps(result))
""")


def _step_mib(mode: str) -> tuple[float, float]:
    """In a fresh process with none of the user's malloc settings: (MiB a step added, MiB still
    held once it freed them)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    run = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, timeout=120,
                         env=env, check=True)
    added, held = json.loads(run.stdout.splitlines()[-1])
    return added, held


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_a_kept_heap_holds_a_steps_memory_for_the_next():
    added, held = _step_mib("keep")
    assert added > 20 and held > 0.9 * added, (added, held)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_without_it_glibc_gives_the_pages_back():
    """What the setting is for: the next step would fault every one of those pages in again."""
    added, held = _step_mib("default")
    assert added > 20 and held < 0.25 * added, (added, held)


def test_a_users_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert keep_step_memory() == "C heap: as the environment sets it"
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert keep_step_memory() == "C heap: as the environment sets it"
