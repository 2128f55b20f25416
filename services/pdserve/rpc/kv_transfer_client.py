"""A decode worker's client of one prefill worker's KvTransfer service: typed calls, typed errors."""
import grpc

from pdserve.common.disagg import PrefillOrder, PrefillResult
from pdserve.common.ids import WorkerId
from pdserve.rpc import kv_transfer as convert
from pdserve.rpc.gen import kv_transfer_pb2_grpc
from pdserve.rpc.status import error_from_rpc


class KvTransferClient:
    """One channel to the KvTransfer service at `address`; a failed call raises the typed
    error of `rpc.status.error_from_rpc` (unreachable, deadline, or the peer's own error)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = kv_transfer_pb2_grpc.KvTransferStub(self._channel)

    async def handshake(self, worker_id: WorkerId, metadata: bytes, timeout_s: float) -> tuple[WorkerId, bytes]:
        """Send our transport metadata; the peer's worker id and metadata come back."""
        try:
            reply = await self._stub.Handshake(convert.handshake(worker_id, metadata), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.address, timeout_s) from exc
        return WorkerId(reply.worker_id), reply.metadata

    async def prefill(self, order: PrefillOrder, timeout_s: float) -> PrefillResult:
        try:
            reply = await self._stub.Prefill(convert.order_to_proto(order), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.address, timeout_s) from exc
        return convert.result_from_proto(reply)

    async def close(self) -> None:
        await self._channel.close()
