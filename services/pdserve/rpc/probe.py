"""A blocking health probe of a worker, for callers without an event loop (the launcher)."""
import grpc

from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc


def is_worker_serving(address: str, timeout_s: float) -> bool:
    """True if the worker at `address` answers health with SERVING within `timeout_s`;
    False if it is unreachable, not serving yet, or its engine failed."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = worker_pb2_grpc.WorkerStub(channel).Health(wpb.HealthRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == wpb.SERVING_STATUS_SERVING
