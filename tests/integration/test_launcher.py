"""`pdserve serve` for real with its default topology: the bundled model, a prefill worker, a
decode worker and a router as processes on loopback."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.stack import children_of, command_of, free_port, free_port_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def is_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def start_serve(tmp_path: Path, cache_dir: Path, port: int, worker_port: int, metrics_port: int,
                *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`pdserve serve` with no topology flags: prefill on `worker_port`, decode on the next port."""
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--worker-port", str(worker_port),
            "--metrics-port", str(metrics_port), "--max-model-len", "512", "--startup-timeout", "150",
            "--cache-dir", str(cache_dir), *flags]
    with open(tmp_path / "serve.out", "wb") as out, open(tmp_path / "serve.err", "wb") as err:
        serve = subprocess.Popen(argv, stdout=out, stderr=err, env=None if env is None else {**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while b"pdserve is ready" not in (tmp_path / "serve.out").read_bytes():
        assert serve.poll() is None, (tmp_path / "serve.err").read_text()[-2000:]
        assert time.monotonic() < deadline, "serve was not ready in time"
        time.sleep(0.2)
    return serve, url


def complete(url: str, prompt: str) -> tuple[dict[str, object], str]:
    """The completion and the route the router took (its `x-pdserve-route` header)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response), response.headers["x-pdserve-route"]


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def free_ports() -> tuple[int, int, int]:
    """Router port, worker base port and metrics base port, with each base's successor free too
    (serve gives worker i the base + i), none handed out before in this session."""
    return free_port(), free_port_pair(), free_port_pair()


LONG_PROMPT = "The history of the city is long. " * 12  # ~100 tokens: worth a prefill worker


def test_serve_answers_through_prefill_and_decode_and_ctrl_c_stops_everything(tmp_path: Path,
                                                                             serve_cache_dir: Path) -> None:
    port, worker_port, metrics_port = free_ports()
    serve, url = start_serve(tmp_path, serve_cache_dir, port, worker_port, metrics_port)
    try:
        children = children_of(serve.pid)
        kinds = sorted(command_of(pid).split()[5] for pid in children)
        answer, route = complete(url, LONG_PROMPT)
        received = metric(metrics_port + 1, 'pdserve_kv_transfer_blocks_count{direction="received"}')
        sent = metric(metrics_port, 'pdserve_kv_transfer_blocks_count{direction="sent"}')
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(STOP_TIMEOUT_S)
    assert kinds == ["router", "worker", "worker"]
    assert answer["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert answer["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert f"decode=127.0.0.1:{worker_port + 1}" in route and f"prefill=127.0.0.1:{worker_port}" in route
    assert (sent, received) == (1.0, 1.0)  # one transfer of this prompt's blocks
    assert serve.returncode == 0
    assert [is_alive(pid) for pid in children] == [False, False, False]
    out = (tmp_path / "serve.out").read_text()
    assert f"  prefill  127.0.0.1:{worker_port}  metrics port {metrics_port}" in out
    assert f"curl -s {url}/v1/completions" in out


def metrics_status(url: str, key: str | None = None) -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_killed_router_stops_the_workers_and_serve_exits_1(tmp_path: Path, serve_cache_dir: Path) -> None:
    """Workers are restarted (tests/integration/test_supervision.py); the router is not. Served
    with --protect-metrics: every metrics port of the launch (router, workers, serve's own)
    answers a scrape without the key 401."""
    port, worker_port, metrics_port = free_ports()
    serve, url = start_serve(tmp_path, serve_cache_dir, port, worker_port, metrics_port, "--protect-metrics",
                             env={"PDSERVE_API_KEY": "scrape-key"})
    try:
        out = (tmp_path / "serve.out").read_text()
        serve_metrics = out.split("worker restarts: ", 1)[1].split(" ", 1)[0]
        scrapes = [f"{url}/metrics", f"http://127.0.0.1:{metrics_port}/metrics",
                   f"http://127.0.0.1:{metrics_port + 1}/metrics", serve_metrics]
        statuses = [(metrics_status(u), metrics_status(u, "wrong"), metrics_status(u, "scrape-key")) for u in scrapes]
        children = children_of(serve.pid)
        (router,) = [pid for pid in children if command_of(pid).split()[5] == "router"]
        workers = [pid for pid in children if pid != router]
        os.kill(router, signal.SIGKILL)
        serve.wait(STOP_TIMEOUT_S)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(STOP_TIMEOUT_S)
    assert statuses == [(401, 401, 200)] * 4
    assert serve.returncode == 1
    assert [is_alive(pid) for pid in workers] == [False, False]
    err_lines = (tmp_path / "serve.err").read_text().splitlines()
    assert "pdserve serve: router exited unexpectedly with code -9; stopping" in err_lines
