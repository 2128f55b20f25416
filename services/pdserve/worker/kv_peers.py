"""A decode worker's connections to prefill workers: one gRPC channel and one NIXL handshake each.

A peer that fails a call is forgotten (channel closed, transport peer removed), so the next
request re-handshakes with whatever now answers at that address (it may have restarted).
"""
import asyncio
import logging

import grpc

from pdserve.common.disagg import PrefillOrder, PrefillResult
from pdserve.common.errors import PdserveError
from pdserve.common.ids import WorkerId
from pdserve.rpc import kv_transfer as convert
from pdserve.rpc.gen import kv_transfer_pb2_grpc
from pdserve.rpc.status import error_from_rpc
from pdserve.transfer.interface import KvTransport

log = logging.getLogger(__name__)


class PrefillPeer:
    def __init__(self, address: str, peer_id: WorkerId, channel: grpc.aio.Channel) -> None:
        self.address = address
        self.peer_id = peer_id
        self._channel = channel
        self._stub = kv_transfer_pb2_grpc.KvTransferStub(channel)

    async def prefill(self, order: PrefillOrder, timeout_s: float) -> PrefillResult:
        try:
            reply = await self._stub.Prefill(convert.order_to_proto(order), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.address, timeout_s) from exc
        return convert.result_from_proto(reply)

    async def close(self) -> None:
        await self._channel.close()


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
        channel = grpc.aio.insecure_channel(address)
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        request = convert.handshake(self._transport.worker_id, self._transport.local_metadata())
        try:
            reply = await stub.Handshake(request, timeout=self._rpc_timeout_s)
            await asyncio.to_thread(self._transport.add_peer, WorkerId(reply.worker_id), reply.metadata)
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            raise error_from_rpc(exc, address, self._rpc_timeout_s) from exc
        except PdserveError:
            await channel.close()
            raise
        log.info("KV peer %s at %s connected", reply.worker_id, address)
        return PrefillPeer(address, WorkerId(reply.worker_id), channel)
