"""The KvTransfer gRPC service: a thin shell over a prefill worker's `KvTransferHandler`."""
from typing import Protocol

import grpc

from pdserve.common.disagg import PrefillOrder, PrefillResult
from pdserve.common.errors import PdserveError
from pdserve.common.ids import WorkerId
from pdserve.rpc import kv_transfer as convert
from pdserve.rpc.gen import kv_transfer_pb2_grpc
from pdserve.rpc.status import status_of


class KvTransferHandler(Protocol):
    """What the service calls; a PdserveError it raises ends the call with that error's status."""

    async def handshake(self, peer_id: WorkerId, metadata: bytes) -> tuple[WorkerId, bytes]:
        """Admit the peer's transport metadata; our worker id and metadata."""

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        """Compute the prompt and push its missing KV blocks into the peer's reserved ones."""


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    def __init__(self, handler: KvTransferHandler) -> None:
        self._handler = handler

    async def Handshake(self, request, context: grpc.aio.ServicerContext):
        try:
            worker_id, metadata = await self._handler.handshake(WorkerId(request.worker_id), request.metadata)
        except PdserveError as exc:
            await _fail(context, exc)
        return convert.handshake_reply(worker_id, metadata)

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        try:
            result = await self._handler.prefill(convert.order_from_proto(request))
        except PdserveError as exc:
            await _fail(context, exc)
        return convert.result_to_proto(result)


def add_kv_transfer_service(server: grpc.aio.Server, handler: KvTransferHandler) -> None:
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(handler), server)


async def _fail(context: grpc.aio.ServicerContext, exc: PdserveError) -> None:
    code, details, metadata = status_of(exc)
    await context.abort(code, details, metadata)
