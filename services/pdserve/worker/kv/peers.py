"""A decode worker's connections to prefill workers: one gRPC channel and one NIXL handshake each.

Handshakes to different addresses run independently (one lock per address), so an unreachable
prefill worker delays only the requests sent to it, and after a failed handshake the address is
not dialled again for `RETRY_AFTER_S` (its requests prefill locally meanwhile). A peer that stops answering is retired:
the next request re-handshakes with whatever now answers at that address (it may have
restarted), while calls already in flight on the old channel finish on it — retiring a peer
never cancels another request's prefill (and with it, a reservation a write may still reach).
Each connection has a fresh write-grant key (`write_grants.py`), sent in its handshake; every
order on it carries a grant under that key. A peer of another deployment is refused.

Under TLS a request may name the prefill worker it expects at an address (its id, as the router
learned it): the channel then accepts only that worker's certificate (`pki.identity_name`), so
another prefill worker answering there never sees our hello, and its handshake reply must speak
for that identity. One connection per address: a peer checked for an identity serves requests
that name it or none; one that names another identity replaces it (a new handshake), and a
request naming none reuses whatever is connected (a prefill worker, checked by role).
"""
import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.errors import PdserveError, PermissionDeniedError, WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.pki import PREFILL_WORKER_NAME, identity_name
from pdserve.common.tls import TlsConfig, identity_of_worker, speaks_for
from pdserve.rpc.kv_transfer_client import KvTransferClient
from pdserve.transfer.interface import KvTransport
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.worker.kv.write_grants import granted, new_order_key

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0


class PrefillPeer:
    def __init__(self, address: str, peer_id: WorkerId, client: KvTransferClient, order_key: bytes,
                 lora_ids: frozenset[int] = frozenset(), our_lora_ids: frozenset[int] = frozenset(),
                 identity: str | None = None) -> None:
        self.address = address
        self.peer_id = peer_id
        self.identity = identity  # the certificate identity checked at the handshake; None: its role only
        self.lora_ids = lora_ids  # the LoRA adapters it held at the handshake
        self.our_lora_ids = our_lora_ids  # and those we held then
        self._client = client
        self._order_key = order_key
        self._in_flight = 0
        self._retired = False

    async def prefill(self, order: PrefillOrder, timeout_s: float) -> PrefillResult:
        self._in_flight += 1
        try:
            return await self._client.prefill(granted(self._order_key, order), timeout_s)
        finally:
            self._in_flight -= 1
            if self._retired and self._in_flight == 0:
                await asyncio.shield(self._client.close())

    async def retire(self) -> None:
        """No new calls; the channel closes once the calls on it have ended."""
        self._retired = True
        if self._in_flight == 0:
            await self._client.close()


class PrefillPeers:
    """Handshakes once per prefill worker address and caches the result."""

    def __init__(self, transport: KvTransport, rpc_timeout_s: float = 10.0, *, deployment_id: str = "",
                 tls: TlsConfig | None = None, lora_ids: Callable[[], frozenset[int]] = frozenset) -> None:
        self._transport = transport
        self.lora_ids = lora_ids  # the LoRA adapters we hold now
        self._rpc_timeout_s = rpc_timeout_s
        self._deployment_id = deployment_id
        self._tls = tls
        self._peers: dict[str, PrefillPeer] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # (address, identity expected there) -> when to dial it again after a failed handshake
        self._retry_at: dict[tuple[str, str | None], float] = {}

    @property
    def layout(self) -> KvLayoutSpec:
        """Our KV layout, which every peer agreed to at its handshake (windows included)."""
        return self._transport.spec

    async def get(self, address: str, worker_id: str | None = None) -> PrefillPeer:
        """The connected peer at `address`: under TLS, with `worker_id` (a worker id or an
        identity), the prefill worker of that certificate identity, else any prefill worker.
        Raises IncompatiblePeerError, PermissionDeniedError, TransferError or
        WorkerUnavailableError when it cannot be used."""
        identity = identity_of_worker(worker_id) if worker_id and self._tls is not None else None
        async with self._locks[address]:
            peer = self._peers.get(address)
            if peer is not None and identity in (None, peer.identity):
                return peer
            wait_s = self._retry_at.get((address, identity), 0.0) - time.monotonic()
            if wait_s > 0:
                raise WorkerUnavailableError(address, f"its last KV handshake failed; next try in {wait_s:.1f} s")
            try:
                fresh = await self._connect(address, identity)
            except PdserveError:
                self._retry_at[(address, identity)] = time.monotonic() + RETRY_AFTER_S
                raise
            self._retry_at.pop((address, identity), None)
            self._peers[address] = fresh
        if peer is not None:  # checked for another identity, or for none: replaced
            await peer.retire()
        return fresh

    async def forget(self, peer: PrefillPeer) -> None:
        """Retire `peer` if it is still the one cached for its address (a newer handshake
        may have replaced it). Its NIXL registration stays: a re-handshake replaces it."""
        async with self._locks[peer.address]:
            if self._peers.get(peer.address) is not peer:
                return
            del self._peers[peer.address]
        await peer.retire()

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            await self.forget(peer)
            self._transport.remove_peer(peer.peer_id)

    async def _connect(self, address: str, identity: str | None) -> PrefillPeer:
        """Handshake with the prefill worker at `address`, of certificate identity `identity`
        (None: any prefill worker)."""
        server_name = PREFILL_WORKER_NAME if identity is None else identity_name(identity, PREFILL_WORKER_NAME)
        client = KvTransferClient(address, self._tls, server_name)
        order_key = new_order_key()
        ours = self.lora_ids()
        hello = Hello(self._transport.worker_id, self._transport.local_metadata(), self._deployment_id, order_key, ours)
        try:
            reply = await client.handshake(hello, self._rpc_timeout_s)
            if identity is not None and not speaks_for(identity, reply.worker_id):
                raise PermissionDeniedError(f"{address}: the prefill worker of identity {identity!r} answered as "
                                            f"{reply.worker_id!r}")
            if reply.deployment_id != self._deployment_id:
                raise PermissionDeniedError(f"{address}: prefill worker {reply.worker_id!r} belongs to deployment "
                                            f"{reply.deployment_id!r}, not {self._deployment_id!r}")
            await asyncio.to_thread(self._transport.add_peer, reply.worker_id, reply.metadata)
        except PdserveError:
            await client.close()
            raise
        log.info("KV peer %s at %s connected", reply.worker_id, address)
        if reply.lora_ids != ours:
            log.warning("KV peer %s holds other LoRA adapters than we do (%d of ours it lacks): prompts under "
                        "those are prefilled here", reply.worker_id, len(ours - reply.lora_ids))
        return PrefillPeer(address, reply.worker_id, client, order_key, reply.lora_ids, ours, identity)
