"""`pdserve serve` supervising its workers, for real (the bundled model on loopback, default
topology): a decode worker killed mid-stream ends that stream with an error event and serve
answers again once the launcher restarted the worker (same port, same deployment id) and the
router took it back; a worker dying again and again is restarted with a doubling backoff; a
worker's SIGTERM drains it (its stream completes, new requests are refused saying why, it exits
0, and serve restarts it). One serve for the module: each test reads only what it changed."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.tls import TlsConfig
from pdserve.rpc.worker_client import GrpcBackend
from tests.integration.stack import children_of, command_of, free_port, is_running, metric, serve_credentials_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_TIMEOUT_S = 240.0  # the model loads on a small, shared machine
STREAM_END_LIMIT_S = 10.0  # the bound: a killed worker's stream ends within this
ANSWER_AGAIN_LIMIT_S = 60.0  # the bound: serve answers again within this after the kill
PROMPT = "The history of the city is long. " * 12  # ~100 tokens: worth a prefill worker


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

    def banner_value(self, prefix: str) -> str:
        (line,) = [line for line in self.out.splitlines() if line.startswith(prefix)]
        return line[len(prefix):].split()[0]

    @property
    def url(self) -> str:
        return self.banner_value("  router   ")

    @property
    def metrics_url(self) -> str:
        return self.banner_value("  worker restarts: ")

    def worker_pid(self, role: str) -> int:
        (pid,) = [pid for pid in children_of(self.process.pid) if f"--role {role} " in command_of(pid)]
        return pid

    def restarts(self, role: str) -> float:
        address = self.banner_value(f"  {role:<8} ")
        return metric(self.metrics_url, "pdserve_worker_restarts_total", f'role="{role}",worker="{address}"')


def wait_until(is_done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, serve_cache_dir: Path) -> Iterator[Serve]:
    directory = tmp_path_factory.mktemp("serve")
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(free_port()), "--max-model-len", "512",
            "--startup-timeout", "200", "--cache-dir", str(serve_cache_dir), "--restart-backoff", "1",
            "--drain-timeout", "60", "--shutdown-timeout", "70"]
    with open(directory / "serve.out", "wb") as out, open(directory / "serve.err", "wb") as err:
        started = Serve(subprocess.Popen(argv, stdout=out, stderr=err), directory)
    try:
        wait_until(lambda: "pdserve is ready" in started.out or started.process.poll() is not None,
                   START_TIMEOUT_S, "serve was not ready in time")
        assert started.process.poll() is None, started.err[-2000:]
        yield started
    finally:
        if started.process.poll() is None:
            started.process.send_signal(signal.SIGINT)
            started.process.wait(90)


def stream(url: str, max_tokens: int) -> Iterator[dict[str, object] | str]:
    """The SSE frames of one streamed completion: each parsed, `[DONE]` as the string."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=STREAM_END_LIMIT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                yield data if data == "[DONE]" else json.loads(data)


def complete(url: str) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)


def answers(url: str) -> bool:
    try:
        return complete(url).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_decode_worker_killed_mid_stream_ends_it_with_an_error_and_serve_answers_again(serve: Serve) -> None:
    decode = serve.banner_value("  decode   ")
    before, old_pid = serve.restarts("decode"), serve.worker_pid("decode")
    frames = stream(serve.url, max_tokens=400)
    assert [isinstance(next(frames), dict) for _ in range(3)] == [True] * 3  # tokens are flowing
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rest = list(frames)  # each read is bounded by STREAM_END_LIMIT_S too
    assert time.monotonic() - killed_at < STREAM_END_LIMIT_S
    assert rest[-1] == "[DONE]" and "error" in rest[-2], rest[-3:]
    assert rest[-2]["error"]["code"] == 503  # type: ignore[index]
    wait_until(lambda: answers(serve.url), ANSWER_AGAIN_LIMIT_S - (time.monotonic() - killed_at),
               f"serve did not answer within {ANSWER_AGAIN_LIMIT_S:g} s of the kill:\n{serve.err[-3000:]}")
    route = dict(part.split("=", 1) for part in complete(serve.url).headers["x-pdserve-route"].split(";"))
    new_pid = serve.worker_pid("decode")
    assert (route["decode"], new_pid != old_pid) == (decode, True)  # same port, new process
    assert f"--port {decode.rsplit(':', 1)[1]} " in command_of(new_pid)
    assert f"--deployment-id {deployment_of(serve)} " in command_of(new_pid)
    assert serve.restarts("decode") == before + 1
    assert f"pdserve serve: decode worker at {decode} exited with code -9; restarting it in 1 s" in serve.err


def deployment_of(serve: Serve) -> str:
    (line,) = [line for line in serve.out.splitlines() if line.startswith("  router   ")]
    return line.split("deployment ")[1]


def test_a_worker_dying_again_and_again_is_restarted_with_a_doubling_backoff(serve: Serve) -> None:
    prefill = serve.banner_value("  prefill  ")
    before = serve.restarts("prefill")
    name = f"prefill worker at {prefill}"
    num_restarted = serve.err.count(f"{name} restarted (pid")
    for death in range(3):  # killed again while it is still loading: deaths in a row
        pid = serve.worker_pid("prefill")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: serve.err.count(f"{name} restarted (pid") == num_restarted + death + 1
                   and not is_running(pid), 60.0, f"{name} was not restarted:\n{serve.err[-3000:]}")
    backoffs = re.findall(rf"{re.escape(name)} exited with code -9; restarting it in (\S+) s \(death (\d+) in a row\)",
                          serve.err)
    assert backoffs[-3:] == [("1", "1"), ("2", "2"), ("4", "3")]
    assert serve.restarts("prefill") == before + 3
    wait_until(lambda: f"{name} is ready again" in serve.err, START_TIMEOUT_S, f"{name} never came back")

    def routes_through_prefill() -> bool:
        response = complete(serve.url)
        return response.status_code == 200 and f"prefill={prefill}" in response.headers["x-pdserve-route"]

    wait_until(routes_through_prefill, ANSWER_AGAIN_LIMIT_S, "the router never took the prefill worker back")


def test_sigterm_drains_a_worker_its_stream_completes_new_requests_are_refused_and_it_exits_0(serve: Serve) -> None:
    decode = serve.banner_value("  decode   ")
    wait_until(lambda: answers(serve.url), ANSWER_AGAIN_LIMIT_S, "serve does not answer")
    pid = serve.worker_pid("decode")
    frames = stream(serve.url, max_tokens=200)
    first = next(frames)
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: "draining" in refusal_of(decode, serve), 10.0, "the draining worker did not refuse a request")
    refused = complete(serve.url)  # the only decode worker drains: the router has nowhere to send it
    rest = [first, *frames]
    text = "".join(frame["choices"][0]["text"] for frame in rest if isinstance(frame, dict) and frame["choices"])
    finish = [frame["choices"][0]["finish_reason"] for frame in rest if isinstance(frame, dict) and frame["choices"]]
    assert (rest[-1], finish[-1], [f for f in rest if isinstance(f, dict) and "error" in f]) == ("[DONE]", "length", [])
    assert len(text) > 0
    assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    # out of rotation by whichever the router heard first: its event stream ending or a refusal
    assert re.search(rf"{decode}: .*(the worker is stopping|draining)", refused.json()["error"]["message"]), refused.text
    wait_until(lambda: f"decode worker at {decode} exited with code 0; restarting it in" in serve.err, 60.0,
               f"the drained worker did not exit 0:\n{serve.err[-3000:]}")
    assert not is_running(pid)
    wait_until(lambda: answers(serve.url), START_TIMEOUT_S, "serve did not answer after the drained worker's restart")


def refusal_of(address: str, serve: Serve) -> str:
    """What the worker at `address` answers a new request with ("" when it takes it), asked over
    serve's mutual TLS as its router."""
    import asyncio

    tls = TlsConfig.from_dir(serve_credentials_dir(serve.process.pid))

    async def ask() -> str:
        backend = GrpcBackend(address, generate_timeout_s=30.0, tls=tls)
        request = GenerationRequest(RequestId("drain-probe"), (1, 2, 3), SamplingParams(max_tokens=1))
        try:
            async for _ in backend.generate(request):
                pass
        except WorkerUnavailableError as exc:
            return str(exc)
        finally:
            await backend.close()
        return ""

    return asyncio.run(ask())


def test_sigterm_to_serve_drains_its_workers_then_stops_and_exits_0(serve: Serve) -> None:
    """Last in the module: it ends the module's serve."""
    wait_until(lambda: answers(serve.url), START_TIMEOUT_S, "serve does not answer")
    frames = stream(serve.url, max_tokens=200)
    first = next(frames)
    serve.process.send_signal(signal.SIGTERM)
    rest = [first, *frames]
    finish = [frame["choices"][0]["finish_reason"] for frame in rest if isinstance(frame, dict) and frame["choices"]]
    assert (rest[-1], finish[-1], [f for f in rest if isinstance(f, dict) and "error" in f]) == ("[DONE]", "length", [])
    assert serve.process.wait(90) == 0
