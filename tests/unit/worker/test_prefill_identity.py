"""A decode worker told which prefill worker to use reaches only that one: the TLS handshake
fails when another prefill worker's certificate answers at the address, so that worker never
sees our hello (NIXL metadata, grant key), and the prompt is prefilled here. Real engines and
the real KvTransfer service over mutual TLS (the fake transport between them), as in
test_write_grants.py."""
import pytest

from pdserve.common import pki
from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.errors import PermissionDeniedError, WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.tls import TlsConfig
from pdserve.rpc.kv_transfer_service import KvTransferHandler, add_kv_transfer_service
from pdserve.rpc.tls import add_port, aio_server
from pdserve.worker.disagg import LOCAL, DecodeEngine, DisaggConfig
from pdserve.worker.kv.peers import PrefillPeers
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.prefill_service import PrefillService
from tests.unit.worker.test_disagg_failures import _collect, _request, _run, _until, checkpoint  # noqa: F401

AUTHORITY = pki.Authority.create("test")


def tls(identity: str, role: pki.Role) -> TlsConfig:
    return TlsConfig.from_issued(AUTHORITY.issue(identity, role))


DECODE = tls("d", pki.Role.DECODE)  # the fake transports' decode worker is "d", the prefill worker "p"


class Recording:
    """A KvTransfer handler that notes each call reaching it before passing it on."""

    def __init__(self, inner: KvTransferHandler) -> None:
        self.inner = inner
        self.calls: list[str] = []

    async def handshake(self, hello: Hello) -> Hello:
        self.calls.append(f"handshake {hello.worker_id}")
        return await self.inner.handshake(hello)

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        self.calls.append(f"prefill for {order.decode_worker_id}")
        return await self.inner.prefill(order)


async def serve_as(handler: KvTransferHandler, identity: str):
    """`handler` behind a KvTransfer server on mutual TLS whose certificate is prefill worker `identity`'s."""
    server = aio_server()
    add_kv_transfer_service(server, handler)
    port = add_port(server, "127.0.0.1:0", tls(identity, pki.Role.PREFILL))
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize(("told", "answering"), [("p", "p"), ("p/pod-a", "p"), ("p", "mallory")])
def test_a_decode_worker_hands_its_hello_only_to_the_prefill_worker_it_was_told(checkpoint, told: str,
                                                                                answering: str):
    """`mallory` holds a valid prefill certificate of the same authority and claims to be "p"
    (its handler is p's own): the handshake fails in TLS, before its handler runs."""
    async def body(pair, _):
        handler = Recording(PrefillService(pair.p, pair.tp, TransferMetrics()))
        server, address = await serve_as(handler, answering)
        metrics = TransferMetrics()
        peers = PrefillPeers(pair.td, tls=DECODE)
        decode = DecodeEngine(pair.d, peers, DisaggConfig(WorkerId("d"), 1, 2.0, 0.5, False,
                                                          prefill_queue_timeout_s=1.0), metrics)
        try:
            outputs = await _collect(decode.generate(_request("r"), address, WorkerId(told)))
            local = await _collect(pair.d.generate(_request("l")))
        finally:
            await peers.close()
            await server.stop(0)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in local]
        assert await _until(lambda: pair.used() == (0, 0))
        if answering == "p":
            assert outputs[0].prefilled_by == address
            assert handler.calls == ["handshake d", "prefill for d"]
        else:
            assert outputs[0].prefilled_by == LOCAL
            assert metrics.local_prefills.labels("peer_unavailable")._value.get() == 1
            assert handler.calls == [] and not pair.tp.has_peer(WorkerId("d"))

    _run(checkpoint, body)


class ClaimsAnother:
    """A prefill worker whose handshake reply names a worker id its certificate does not speak for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def handshake(self, hello: Hello) -> Hello:
        self.calls.append(f"handshake {hello.worker_id}")
        return Hello(WorkerId("q"), b"meta")

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        raise AssertionError("never ordered")


def test_a_prefill_worker_answering_as_another_is_no_peer(checkpoint):
    async def body(pair, _):
        handler = ClaimsAnother()
        server, address = await serve_as(handler, "p")
        peers = PrefillPeers(pair.td, tls=DECODE)
        try:
            with pytest.raises(PermissionDeniedError, match="the prefill worker of identity 'p' answered as 'q'"):
                await peers.get(address, "p")
            assert handler.calls == ["handshake d"] and not pair.td.has_peer(WorkerId("q"))
        finally:
            await peers.close()
            await server.stop(0)

    _run(checkpoint, body)


def test_one_peer_per_address_checked_for_the_identity_asked_for(checkpoint):
    """A peer checked for an identity serves requests naming it (or an instance of it) or none;
    one checked by role only is replaced once an identity is named; a failure to reach the
    identity named waits out its retry alone and leaves the connected peer in place."""
    async def body(pair, _):
        handler = Recording(PrefillService(pair.p, pair.tp, TransferMetrics()))
        server, address = await serve_as(handler, "p")
        peers = PrefillPeers(pair.td, tls=DECODE)
        try:
            by_role = await peers.get(address)
            checked = await peers.get(address, "p")
            assert checked is not by_role and (by_role.identity, checked.identity) == (None, "p")
            assert await peers.get(address) is checked and await peers.get(address, "p/pod-b") is checked
            for why in ("unavailable", "next try in"):  # the TLS handshake fails, then waits out RETRY_AFTER_S
                with pytest.raises(WorkerUnavailableError, match=why):
                    await peers.get(address, "mallory")
            assert await peers.get(address, "p") is checked
            assert handler.calls == ["handshake d", "handshake d"]
        finally:
            await peers.close()
            await server.stop(0)

    _run(checkpoint, body)


def test_in_plain_text_the_id_is_not_checked(checkpoint):
    """--insecure-internal: no certificate names anyone, so the id told is not checked (nor can be)."""
    async def body(pair, address):
        peers = PrefillPeers(pair.td)
        try:
            assert (await peers.get(address, "mallory")).peer_id == "p"
        finally:
            await peers.close()

    _run(checkpoint, body)
