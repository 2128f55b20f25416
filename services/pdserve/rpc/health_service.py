"""The standard gRPC health service (`grpc.health.v1.Health`) of a worker: what Kubernetes'
grpc probes, `grpc_health_probe` and the compose health checks ask.

Names answered (Check and Watch); any other is NOT_FOUND, as the standard says:
- "" (the server as a whole) and "pdserve.v1.Worker": readiness. SERVING while the worker takes
  new requests; NOT_SERVING while it drains and while its engine is wedged or failed (the
  Worker service's own Health RPC says why; the router reads that one).
- "liveness": SERVING while the process answers at all, draining included, so that a liveness
  probe never restarts a worker that is finishing its requests.

It is served on the worker's gRPC port (mutual TLS, like everything there) and, given a health
port, alone on a plain-text server of its own (`PlainHealthServer`): a Kubernetes grpc probe
cannot present a client certificate, and a port that answers only health leaks nothing else.
"""
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.common.errors import ConfigError
from pdserve.rpc.gen import worker_pb2

READINESS_NAMES = (health.OVERALL_HEALTH, worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name)
LIVENESS_NAME = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService:
    """One worker's health statuses; `add_to` every server that should answer them, and
    `report` once before they start (until then grpc's servicer answers SERVING for "")."""

    def __init__(self) -> None:
        self._servicer = health.aio.HealthServicer()
        self.is_ready: bool | None = None  # the last status reported

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    async def report(self, is_ready: bool) -> None:
        """Readiness now; Watch callers hear a change at once."""
        if is_ready == self.is_ready:
            return
        self.is_ready = is_ready
        for name in READINESS_NAMES:
            await self._servicer.set(name, SERVING if is_ready else NOT_SERVING)
        await self._servicer.set(LIVENESS_NAME, SERVING)


class PlainHealthServer:
    """`health` alone, in plain text, on `host:port` (0: any free port)."""

    def __init__(self, health_service: HealthService, host: str, port: int) -> None:
        self._server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
        health_service.add_to(self._server)
        self._address = f"{host}:{port}"

    async def start(self) -> int:
        """Listen and serve; the bound port. ConfigError if it cannot bind."""
        try:
            port = self._server.add_insecure_port(self._address)
        except RuntimeError as exc:
            raise ConfigError("--health-port", self._address, f"cannot listen: {exc}") from exc
        if port == 0:
            raise ConfigError("--health-port", self._address, "cannot listen (address in use?)")
        await self._server.start()
        return port

    async def stop(self) -> None:
        await self._server.stop(None)

