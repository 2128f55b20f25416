"""`pdserve serve` for real: the bundled model, a worker and a router as processes on loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def command_of(pid: int) -> str:
    """e.g. "python -m pdserve.cli worker --model ..."."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def is_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def start_serve(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`pdserve serve` with its default topology; its workers' ports follow `--worker-port`."""
    port, worker_port = free_port(), free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--worker-port",
            str(worker_port), "--num-threads", "1", "--max-model-len", "512", "--startup-timeout", "150"]
    with open(tmp_path / "serve.out", "wb") as out, open(tmp_path / "serve.err", "wb") as err:
        serve = subprocess.Popen(argv, stdout=out, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while b"pdserve is ready" not in (tmp_path / "serve.out").read_bytes():
        assert serve.poll() is None, (tmp_path / "serve.err").read_text()[-2000:]
        assert time.monotonic() < deadline, "serve was not ready in time"
        time.sleep(0.2)
    return serve, url


def complete(url: str) -> dict[str, object]:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_serve_answers_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    serve, url = start_serve(tmp_path)
    try:
        children = children_of(serve.pid)
        answer = complete(url)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(STOP_TIMEOUT_S)
    assert len(children) == 2
    assert answer["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert answer["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert serve.returncode == 0
    assert [is_alive(pid) for pid in children] == [False, False]
    assert f"curl -s {url}/v1/completions" in (tmp_path / "serve.out").read_text()


def test_a_killed_worker_stops_the_router_and_serve_exits_1(tmp_path: Path) -> None:
    serve, _ = start_serve(tmp_path)
    try:
        kinds = {command_of(pid).split()[3]: pid for pid in children_of(serve.pid)}
        worker, router = kinds["worker"], kinds["router"]
        worker_port = command_of(worker).split("--port ")[1].split()[0]
        os.kill(worker, signal.SIGKILL)
        serve.wait(STOP_TIMEOUT_S)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(STOP_TIMEOUT_S)
    assert serve.returncode == 1
    assert is_alive(router) is False
    err_lines = (tmp_path / "serve.err").read_text().splitlines()
    assert f"pdserve serve: worker at 127.0.0.1:{worker_port} exited unexpectedly with code -9; stopping" in err_lines
