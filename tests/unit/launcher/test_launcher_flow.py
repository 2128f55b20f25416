"""`pdserve serve`: its flow under signals and child failures, its banner and child commands."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.common.settings import resolve_serve_settings
from pdserve.launcher import child_specs, ready_banner

DRIVER = str(Path(__file__).with_name("serve_driver.py"))
WAIT_S = 20.0


def start_driver(tmp_path: Path, router_mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, DRIVER, str(tmp_path), router_mode],
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
def test_a_stop_signal_stops_both_children_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    driver = start_driver(tmp_path, "serve")
    pids = [wait_for_pid(tmp_path / "worker.ready"), wait_for_pid(tmp_path / "router.ready")]
    driver.send_signal(sig)
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout, stderr) == (0, "READY\n", "")
    assert [is_alive(pid) for pid in pids] == [False, False]


def test_a_dying_child_stops_the_other_and_exits_1_with_one_line(tmp_path: Path) -> None:
    driver = start_driver(tmp_path, "die-later")
    worker_pid = wait_for_pid(tmp_path / "worker.ready")
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout) == (1, "READY\n")
    assert stderr == "pdserve serve: router exited unexpectedly with code 4; stopping\n"
    assert is_alive(worker_pid) is False


def test_a_child_dying_at_start_exits_1_before_the_banner(tmp_path: Path) -> None:
    driver = start_driver(tmp_path, "die-at-start")
    stdout, stderr = driver.communicate(timeout=WAIT_S)
    assert (driver.returncode, stdout) == (1, "")
    assert stderr == "pdserve serve: router exited with code 3 while starting; stopping\n"


def test_children_get_every_setting_as_a_flag_and_no_pdserve_env() -> None:
    settings = resolve_serve_settings(
        ["--model", "/m/tiny.gguf", "--port", "9000", "--worker-port", "6000", "--block-size", "32"], {})
    worker, router = child_specs(settings)
    assert worker.argv[:4] == (sys.executable, "-m", "pdserve.cli", "worker")
    assert router.argv[:4] == (sys.executable, "-m", "pdserve.cli", "router")
    worker_flags, router_flags = " ".join(worker.argv[4:]), " ".join(router.argv[4:])
    assert "--port 6000" in worker_flags and "--block-size 32" in worker_flags
    assert "--port 9000" in router_flags and "--worker 127.0.0.1:6000" in router_flags
    assert worker.env is not None and not any(k.startswith("PDSERVE_") for k in worker.env)


def test_banner_has_the_url_and_a_curl_line_that_parses() -> None:
    settings = resolve_serve_settings(["--model", "/m/tiny.gguf", "--host", "0.0.0.0", "--port", "9000"], {})
    banner = ready_banner(settings)
    curl = shlex.split(banner.splitlines()[-1])
    assert banner.splitlines()[0] == "pdserve is ready at http://127.0.0.1:9000 (model tiny); Ctrl-C stops it."
    assert curl[:3] == ["curl", "-s", "http://127.0.0.1:9000/v1/completions"]
    body = json.loads(curl[curl.index("-d") + 1])
    assert body == {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 16}
