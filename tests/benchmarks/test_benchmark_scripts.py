"""Every benchmark script runs at its tiny setting and writes the report its README section
promises, so none rots unnoticed (routing.py did: its routers held certificates of another
authority than the workers they measured). No figure is asserted, only that each script ran
and what its report holds.

Scripts run as a user runs them, `python benchmarks/SCRIPT --json PATH ...`, in a process of
their own (the benchmarks folder is no package: a script imports its siblings from its own
folder). They share one tiny random-weight checkpoint and one `pdserve serve` as the "other
server" of the comparing scripts, and run three at a time: a tiny run is mostly processes
starting and waiting for each other, and the marker is to stay within a few minutes on a 2-core
machine (about 3 there, against about 4 one script after another).
"""
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from script_runs import NOT_RUN, RUNS, SET_KEYS
from tests.integration.stack import free_port, make_tiny_checkpoint, start_serve, stop

pytestmark = [pytest.mark.benchmarks, pytest.mark.timeout(900)]
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT_TIMEOUT_S = 420
SIDE_BY_SIDE = 3
# Each worker a script starts keeps a KV cache this size unless the script sets one (a worker
# on CPU otherwise sizes it by the RAM free): the tiny model's prompts need a few MiB, and the
# scripts side by side then stay within a shared machine's memory. And one torch thread per
# worker that never spins waiting for work (a worker's default spin, with a thread per core):
# the tiny model gains nothing from a second thread, and the processes of one script would spin
# on the cores another's wait for.
SCRIPT_ENV = {**os.environ, "PDSERVE_KV_CACHE_MEMORY": "64MiB", "PDSERVE_NUM_THREADS": "1", "GOMP_SPINCOUNT": "0"}


@dataclass(frozen=True)
class Ran:
    returncode: int
    output: str
    report: dict | None


def run_script(script: str, args: list[str], out: Path) -> Ran:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--json", str(out), *args],
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=BENCHMARKS.parent,
                          env=SCRIPT_ENV)
    report = json.loads(out.read_text()) if out.exists() else None
    return Ran(done.returncode, (done.stdout + done.stderr)[-4000:], report)


@contextlib.contextmanager
def other_server(model: str, directory: Path) -> Iterator[str]:
    """A `pdserve serve --aggregated` that the comparing scripts measure as their "other server"."""
    port = free_port()
    process, _ = start_serve(directory, ["--aggregated", "--model", model, "--port", str(port),
                                         "--worker-port", str(free_port()), "--kv-cache-memory", "64MiB",
                                         "--log-level", "warning"])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The selected scripts' runs, started SIDE_BY_SIDE at a time in RUNS' order (longest first)."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.path == request.path and hasattr(item, "callspec")}
    # SmolLM2's tokenizer on 2 random layers of head_dim 32 (the native kernels' least), with room
    # for vs_vllm.py's 1,152-token rows and tiers.py's 2,048
    model = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), 2048, hidden_size=128))
    with contextlib.ExitStack() as stack:
        needs_other = any("{other}" in " ".join(RUNS[name].args) for name in selected)
        other = stack.enter_context(other_server(model, tmp_path_factory.mktemp("other"))) if needs_other else ""
        pool = ThreadPoolExecutor(SIDE_BY_SIDE)
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        yield {name: pool.submit(run_script, name, [a.format(model=model, other=other) for a in run.args],
                                 tmp_path_factory.mktemp(name.removesuffix(".py")) / "report.json")
               for name, run in RUNS.items() if name in selected}


def test_every_python_file_of_benchmarks_is_run_or_says_why_not() -> None:
    assert sorted(path.name for path in BENCHMARKS.glob("*.py")) == sorted([*RUNS, *NOT_RUN])


@pytest.mark.parametrize("script", list(RUNS))
def test_the_script_runs_at_its_tiny_setting_and_reports_what_its_readme_says(
        script: str, runs: dict[str, Future]) -> None:
    ran = runs[script].result(timeout=SCRIPT_TIMEOUT_S * len(RUNS))
    assert ran.returncode == 0, ran.output
    assert ran.report is not None and SET_KEYS <= ran.report.keys(), ran.output
    assert ran.report["benchmark"] == script.removesuffix(".py")
    RUNS[script].check(ran.report)
