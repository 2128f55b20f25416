"""Who may call what on a worker: every method of every service a worker serves, called with a
certificate of each role, is refused (PERMISSION_DENIED) before its handler runs unless
`rpc/access.POLICY` names that role; the real worker server applies the same policy."""
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pdserve.common import pki
from pdserve.common.errors import PermissionDeniedError
from pdserve.common.tls import TlsConfig
from pdserve.rpc.access import POLICY
from pdserve.rpc.gen import kv_events_pb2, kv_transfer_pb2, worker_pb2
from pdserve.rpc.tls import add_port, aio_channel, aio_server
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.worker.server import WorkerServer
from tests.unit.worker.fake_engine import FakeEngine, make_request

AUTHORITY = pki.Authority.create("test")
CREDENTIALS = {role: TlsConfig.from_issued(AUTHORITY.issue(f"{role}-0", role)) for role in pki.Role}
SERVICES = [worker_pb2.DESCRIPTOR.services_by_name["Worker"], worker_pb2.DESCRIPTOR.services_by_name["LoraAdapters"],
            kv_events_pb2.DESCRIPTOR.services_by_name["KvEvents"],
            kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"], health_pb2.DESCRIPTOR.services_by_name["Health"]]
IS_STREAMING = {f"/{s.full_name}/{m.name}": m.server_streaming for s in SERVICES for m in s.methods}


def test_the_policy_names_every_method_a_worker_serves_and_nothing_else() -> None:
    assert sorted(POLICY) == sorted(IS_STREAMING)


def test_the_policy_table() -> None:
    """What README and docs/architecture.md say, method by method."""
    by_callers: dict[str, list[str]] = {}
    for method, roles in POLICY.items():
        by_callers.setdefault(",".join(sorted(roles)), []).append(method.rsplit("/", 1)[1])
    assert by_callers == {
        "router": ["Generate", "StreamOutputs", "Abort", "GetStats", "CheckKvIntegrity", "LoadLoraAdapter",
                   "UnloadLoraAdapter", "Subscribe", "Snapshot"],
        "probe,router": ["Health", "GetInfo"],
        "decode": ["Handshake", "Prefill"],
        "both,decode,prefill,probe,router": ["Check", "Watch", "List"],
    }


class RecordingServer:
    """Every method of `SERVICES` as a handler that records its call and answers empty bytes."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.server = aio_server()
        for service in SERVICES:
            handlers = {m.name: self._handler(f"/{service.full_name}/{m.name}", m.server_streaming)
                        for m in service.methods}
            self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service.full_name, handlers)])

    def _handler(self, method: str, is_streaming: bool) -> grpc.RpcMethodHandler:
        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.calls.append(method)
            return b""

        async def stream(request: bytes, context: grpc.aio.ServicerContext):
            self.calls.append(method)
            yield b""
        if is_streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)


async def call(channel: grpc.aio.Channel, method: str) -> object:
    """"ok", or the status code the call ended with."""
    try:
        if IS_STREAMING[method]:
            async for _ in channel.unary_stream(method)(b"", timeout=5.0):
                pass
        else:
            await channel.unary_unary(method)(b"", timeout=5.0)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return "ok"


@pytest.mark.parametrize("method", sorted(IS_STREAMING))
def test_each_method_answers_only_the_roles_the_policy_names(method: str) -> None:
    async def scenario() -> tuple[dict[pki.Role, object], list[str]]:
        recording = RecordingServer()
        port = add_port(recording.server, "127.0.0.1:0", CREDENTIALS[pki.Role.PREFILL])
        await recording.server.start()
        outcomes = {}
        try:
            for role in pki.Role:
                async with aio_channel(f"127.0.0.1:{port}", CREDENTIALS[role], pki.WORKER_NAME) as channel:
                    outcomes[role] = await call(channel, method)
        finally:
            await recording.server.stop(0)
        return outcomes, recording.calls

    outcomes, calls = asyncio.run(asyncio.wait_for(scenario(), 60))
    allowed = POLICY[method]
    assert outcomes == {role: "ok" if role in allowed else grpc.StatusCode.PERMISSION_DENIED for role in pki.Role}
    assert calls == [method] * len(allowed)  # a refused call never reached its handler


def test_a_plain_text_server_knows_no_roles_and_answers_every_method() -> None:
    async def scenario() -> tuple[list[object], list[str]]:
        recording = RecordingServer()
        port = add_port(recording.server, "127.0.0.1:0", None)
        await recording.server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}", None, pki.WORKER_NAME) as channel:
                return [await call(channel, method) for method in sorted(IS_STREAMING)], recording.calls
        finally:
            await recording.server.stop(0)

    outcomes, calls = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert outcomes == ["ok"] * len(IS_STREAMING) and calls == sorted(IS_STREAMING)


def test_the_worker_server_refuses_another_workers_certificate_before_the_engine_hears_of_it() -> None:
    """A prefill worker's certificate cannot generate (naming a prefill address of its choosing)
    or abort on a decode worker; the router's can."""
    async def scenario() -> tuple[list[object], FakeEngine]:
        engine = FakeEngine()
        server = WorkerServer(engine, "127.0.0.1", 0, tls=CREDENTIALS[pki.Role.DECODE])
        address = f"127.0.0.1:{await server.start()}"
        outcomes: list[object] = []
        try:
            for role in (pki.Role.PREFILL, pki.Role.ROUTER):
                backend = GrpcBackend(address, rpc_timeout_s=5.0, tls=CREDENTIALS[role])
                try:
                    outputs = [o async for o in backend.generate(make_request(f"r-{role}"), "10.6.6.6:50051")]
                    await backend.abort(make_request(f"r-{role}").request_id)
                    outcomes.append(len(outputs))
                except PermissionDeniedError as exc:
                    outcomes.append(str(exc).split(": ", 1)[1])
                finally:
                    await backend.close()
        finally:
            await server.stop(0)
        return outcomes, engine

    outcomes, engine = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert outcomes == ["/pdserve.v1.Worker/StreamOutputs is open to router; the caller 'prefill-0' has role 'prefill'",
                        3]
    assert engine.prefill_workers == ["10.6.6.6:50051"] and engine.aborted == ["r-router"]
