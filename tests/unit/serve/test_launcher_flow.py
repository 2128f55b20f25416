"""`pdserve serve`: its flow under signals and child failures (stand-in children in the
prefill + decode + router shape), its banner and its children's command lines."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.serve.settings import resolve_serve_settings
from pdserve.common.settings import resolve_router_settings, resolve_worker_settings
from pdserve.serve.launcher import child_stages, ready_banner, with_core_share
from pdserve.serve.supervisor import RestartPolicy

DRIVER = str(Path(__file__).with_name("serve_driver.py"))
WAIT_S = 20.0


def start_driver(tmp_path: Path, router_mode: str, *worker_modes: str) -> subprocess.Popen[str]:
    modes = worker_modes or ("serve",)
    return subprocess.Popen([sys.executable, DRIVER, str(tmp_path), router_mode, *modes],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_pid(path: Path) -> int:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_stops_the_workers_together_then_the_router_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    driver = start_driver(tmp_path, "serve", "serve", "serve", "serve")
    names = ["prefill-0", "prefill-1", "decode-0", "router"]
    pids = [wait_for_pid(tmp_path / f"{name}.ready") for name in names]
    driver.send_signal(sig)
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout, stderr) == (0, "READY\n", "")
    assert [is_alive(pid) for pid in pids] == [False] * 4
    order = (tmp_path / "stop-order").read_text().split()
    assert (sorted(order[:3]), order[3:]) == (sorted(names[:3]), ["router"])  # workers drain, then the router


def test_a_dying_child_stops_the_others_and_exits_1_with_one_line(tmp_path: Path) -> None:
    driver = start_driver(tmp_path, "die-later", "serve", "serve")
    worker_pids = [wait_for_pid(tmp_path / f"{name}.ready") for name in ("prefill-0", "decode-0")]
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout) == (1, "READY\n")
    assert stderr == "pdserve serve: router exited unexpectedly with code 4; stopping\n"
    assert [is_alive(pid) for pid in worker_pids] == [False, False]


def test_a_worker_dying_at_start_exits_1_before_the_router_starts(tmp_path: Path) -> None:
    driver = start_driver(tmp_path, "serve", "serve", "die-at-start")
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout) == (1, "")
    assert stderr == "pdserve serve: decode-0 exited with code 3 while starting; stopping\n"
    assert not (tmp_path / "router.ready").exists()


def test_the_router_dying_at_start_exits_1_before_the_banner(tmp_path: Path) -> None:
    driver = start_driver(tmp_path, "die-at-start")
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout) == (1, "")
    assert stderr == "pdserve serve: router exited with code 3 while starting; stopping\n"


def test_each_worker_and_the_router_get_every_setting_as_a_flag_and_no_pdserve_env() -> None:
    settings = resolve_serve_settings(
        ["--model", "/m/tiny.gguf", "--port", "9000", "--worker-port", "6000", "--block-size", "32",
         "--prefill", "1", "--decode", "1"], {})
    workers, (router,) = child_stages(settings)
    assert [spec.name for spec in workers] == ["prefill worker at 127.0.0.1:6000", "decode worker at 127.0.0.1:6001"]
    assert [resolve_worker_settings(spec.argv[6:], {}) for spec in workers] == list(settings.workers)
    assert resolve_router_settings(router.argv[6:], {}) == settings.router
    tethered = (sys.executable, "-m", "pdserve.serve.tether", str(os.getpid()), "15")  # --shutdown-timeout
    assert workers[0].argv[:6] == (*tethered, "worker")
    assert router.argv[:6] == (*tethered, "router")
    router_flags = " ".join(router.argv[6:])
    assert "--worker 127.0.0.1:6000 --worker 127.0.0.1:6001" in router_flags
    assert [" ".join(spec.argv).count("--num-threads 1") for spec in workers] == [1, 1]
    assert workers[0].env is not None and not any(k.startswith("PDSERVE_") for k in workers[0].env)


def test_banner_has_the_url_topology_threads_and_a_curl_line_that_parses() -> None:
    settings = resolve_serve_settings(["--model", "/m/tiny.gguf", "--host", "0.0.0.0", "--port", "9000",
                                       "--prefill", "1", "--decode", "1", "--metrics-port", "9100",
                                       "--worker-port", "50051", "--deployment-id", "shop-a"], {})
    lines = ready_banner(settings, 9200).splitlines()
    curl = shlex.split(lines[-1])
    assert lines[:-1] == [
        "pdserve is ready at http://127.0.0.1:9000 (model /m/tiny.gguf); Ctrl-C stops it.",
        "Topology:",
        "  router   http://127.0.0.1:9000  deployment shop-a",
        "  prefill  127.0.0.1:50051  metrics port 9100",
        "  decode   127.0.0.1:50052  metrics port 9101",
        "  torch threads per worker: 1 (--num-threads sets it)",
        "  internal gRPC: mutual TLS, a throwaway authority for this launch",
        "  worker restarts: http://127.0.0.1:9200/metrics (pdserve_worker_restarts_total)",
        "Try:",
    ]
    assert curl[:3] == ["curl", "-s", "http://127.0.0.1:9000/v1/completions"]
    body = json.loads(curl[curl.index("-d") + 1])
    assert body == {"model": "/m/tiny.gguf", "prompt": "The capital of France is", "max_tokens": 16}


def test_workers_sharing_cores_are_told_the_table_and_the_banner_says_so(tmp_path) -> None:
    settings = with_core_share(resolve_serve_settings(["--model", "/m/tiny.gguf"], {}), tmp_path)
    workers = child_stages(settings)[0]
    assert [" ".join(spec.argv).count(f"--core-share-file {tmp_path / 'cores'}") for spec in workers] == [1, 1]
    assert ("  torch threads per worker: 1 (--num-threads sets it), and idle peers' cores (--share-cores)"
            in ready_banner(settings, None).splitlines())


def test_banner_of_one_aggregated_worker_leaves_threads_to_torch() -> None:
    settings = resolve_serve_settings(["--model", "/m/tiny.gguf", "--aggregated", "--worker-port", "50051",
                                       "--deployment-id", "shop-a"], {})
    assert ready_banner(settings, None).splitlines()[2:7] == [
        "  router   http://127.0.0.1:8000  deployment shop-a",
        "  both     127.0.0.1:50051",
        "  torch threads per worker: torch's default (--num-threads sets it)",
        "  internal gRPC: mutual TLS, a throwaway authority for this launch",
        "Try:",  # no restart metrics line: --serve-metrics-port ''
    ]


def test_workers_restart_with_the_serve_backoff_and_the_router_does_not() -> None:
    settings = resolve_serve_settings(["--model", "/m/tiny.gguf", "--restart-backoff", "2",
                                       "--max-restart-backoff", "16"], {})
    workers, (router,) = child_stages(settings)
    assert [spec.restart for spec in workers] == [RestartPolicy(2.0, 16.0, max_deaths_in_a_row=5)] * 2
    assert router.restart is None
