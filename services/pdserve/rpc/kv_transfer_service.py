"""The KvTransfer gRPC service: a thin shell over a prefill worker's `KvTransferHandler`.

Over mutual TLS the caller's certificate names who it is, and a call may speak only for that
identity or an instance of it (`<identity>/<pod>`, `common/tls.speaks_for`): a handshake's
worker id, and a prefill order's decode worker, must be the caller's (PERMISSION_DENIED
otherwise, before the handler sees the call). So a peer is replaced only by the same identity,
and no caller orders writes into another worker's blocks.
"""
from typing import Protocol

import grpc

from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.errors import PdserveError, PermissionDeniedError
from pdserve.rpc import kv_transfer as convert
from pdserve.rpc.gen import kv_transfer_pb2_grpc
from pdserve.rpc.status import status_of
from pdserve.common.tls import speaks_for
from pdserve.rpc.tls import caller_identity


class KvTransferHandler(Protocol):
    """What the service calls; a PdserveError it raises ends the call with that error's status."""

    async def handshake(self, hello: Hello) -> Hello:
        """Admit the peer's transport metadata; our hello in return."""

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        """Compute the prompt and push its missing KV blocks into the peer's reserved ones."""


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    def __init__(self, handler: KvTransferHandler) -> None:
        self._handler = handler

    async def Handshake(self, request, context: grpc.aio.ServicerContext):
        try:
            hello = convert.hello_from_request(request)
            _check_speaks_for(context, hello.worker_id, "handshake as")
            reply = await self._handler.handshake(hello)
        except PdserveError as exc:
            await _fail(context, exc)
        return convert.hello_to_reply(reply)

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        try:
            order = convert.order_from_proto(request)
            _check_speaks_for(context, order.decode_worker_id, "order writes into the blocks of")
            result = await self._handler.prefill(order)
        except PdserveError as exc:
            await _fail(context, exc)
        return convert.result_to_proto(result)


def add_kv_transfer_service(server: grpc.aio.Server, handler: KvTransferHandler) -> None:
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(handler), server)


def _check_speaks_for(context: grpc.aio.ServicerContext, worker_id: str, action: str) -> None:
    identity = caller_identity(context)
    if identity is not None and not speaks_for(identity, worker_id):
        raise PermissionDeniedError(f"a caller with identity {identity!r} may not {action} {worker_id!r}")


async def _fail(context: grpc.aio.ServicerContext, exc: PdserveError) -> None:
    code, details, metadata = status_of(exc)
    await context.abort(code, details, metadata)
