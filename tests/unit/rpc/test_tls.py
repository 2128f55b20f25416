"""Mutual TLS on real gRPC servers in one process: a worker answers only callers with a
certificate of its authority, the KvTransfer service lets a caller speak only for the identity
in its certificate, and a client reaches only a server whose certificate is of the role (and,
when it names one, the identity) it means to reach."""
import asyncio

import pytest

from pdserve.common import pki
from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.errors import PermissionDeniedError, WorkerUnavailableError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.tls import TlsConfig
from pdserve.rpc.kv_transfer_client import KvTransferClient
from pdserve.rpc.kv_transfer_service import add_kv_transfer_service
from pdserve.rpc.probe import is_worker_serving
from pdserve.rpc.tls import add_port, aio_server
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.worker.server import WorkerServer
from tests.unit.worker.fake_engine import FakeEngine

AUTHORITY = pki.Authority.create("test")
STRANGER = pki.Authority.create("another deployment")


def tls(identity: str, role: pki.Role, authority: pki.Authority = AUTHORITY) -> TlsConfig:
    return TlsConfig.from_issued(authority.issue(identity, role))


ROUTER = tls("router", pki.Role.ROUTER)


def test_a_worker_answers_only_callers_with_a_certificate_of_its_authority(tmp_path) -> None:
    AUTHORITY.issue("probe", pki.Role.PROBE).write(tmp_path)

    async def scenario() -> list[object]:
        server = WorkerServer(FakeEngine(), "127.0.0.1", 0, tls=tls("decode-0", pki.Role.DECODE))
        address = f"127.0.0.1:{await server.start()}"
        answers: list[object] = []
        try:
            for credentials in (None, tls("router", pki.Role.ROUTER, STRANGER), ROUTER):
                backend = GrpcBackend(address, rpc_timeout_s=5.0, tls=credentials)
                try:
                    answers.append((await backend.info()).model.model_name)
                except WorkerUnavailableError as exc:
                    answers.append(type(exc))
                finally:
                    await backend.close()
            answers.append(await asyncio.to_thread(is_worker_serving, address, 5.0, None, str(tmp_path)))
            answers.append(await asyncio.to_thread(is_worker_serving, address, 5.0))  # plain text
        finally:
            await server.stop(0)
        return answers

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [
        WorkerUnavailableError, WorkerUnavailableError, "tiny-llama", True, False]


class RecordingHandler:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def handshake(self, hello: Hello) -> Hello:
        self.calls.append(f"handshake {hello.worker_id}")
        return Hello(WorkerId("prefill-0"), b"meta")

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        self.calls.append(f"prefill for {order.decode_worker_id}")
        return PrefillResult(1, None, 0, 0, 0)


def order_for(decode_worker_id: str) -> PrefillOrder:
    request = GenerationRequest(RequestId("r"), (1, 2, 3), SamplingParams(max_tokens=1))
    return PrefillOrder(request, WorkerId(decode_worker_id), 0, (), 5.0)


def test_a_caller_speaks_only_for_the_identity_in_its_certificate() -> None:
    async def scenario() -> tuple[list[object], list[str]]:
        handler = RecordingHandler()
        server = aio_server()
        add_kv_transfer_service(server, handler)
        port = add_port(server, "127.0.0.1:0", tls("prefill-0", pki.Role.PREFILL))
        await server.start()
        outcomes: list[object] = []
        try:
            for caller, claimed in (("mallory", "decode-0"), ("mallory", "mallory"), ("decode-0", "decode-0"),
                                    ("decode-0", "decode-0/pod-a"), ("decode-0", "decode-00/pod-a")):
                client = KvTransferClient(f"127.0.0.1:{port}", tls(caller, pki.Role.DECODE))
                for call in (client.handshake(Hello(WorkerId(claimed), b"m"), 5.0),
                             client.prefill(order_for(claimed), 5.0)):
                    try:
                        await call
                        outcomes.append("ok")
                    except PermissionDeniedError as exc:
                        outcomes.append(str(exc).split(": ", 1)[1])
                await client.close()
        finally:
            await server.stop(0)
        return outcomes, handler.calls

    outcomes, calls = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert outcomes == ["a caller with identity 'mallory' may not handshake as 'decode-0'",
                        "a caller with identity 'mallory' may not order writes into the blocks of 'decode-0'",
                        "ok", "ok", "ok", "ok", "ok", "ok",  # an instance of its identity: one pod of a Deployment
                        "a caller with identity 'decode-0' may not handshake as 'decode-00/pod-a'",
                        "a caller with identity 'decode-0' may not order writes into the blocks of 'decode-00/pod-a'"]
    assert calls == ["handshake mallory", "prefill for mallory", "handshake decode-0", "prefill for decode-0",
                     "handshake decode-0/pod-a", "prefill for decode-0/pod-a"]


@pytest.mark.parametrize("who", ["plain text", "another authority"])
def test_the_kv_transfer_service_refuses_a_caller_without_a_certificate_of_its_authority(who: str) -> None:
    async def scenario() -> list[str]:
        handler = RecordingHandler()
        server = aio_server()
        add_kv_transfer_service(server, handler)
        port = add_port(server, "127.0.0.1:0", tls("prefill-0", pki.Role.PREFILL))
        await server.start()
        stranger = tls("decode-0", pki.Role.DECODE, STRANGER)
        client = KvTransferClient(f"127.0.0.1:{port}", None if who == "plain text" else stranger)
        try:
            with pytest.raises(WorkerUnavailableError):
                await client.handshake(Hello(WorkerId("decode-0"), b"m"), 5.0)
        finally:
            await client.close()
            await server.stop(0)
        return handler.calls

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == []


def this_machines_ip() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # a documentation address: nothing is sent, a route is chosen
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_a_worker_dialled_at_an_ip_its_certificate_does_not_name_is_reached_through_its_roles_name() -> None:
    ip = this_machines_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to dial")

    async def scenario() -> tuple[str, type]:
        server = WorkerServer(FakeEngine(), "0.0.0.0", 0, tls=tls("decode-0", pki.Role.DECODE))  # loopback only
        address = f"{ip}:{await server.start()}"
        try:
            backend = GrpcBackend(address, rpc_timeout_s=5.0, tls=ROUTER)
            stranger = GrpcBackend(address, rpc_timeout_s=5.0, tls=tls("router", pki.Role.ROUTER, STRANGER))
            try:
                name = (await backend.info()).model.model_name
                with pytest.raises(WorkerUnavailableError) as refused:
                    await stranger.info()
                return name, type(refused.value)
            finally:
                await backend.close()
                await stranger.close()
        finally:
            await server.stop(0)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == ("tiny-llama", WorkerUnavailableError)


@pytest.mark.parametrize("server_role", list(pki.Role))
def test_the_router_reaches_only_a_server_whose_certificate_is_a_workers(server_role: pki.Role) -> None:
    """A router's or a probe's certificate cannot pose as a worker: the TLS handshake fails."""
    async def scenario() -> object:
        server = WorkerServer(FakeEngine(), "127.0.0.1", 0, tls=tls("decode-0", server_role))
        backend = GrpcBackend(f"127.0.0.1:{await server.start()}", rpc_timeout_s=5.0, tls=ROUTER)
        try:
            return (await backend.info()).model.model_name
        except WorkerUnavailableError as exc:
            return type(exc)
        finally:
            await backend.close()
            await server.stop(0)

    is_worker = server_role in (pki.Role.PREFILL, pki.Role.DECODE, pki.Role.BOTH)
    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == ("tiny-llama" if is_worker else WorkerUnavailableError)



def handshake_with(identity: str, server_role: pki.Role, *server_name: str) -> tuple[object, list[str]]:
    """A decode worker's KV handshake to a KvTransfer server holding `identity`'s certificate in
    `server_role`: the id answered (or the error class) and what the server's handler saw."""
    async def scenario() -> tuple[object, list[str]]:
        handler = RecordingHandler()
        server = aio_server()
        add_kv_transfer_service(server, handler)
        port = add_port(server, "127.0.0.1:0", tls(identity, server_role))
        await server.start()
        client = KvTransferClient(f"127.0.0.1:{port}", tls("decode-0", pki.Role.DECODE), *server_name)
        try:
            return (await client.handshake(Hello(WorkerId("decode-0"), b"m"), 5.0)).worker_id, handler.calls
        except WorkerUnavailableError as exc:
            return type(exc), handler.calls
        finally:
            await client.close()
            await server.stop(0)

    return asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize("server_role", list(pki.Role))
def test_a_decode_worker_hands_its_hello_only_to_a_server_whose_certificate_is_a_prefill_workers(
        server_role: pki.Role) -> None:
    """The hello carries NIXL metadata and the grant key: a server of any other role never sees it."""
    reached = server_role == pki.Role.PREFILL
    assert handshake_with("prefill-0", server_role) == (
        ("prefill-0", ["handshake decode-0"]) if reached else (WorkerUnavailableError, []))


@pytest.mark.parametrize(("identity", "server_role"), [("prefill-0", pki.Role.PREFILL), ("prefill-1", pki.Role.PREFILL),
                                                       ("prefill-0", pki.Role.DECODE), ("prefill-0", pki.Role.BOTH)])
def test_a_decode_worker_told_which_prefill_worker_it_dials_reaches_only_that_one(
        identity: str, server_role: pki.Role) -> None:
    """One name checks role and identity at once: another prefill worker's certificate, or a
    certificate of prefill-0's identity in another role, fails the TLS handshake."""
    reached = (identity, server_role) == ("prefill-0", pki.Role.PREFILL)
    assert handshake_with(identity, server_role, pki.identity_name("prefill-0", pki.PREFILL_WORKER_NAME)) == (
        ("prefill-0", ["handshake decode-0"]) if reached else (WorkerUnavailableError, []))
