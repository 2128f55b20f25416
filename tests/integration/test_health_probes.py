"""The standard grpc.health.v1 service of a real worker (mutual TLS on its gRPC port, plain text
alone on `--health-port`), asked as Kubernetes' grpc probes and the compose health checks ask:
SERVING once ready, NOT_SERVING for readiness from the moment SIGTERM starts the drain while
"liveness" stays SERVING, on both ports; the plain port answers nothing but health.

The worker's engine steps are held (`stalling_worker.py`) so that one admitted request keeps the
drain going for as long as the test looks at it.
"""
import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.tls import TlsConfig
from pdserve.rpc.gen import worker_pb2, worker_pb2_grpc
from pdserve.rpc.probe import is_health_serving
from pdserve.rpc.tls import channel_credentials
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.serve.certs import main as certs_main
from tests.integration.stack import free_port, make_tiny_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120.0  # bound on every wait for something to happen (the model loads on a shared machine)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Worker:
    process: subprocess.Popen
    address: str  # gRPC, mutual TLS
    health_address: str  # grpc.health.v1 alone, plain text
    router_tls: TlsConfig  # a client's credentials of the worker's authority
    stall: Path  # while this file exists, the worker's engine steps wait


def eventually(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def worker(checkpoint: Path, tmp_path: Path) -> Iterator[Worker]:
    assert certs_main(["--out", str(tmp_path / "tls"), "--both", "decode-0", "--router", "router"]) == 0
    port, health_port = free_port(), free_port()
    stall = tmp_path / "stall"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.stalling_worker", str(stall), "--role", "both",
         "--port", str(port), "--health-port", str(health_port), "--tls-dir", str(tmp_path / "tls" / "decode-0"),
         "--model", str(checkpoint), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
         "--max-kv-tokens", "2048", "--num-threads", "1", "--cache-dir", "", "--drain-timeout", "120",
         "--engine-step-timeout", "600"],
        cwd=REPO, stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT)
    found = Worker(process, f"127.0.0.1:{port}", f"127.0.0.1:{health_port}",
                   TlsConfig.from_dir(str(tmp_path / "tls" / "router")), stall)
    try:
        eventually("the worker is ready", lambda: process.poll() is None and is_health_serving(found.health_address, 1.0))
        yield found
    finally:
        stall.unlink(missing_ok=True)
        if process.poll() is None:
            process.kill()
        process.wait(30)


def check_over_tls(worker: Worker, name: str = "") -> int:
    with grpc.secure_channel(worker.address, channel_credentials(worker.router_tls)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10.0).status


def check_plain(worker: Worker, name: str = "") -> int:
    with grpc.insecure_channel(worker.health_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10.0).status


def statuses(worker: Worker) -> dict[str, int]:
    """Readiness ("" and the Worker service) and liveness, on each port."""
    return {f"{port} {name or '(server)'}": check(worker, name)
            for port, check in (("tls", check_over_tls), ("plain", check_plain))
            for name in ("", "pdserve.v1.Worker", "liveness")}


def everything(status: int, liveness: int = SERVING) -> dict[str, int]:
    return {f"{port} {name}": liveness if name == "liveness" else status
            for port in ("tls", "plain") for name in ("(server)", "pdserve.v1.Worker", "liveness")}


def hold_one_request(worker: Worker) -> threading.Thread:
    """A request streaming its first tokens, then held by the stalled engine: it keeps the
    drain going until the stall is lifted."""
    request = GenerationRequest(RequestId("held"), (1, 2, 3, 4), SamplingParams(max_tokens=200, ignore_eos=True))
    streaming = threading.Event()

    async def run() -> None:
        backend = GrpcBackend(worker.address, tls=worker.router_tls)
        try:
            async for _ in backend.generate(request):
                if not streaming.is_set():
                    worker.stall.touch()
                    streaming.set()
        finally:
            await backend.close()

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    assert streaming.wait(WAIT_S), "no output of the held request"
    return thread


def num_running(worker: Worker) -> int:
    with grpc.secure_channel(worker.address, channel_credentials(worker.router_tls)) as channel:
        reply = worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10.0)
    return reply.stats.num_running + reply.stats.num_waiting


def test_health_answers_serving_when_ready_and_not_serving_while_draining_on_both_ports(worker: Worker) -> None:
    assert statuses(worker) == everything(SERVING)
    held = hold_one_request(worker)
    assert num_running(worker) == 1
    assert statuses(worker) == everything(SERVING)  # busy is still ready

    worker.process.send_signal(signal.SIGTERM)
    eventually("readiness turns NOT_SERVING", lambda: check_plain(worker) == NOT_SERVING)
    assert statuses(worker) == everything(NOT_SERVING, liveness=SERVING)
    assert not is_health_serving(worker.health_address, 5.0)
    assert is_health_serving(worker.health_address, 5.0, "liveness")
    assert worker.process.poll() is None  # still draining: the held request runs on

    worker.stall.unlink()
    held.join(WAIT_S)
    assert not held.is_alive()
    assert worker.process.wait(WAIT_S) == 0


def test_the_plain_health_port_answers_only_health_and_the_tls_port_only_certified_callers(worker: Worker) -> None:
    with grpc.insecure_channel(worker.health_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10.0)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as unknown:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="other"), timeout=10.0)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert not is_health_serving(worker.address, 5.0)  # plain text to the mutual-TLS port: no answer
    assert check_over_tls(worker) == SERVING
