"""`pdserve serve`'s processes under faults, for real (the bundled model on loopback): a SIGKILLed
serve takes its children with it; two serves on one host each serve with their own workers; a
busy port is a one-line error at once; a router refuses a worker of another deployment."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.common.ports import is_port_free
from pdserve.common.tls import TlsConfig
from pdserve.rpc.worker_client import GrpcBackend
from tests.integration.stack import children_of, command_of, free_port, is_running, serve_credentials_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_TIMEOUT_S = 240.0  # two serves load the model side by side on a small machine
GONE_TIMEOUT_S = 60.0  # > serve's --shutdown-timeout: the tether's SIGKILL comes by then
ERROR_TIMEOUT_S = 60.0  # a refused start needs no model
PROMPT = "The history of the city is long. " * 12  # ~100 tokens: worth a prefill worker
SERVE = (sys.executable, "-m", "pdserve.cli", "serve")


@dataclass
class Serve:
    process: subprocess.Popen[bytes]
    directory: Path

    @property
    def out(self) -> str:
        return (self.directory / "serve.out").read_text()

    @property
    def err(self) -> str:
        return (self.directory / "serve.err").read_text()

    def banner_value(self, prefix: str) -> list[str]:
        """The word after `prefix` on each banner line that starts with it (e.g. "  decode   ")."""
        return [line[len(prefix):].split()[0] for line in self.out.splitlines() if line.startswith(prefix)]

    @property
    def url(self) -> str:
        return self.banner_value("  router   ")[0]

    @property
    def deployment_id(self) -> str:
        (line,) = [line for line in self.out.splitlines() if line.startswith("  router   ")]
        return line.split("deployment ")[1]

    @property
    def worker_addresses(self) -> set[str]:
        return set(self.banner_value("  prefill  ") + self.banner_value("  decode   "))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(GONE_TIMEOUT_S)


def start_serve(directory: Path, cache_dir: Path, *args: str) -> Serve:
    """`pdserve serve` with the default topology and no fixed worker port, its output in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    argv = [*SERVE, "--port", str(free_port()), "--max-model-len", "512", "--startup-timeout", "200",
            "--cache-dir", str(cache_dir), *args]
    with open(directory / "serve.out", "wb") as out, open(directory / "serve.err", "wb") as err:
        return Serve(subprocess.Popen(argv, stdout=out, stderr=err), directory)


def wait_until(is_done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def wait_ready(*serves: Serve) -> None:
    def all_ready() -> bool:
        for serve in serves:
            assert serve.process.poll() is None, serve.err[-2000:]
        return all("pdserve is ready" in serve.out for serve in serves)

    wait_until(all_ready, START_TIMEOUT_S, "serve was not ready in time")


def route_of(url: str) -> dict[str, str]:
    """The route the router took for one completion, from its `x-pdserve-route` header."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        header = response.headers["x-pdserve-route"]
    return dict(part.split("=", 1) for part in header.split(";"))


def deployment_of(address: str, serve: "Serve") -> str | None:
    """Asked over serve's mutual TLS, as its router."""
    tls = TlsConfig.from_dir(serve_credentials_dir(serve.process.pid))

    async def ask() -> str | None:
        backend = GrpcBackend(address, tls=tls)
        try:
            return (await backend.info()).deployment_id
        finally:
            await backend.close()

    return asyncio.run(ask())


def descendants(pid: int) -> list[int]:
    found = children_of(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for serve in started:
        if serve.process.poll() is None:
            serve.process.kill()
    for serve in started:  # the tether takes the children with it
        serve.stop()


@pytest.mark.parametrize("when", ["ready", "starting"])
def test_kill_9_of_serve_leaves_none_of_its_processes(tmp_path: Path, serve_cache_dir: Path, serves: list[Serve],
                                                       when: str) -> None:
    serve = start_serve(tmp_path / "a", serve_cache_dir, "--shutdown-timeout", "10")
    serves.append(serve)
    if when == "ready":
        wait_ready(serve)
        ports = [int(address.rsplit(":", 1)[1]) for address in serve.worker_addresses]
        ports.append(int(serve.url.rsplit(":", 1)[1]))
    else:  # the workers are loading the model; the router is not started yet
        wait_until(lambda: len(children_of(serve.process.pid)) == 2, START_TIMEOUT_S, "no workers started")
        ports = []
    family = descendants(serve.process.pid)
    assert len(family) == (3 if when == "ready" else 2)
    os.kill(serve.process.pid, signal.SIGKILL)
    serve.process.wait(GONE_TIMEOUT_S)
    wait_until(lambda: not any(is_running(pid) for pid in family), GONE_TIMEOUT_S,
               f"processes outlived a SIGKILLed serve: {[command_of(p) for p in family if is_running(p)]}")
    assert [port for port in ports if not is_port_free("127.0.0.1", port)] == []


def test_two_serves_side_by_side_each_answer_with_their_own_workers(tmp_path: Path, serve_cache_dir: Path,
                                                                     serves: list[Serve]) -> None:
    first, second = start_serve(tmp_path / "a", serve_cache_dir), start_serve(tmp_path / "b", serve_cache_dir)
    serves += [first, second]
    wait_ready(first, second)
    assert first.deployment_id != second.deployment_id
    assert first.worker_addresses.isdisjoint(second.worker_addresses)
    for serve in (first, second):
        assert len(serve.worker_addresses) == 2
        children = [command_of(pid) for pid in children_of(serve.process.pid)]
        assert [f"--deployment-id {serve.deployment_id}" in command for command in children] == [True] * 3
        route = route_of(serve.url)
        assert {route["decode"], route["prefill"]} == serve.worker_addresses
        assert {deployment_of(address, serve) for address in serve.worker_addresses} == {serve.deployment_id}


def test_a_router_refuses_the_workers_of_another_deployment_saying_why(tmp_path: Path, serve_cache_dir: Path,
                                                                        serves: list[Serve]) -> None:
    serve = start_serve(tmp_path / "a", serve_cache_dir, "--deployment-id", "shop-a")
    serves.append(serve)
    wait_ready(serve)
    decode = serve.banner_value("  decode   ")[0]
    router = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "router", "--port", str(free_port()), "--worker", decode,
         "--deployment-id", "shop-b", "--worker-wait-timeout", "30", "--cache-dir", str(serve_cache_dir),
         "--tls-dir", serve_credentials_dir(serve.process.pid)],
        capture_output=True, text=True, timeout=ERROR_TIMEOUT_S)
    why = f"worker {decode} deployment_id='shop-a': this router admits only workers of deployment 'shop-b'"
    assert router.returncode == 1
    assert f"worker {decode} refused: {why}" in router.stderr
    assert router.stderr.splitlines()[-1] == (f"pdserve router: worker {decode} unavailable: no decode or "
                                              f"aggregated worker answered within 30 s; refused {why}")
    assert route_of(serve.url)["decode"] == decode  # serve's own router still uses it


@pytest.mark.parametrize("flag", ["--port", "--worker-port", "--metrics-port", "--serve-metrics-port"])
def test_serve_on_a_busy_fixed_port_is_one_line_and_a_nonzero_exit_at_once(tmp_path: Path, flag: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = {"--port": str(free_port())} | {flag: str(port)}
        serve = subprocess.run([*SERVE, *(a for pair in args.items() for a in pair)], capture_output=True,
                               text=True, timeout=ERROR_TIMEOUT_S)
    assert (serve.returncode, serve.stdout) == (2, "")  # nothing started
    assert serve.stderr == f"pdserve serve: {flag}={port}: 127.0.0.1:{port} is in use\n"


@pytest.mark.parametrize("kind", ["worker", "router"])
def test_a_lone_worker_or_router_on_a_busy_port_says_so_before_anything_slow(kind: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # the worker would load its model, the router wait for its (absent) workers
        process = subprocess.run([sys.executable, "-m", "pdserve.cli", kind, "--port", str(port), "--insecure-internal"],
                                 capture_output=True, text=True, timeout=ERROR_TIMEOUT_S)
    assert process.returncode == 2
    assert process.stderr == f"pdserve {kind}: --port={port}: 127.0.0.1:{port} is in use\n"
