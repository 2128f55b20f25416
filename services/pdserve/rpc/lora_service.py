"""The LoraAdapters gRPC service: a thin shell over the worker's adapter registry."""
from typing import NoReturn, Protocol

import grpc

from pdserve.common.errors import PdserveError
from pdserve.common.stats import LoraAdapterInfo
from pdserve.rpc import convert
from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.status import status_of


class LoraControl(Protocol):
    """What the service needs: load raises InvalidRequestError, unload UnknownLoraAdapterError."""

    async def load(self, name: str, path: str) -> LoraAdapterInfo: ...

    async def unload(self, name: str) -> None: ...


async def _fail(context: grpc.aio.ServicerContext, exc: PdserveError) -> NoReturn:
    code, details, metadata = status_of(exc)
    await context.abort(code, details, trailing_metadata=metadata)


class LoraAdaptersServicer(worker_pb2_grpc.LoraAdaptersServicer):
    def __init__(self, control: LoraControl) -> None:
        self._control = control

    async def LoadLoraAdapter(self, request: wpb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> wpb.LoadLoraAdapterResponse:
        try:
            adapter = await self._control.load(request.lora_name, request.lora_path)
        except PdserveError as exc:
            await _fail(context, exc)
        return wpb.LoadLoraAdapterResponse(adapter=convert.lora_to_proto(adapter))

    async def UnloadLoraAdapter(self, request: wpb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> wpb.UnloadLoraAdapterResponse:
        try:
            await self._control.unload(request.lora_name)
        except PdserveError as exc:
            await _fail(context, exc)
        return wpb.UnloadLoraAdapterResponse()


def add_lora_service(server: grpc.aio.Server, control: LoraControl) -> None:
    worker_pb2_grpc.add_LoraAdaptersServicer_to_server(LoraAdaptersServicer(control), server)
