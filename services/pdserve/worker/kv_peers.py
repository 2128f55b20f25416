"""A decode worker's connections to prefill workers: one gRPC channel and one NIXL handshake each.

A peer that fails a call is forgotten (channel closed, transport peer removed), so the next
request re-handshakes with whatever now answers at that address (it may have restarted).
"""
import asyncio
import logging

from pdserve.common.disagg import PrefillOrder, PrefillResult
from pdserve.common.errors import PdserveError
from pdserve.common.ids import WorkerId
from pdserve.rpc.kv_transfer_client import KvTransferClient
from pdserve.transfer.interface import KvTransport

log = logging.getLogger(__name__)


class PrefillPeer:
    def __init__(self, address: str, peer_id: WorkerId, client: KvTransferClient) -> None:
        self.address = address
        self.peer_id = peer_id
        self._client = client

    async def prefill(self, order: PrefillOrder, timeout_s: float) -> PrefillResult:
        return await self._client.prefill(order, timeout_s)

    async def close(self) -> None:
        await self._client.close()


class PrefillPeers:
    """Handshakes once per prefill worker address and caches the result."""

    def __init__(self, transport: KvTransport, rpc_timeout_s: float = 10.0) -> None:
        self._transport = transport
        self._rpc_timeout_s = rpc_timeout_s
        self._peers: dict[str, PrefillPeer] = {}
        self._lock = asyncio.Lock()

    async def get(self, address: str) -> PrefillPeer:
        """The connected peer at `address`; raises IncompatiblePeerError, TransferError or
        WorkerUnavailableError when it cannot be used."""
        async with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                peer = await self._connect(address)
                self._peers[address] = peer
            return peer

    async def forget(self, address: str) -> None:
        async with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            self._transport.remove_peer(peer.peer_id)
            await peer.close()

    async def close(self) -> None:
        for address in list(self._peers):
            await self.forget(address)

    async def _connect(self, address: str) -> PrefillPeer:
        client = KvTransferClient(address)
        try:
            peer_id, metadata = await client.handshake(self._transport.worker_id, self._transport.local_metadata(),
                                                       self._rpc_timeout_s)
            await asyncio.to_thread(self._transport.add_peer, peer_id, metadata)
        except PdserveError:
            await client.close()
            raise
        log.info("KV peer %s at %s connected", peer_id, address)
        return PrefillPeer(address, peer_id, client)
