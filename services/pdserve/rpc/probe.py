"""Blocking health probes of a worker, for callers without an event loop (the launcher, health
check commands)."""
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.ids import DeploymentId
from pdserve.common.pki import WORKER_NAME
from pdserve.common.tls import TlsConfig
from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.tls import sync_channel


def is_worker_serving(address: str, timeout_s: float, deployment_id: DeploymentId | None = None,
                      tls: TlsConfig | str | None = None) -> bool:
    """True if the worker at `address` answers health with SERVING within `timeout_s` and, given
    `deployment_id`, belongs to that deployment; False if it is unreachable, not serving yet,
    another deployment's, or its engine failed. `tls`: our credentials (or a TLS folder, as a
    Kubernetes probe names it) for a worker serving mutual TLS, of role probe or router (the
    roles a worker answers these calls for); None: plain text."""
    credentials = TlsConfig.from_dir(tls) if isinstance(tls, str) else tls
    with sync_channel(address, credentials, WORKER_NAME) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            if stub.Health(wpb.HealthRequest(), timeout=timeout_s).status != wpb.SERVING_STATUS_SERVING:
                return False
            if deployment_id is None:
                return True
            return bool(stub.GetInfo(wpb.GetInfoRequest(), timeout=timeout_s).deployment_id == deployment_id)
        except grpc.RpcError:
            return False


def is_health_serving(address: str, timeout_s: float, name: str = "") -> bool:
    """True if the plain-text grpc.health.v1 service at `address` (a worker's `--health-port`)
    answers SERVING for `name` ("": ready; "liveness") within `timeout_s`; False if it answers
    otherwise or cannot be reached. What the compose health checks run."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                             timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
