"""A decode worker's client of one prefill worker's KvTransfer service: typed calls, typed errors."""
import grpc

from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.pki import PREFILL_WORKER_NAME
from pdserve.common.tls import TlsConfig
from pdserve.rpc import kv_transfer as convert
from pdserve.rpc.gen import kv_transfer_pb2_grpc
from pdserve.rpc.status import error_from_rpc
from pdserve.rpc.tls import aio_channel


class KvTransferClient:
    """One channel to the KvTransfer service at `address`; a failed call raises the typed
    error of `rpc.status.error_from_rpc` (unreachable, deadline, or the peer's own error).
    `tls`: mutual TLS under our certificate, to a server whose certificate names `server_name`:
    a prefill worker's, by default, or one prefill worker's (`pki.identity_name`); any other is
    unreachable: our grant key and NIXL metadata go to the prefill worker we mean only. None:
    plain text."""

    def __init__(self, address: str, tls: TlsConfig | None = None, server_name: str = PREFILL_WORKER_NAME) -> None:
        self.address = address
        self._channel = aio_channel(address, tls, server_name)
        self._stub = kv_transfer_pb2_grpc.KvTransferStub(self._channel)

    async def handshake(self, hello: Hello, timeout_s: float) -> Hello:
        """Send our hello (transport metadata, deployment, grant key); the peer's comes back."""
        try:
            reply = await self._stub.Handshake(convert.hello_to_request(hello), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.address, timeout_s) from exc
        return convert.hello_from_reply(reply)

    async def prefill(self, order: PrefillOrder, timeout_s: float) -> PrefillResult:
        try:
            reply = await self._stub.Prefill(convert.order_to_proto(order), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.address, timeout_s) from exc
        return convert.result_from_proto(reply)

    async def close(self) -> None:
        await self._channel.close()
