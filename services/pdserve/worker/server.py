"""The worker's gRPC server: listen on a port, serve one engine, drain on shutdown.

Besides the Worker service (and the role's), the server answers the standard grpc.health.v1
service (`rpc/health_service.py`), and with a health port that service alone in plain text:
readiness follows the engine (polled every HEALTH_POLL_S, and at once when the drain starts)."""
import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from pdserve.common.engine_api import AsyncEngine, not_serving_reason
from pdserve.common.errors import ConfigError
from pdserve.common.ids import DeploymentId, WorkerId
from pdserve.common.tls import TlsConfig
from pdserve.rpc.health_service import HealthService, PlainHealthServer
from pdserve.rpc.tls import add_port, aio_server
from pdserve.rpc.worker_service import add_worker_service
from pdserve.worker.drain import DrainGate

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5  # how soon a wedged or recovered engine shows in grpc.health.v1

# Keepalive pings find a router that vanished without closing its connection; the call's
# cancellation then aborts its requests. The router's client pings no more often than this.
# grpc's default SO_REUSEPORT would let a second worker share the port silently.
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


class WorkerServer:
    """Serves `engine` over gRPC on `host:port` (port 0: any free port); with `tls`, only to
    callers presenting a certificate of the same authority (mutual TLS), each method only to
    the roles `rpc/access.py` allows it, else in plain text.

    Lifecycle: `start()` once, then `stop(grace_s)` once. `stop` refuses new calls at once,
    waits up to `grace_s` for running ones, then cancels the rest (each cancelled call
    aborts its request in the engine).
    """

    def __init__(self, engine: AsyncEngine, host: str, port: int,
                 services: Sequence[Callable[[grpc.aio.Server], None]] = (),
                 deployment_id: DeploymentId | None = None, tls: TlsConfig | None = None,
                 worker_id: WorkerId | None = None) -> None:
        self._server = aio_server(SERVER_OPTIONS)
        self._tls = tls
        self._output_streams = add_worker_service(self._server, engine, deployment_id, worker_id).output_streams
        for add_service in services:  # e.g. the KvTransfer service of a prefill worker
            add_service(self._server)
        self._address = f"{host}:{port}"
        self.port: int | None = None  # the bound port, once started

    async def start(self) -> int:
        """Listen and serve; returns the bound port. Raises ConfigError if it cannot bind."""
        try:
            port = add_port(self._server, self._address, self._tls)
        except RuntimeError as exc:
            raise ConfigError("port", self._address, f"cannot listen: {exc}") from exc
        if port == 0:
            raise ConfigError("port", self._address, "cannot listen (address in use?)")
        await self._server.start()
        self.port = port
        log.info("worker serving gRPC on %s (port %d, %s)", self._address, port,
                 "plain text" if self._tls is None else f"mutual TLS as {self._tls.identity!r}")
        return port

    async def stop(self, grace_s: float) -> None:
        stopping = asyncio.create_task(self._server.stop(grace_s))
        await self._output_streams.close_when_idle(grace_s)  # routers' output streams never end by themselves
        await stopping
        log.info("worker stopped")


async def serve_until_stopped(
    engine: AsyncEngine, host: str, port: int, stop: asyncio.Event, grace_s: float,
    services: Sequence[Callable[[grpc.aio.Server], None]] = (), deployment_id: DeploymentId | None = None,
    tls: TlsConfig | None = None, health_port: int | None = None, worker_id: WorkerId | None = None,
) -> None:
    """Serve `engine` until `stop` is set, then drain for at most `grace_s` seconds: new
    requests are refused at once (`DrainGate`; `engine` may be one already, which a prefill
    worker's orders pass too) while the server still answers, so health says why and the
    running streams finish; then the server stops, cancelling what still runs.
    `health_port` (0: any free port): grpc.health.v1 alone in plain text there too. `worker_id`:
    the id GetInfo answers (routers name it to decode workers with our address)."""
    gate = engine if isinstance(engine, DrainGate) else DrainGate(engine)
    health = HealthService()
    await health.report(not_serving_reason(gate) is None)
    server = WorkerServer(gate, host, port, [*services, health.add_to], deployment_id, tls, worker_id)
    plain = PlainHealthServer(health, host, health_port) if health_port is not None else None
    await server.start()
    if plain is not None:
        log.info("grpc.health.v1 in plain text on %s:%d", host, await plain.start())
    reporting = asyncio.create_task(report_health(gate, health))
    remaining_s = grace_s
    try:
        await stop.wait()
        remaining_s = await drain(gate, grace_s, health)
    finally:  # calls outside the gate (KV events, LoRA loads) get what is left of the grace
        reporting.cancel()
        await server.stop(remaining_s)
        if plain is not None:
            await plain.stop()


async def report_health(engine: AsyncEngine, health: HealthService) -> None:
    """Keep `health`'s readiness on what `engine` answers, until cancelled."""
    while True:
        await health.report(not_serving_reason(engine) is None)
        await asyncio.sleep(HEALTH_POLL_S)


async def drain(gate: DrainGate, grace_s: float, health: HealthService) -> float:
    """Close `gate` and wait for its running requests, up to `grace_s`; the seconds left.
    `health` answers NOT_SERVING from the moment the gate closes."""
    deadline = time.monotonic() + grace_s
    gate.close(f"draining: shutting down, finishing running requests within {grace_s:g} s; "
               "new requests go to another worker")
    await health.report(False)
    log.info("draining: %d requests running, waiting up to %g s", gate.num_running, grace_s)
    if not await gate.wait_idle(grace_s):
        log.warning("drain timeout: cancelling %d requests still running", gate.num_running)
    return max(deadline - time.monotonic(), 0.0)
