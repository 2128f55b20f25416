"""The Worker gRPC service: a thin shell that turns RPCs into calls of the engine it serves.

One cleanup owner per request: whenever a `Generate` call ends before the engine finished
the request (the client cancelled, its deadline passed, the connection dropped, or anything
failed), this servicer calls `engine.abort(request_id)`, so the request's blocks are freed.
"""
import asyncio
import logging
from contextlib import aclosing
from typing import NoReturn

import grpc

from pdserve.common.engine_api import OUTPUT_SINK, AsyncEngine, not_serving_reason
from pdserve.common.errors import (
    DuplicateRequestError,
    EngineWedgedError,
    InvalidRequestError,
    OverloadedError,
    PdserveError,
)
from pdserve.common.ids import DeploymentId, RequestId, WorkerId
from pdserve.common.request import GenerationRequest
from pdserve.rpc import convert
from pdserve.rpc.gen import request_pb2 as rpb
from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.output_stream import OutputHub, OutputQueue
from pdserve.rpc.status import status_of

log = logging.getLogger(__name__)


async def _fail(context: grpc.aio.ServicerContext, exc: PdserveError) -> NoReturn:
    """End the call with `exc`'s status. Always raises (grpc's AbortError)."""
    code, details, metadata = status_of(exc)
    await context.abort(code, details, trailing_metadata=metadata)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one engine, started in `deployment_id` (None: none) as worker `worker_id` (None:
    not told); the server around it owns the lifecycle."""

    def __init__(self, engine: AsyncEngine, deployment_id: DeploymentId | None = None,
                 worker_id: WorkerId | None = None) -> None:
        self._engine = engine
        self._deployment_id = deployment_id
        self._worker_id = worker_id
        self.output_streams = OutputHub()

    async def Generate(
        self, request: rpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            gen_request = convert.request_from_proto(request)
        except PdserveError as exc:  # no request can be made of the message (an unknown guide kind): nothing ran
            await _fail(context, exc)
            return
        prefill_worker = convert.prefill_worker_from_proto(request)
        prefill_worker_id = convert.prefill_worker_id_from_proto(request)
        queue = self.output_streams.get(request.output_stream) if request.HasField("output_stream") else None
        if request.HasField("output_stream") and queue is None:  # never opened here, or closed as this worker stops
            await _fail(context, InvalidRequestError(f"no output stream {request.output_stream!r} is open here",
                                                     "output_stream"))  # nothing ran: the id may be another's
        try:
            if queue is not None:
                await self._stream_to(gen_request, prefill_worker, prefill_worker_id, queue)
            else:
                await self._stream(gen_request, prefill_worker, prefill_worker_id, context)
        except DuplicateRequestError as exc:  # the id names another live request: leave it be
            await _fail(context, exc)
        except (OverloadedError, EngineWedgedError) as exc:  # refused before admission: nothing to abort
            await _fail(context, exc)
        except PdserveError as exc:
            await self._abort_in_engine(gen_request.request_id)
            await _fail(context, exc)
        except BaseException:  # cancelled by the client or its deadline, or a failure
            await self._abort_in_engine(gen_request.request_id)
            raise

    async def _stream(
        self, request: GenerationRequest, prefill_worker: str | None, prefill_worker_id: WorkerId | None,
        context: grpc.aio.ServicerContext
    ) -> None:
        async with aclosing(self._engine.generate(request, prefill_worker, prefill_worker_id)) as outputs:
            async for output in outputs:
                await context.write(convert.output_to_proto(output))

    async def _stream_to(self, request: GenerationRequest, prefill_worker: str | None,
                         prefill_worker_id: WorkerId | None, queue: OutputQueue) -> None:
        """The outputs onto the caller's StreamOutputs call (`queue`); none on this call. The
        engine may put most of them there itself (`OUTPUT_SINK`): they need nothing on the way."""
        sink = OUTPUT_SINK.set(queue.offer)
        try:
            with self.output_streams.putting():
                async with aclosing(self._engine.generate(request, prefill_worker, prefill_worker_id)) as outputs:
                    async for output in outputs:
                        queue.put(output)  # WorkerUnavailableError once the stream closed: aborted below
        finally:
            OUTPUT_SINK.reset(sink)

    async def StreamOutputs(self, request: wpb.StreamOutputsRequest, context: grpc.aio.ServicerContext) -> None:
        if not request.stream_id:
            await _fail(context, InvalidRequestError("stream_id must not be empty", "stream_id"))
        await self.output_streams.serve(request.stream_id, context)

    async def _abort_in_engine(self, request_id: RequestId) -> None:
        """Abort even if this task is cancelled again while waiting."""
        log.info("aborting request %s: its call ended early", request_id)
        await asyncio.shield(self._engine.abort(request_id))

    async def Abort(
        self, request: wpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> wpb.AbortResponse:
        if not request.request_id:
            await _fail(context, InvalidRequestError("request_id must not be empty", "request_id"))
        await self._engine.abort(RequestId(request.request_id))
        return wpb.AbortResponse()

    async def Health(
        self, request: wpb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> wpb.HealthResponse:
        reason = not_serving_reason(self._engine)
        if reason is not None:
            return wpb.HealthResponse(status=wpb.SERVING_STATUS_NOT_SERVING, reason=reason)
        return wpb.HealthResponse(status=wpb.SERVING_STATUS_SERVING)

    async def GetStats(
        self, request: wpb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.GetStatsResponse:
        try:
            stats = self._engine.stats()
        except PdserveError as exc:  # e.g. wedged: the router's load poll hears why
            await _fail(context, exc)
        return wpb.GetStatsResponse(stats=convert.stats_to_proto(stats))

    async def GetInfo(
        self, request: wpb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> wpb.GetInfoResponse:
        return wpb.GetInfoResponse(info=convert.info_to_proto(self._engine.info()),
                                   deployment_id=self._deployment_id or "", worker_id=self._worker_id or "")

    async def CheckKvIntegrity(
        self, request: wpb.CheckKvIntegrityRequest, context: grpc.aio.ServicerContext
    ) -> wpb.CheckKvIntegrityResponse:
        report = await self._engine.check_integrity()
        return wpb.CheckKvIntegrityResponse(ok=report.ok, error=report.error,
                                            num_held_for_peer=report.num_held_for_peer,
                                            num_used_blocks=report.num_used_blocks)


def add_worker_service(server: grpc.aio.Server, engine: AsyncEngine, deployment_id: DeploymentId | None = None,
                       worker_id: WorkerId | None = None) -> WorkerServicer:
    """Serve `engine` as the Worker service of `server`."""
    servicer = WorkerServicer(engine, deployment_id, worker_id)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    return servicer
