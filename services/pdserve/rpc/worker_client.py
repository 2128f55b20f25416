"""The router's client of one worker: `GenerateBackend` over the worker's gRPC service."""
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from pdserve.common.errors import InvalidRequestError, WorkerTimeoutError, WorkerUnavailableError
from pdserve.common.ids import DeploymentId, RequestId, WorkerId
from pdserve.common.pki import WORKER_NAME
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, LoraAdapterInfo, WorkerInfo
from pdserve.common.tls import TlsConfig
from pdserve.rpc import convert
from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.output_stream import OutputDemux
from pdserve.rpc.status import error_from_rpc
from pdserve.rpc.tls import aio_channel

R = TypeVar("R", bound=Message)
LORA_TIMEOUT_S = 120.0  # a load reads the adapter's files and moves them to the device

# Pings find a worker that vanished without closing the connection (the worker allows
# pings every 5 s at most; see worker/server.py). A worker that died is redialled at least
# every 2 s (gRPC's default backoff grows to 120 s), so a restarted worker rejoins promptly.
CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)
# the worker channel also takes one output larger than an output batch (`output_stream`)
WORKER_CHANNEL_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.max_receive_message_length", 64 << 20))


class GrpcBackend:
    """A `GenerateBackend` for the worker at `address` ("host:port").

    Every call has a deadline: `generate_timeout_s` for a whole `generate` stream,
    `rpc_timeout_s` for each other call. A worker that cannot be reached raises
    `WorkerUnavailableError` (so does a worker refusing our certificate, or we its: a server
    whose certificate is not a worker's); `tls`:
    mutual TLS under our certificate, None: plain text. A passed deadline raises `WorkerTimeoutError`; a request the
    worker refuses raises the worker's typed error (`InvalidRequestError`, ...).

    The channel opens at the first call, in the event loop that makes it; use one
    `GrpcBackend` from one event loop, and `close()` it there.
    """

    def __init__(
        self, address: str, *, rpc_timeout_s: float = 5.0, generate_timeout_s: float = 600.0,
        tls: TlsConfig | None = None,
    ) -> None:
        self.address = address
        self._tls = tls
        self._rpc_timeout_s = rpc_timeout_s
        self._generate_timeout_s = generate_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._loras: worker_pb2_grpc.LoraAdaptersStub | None = None  # on the same channel
        self._output_stream: OutputDemux | None = None  # every request's outputs from this worker
        self._opening: asyncio.Lock | None = None

    def _worker(self) -> worker_pb2_grpc.WorkerStub:
        if self._stub is None:
            self._channel = aio_channel(self.address, self._tls, WORKER_NAME, WORKER_CHANNEL_OPTIONS)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)
            self._loras = worker_pb2_grpc.LoraAdaptersStub(self._channel)
        return self._stub

    def _lora_adapters(self) -> worker_pb2_grpc.LoraAdaptersStub:
        self._worker()  # opens the channel the two stubs share
        assert self._loras is not None
        return self._loras

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs. Closing this iterator early (`aclose()`, or
        cancelling the task iterating it) cancels the call, and the worker aborts the request.
        `prefill_worker`: a prefill worker's address for this (decode) worker to use;
        `prefill_worker_id`: its id, whose certificate alone the decode worker accepts there."""
        message = convert.request_to_proto(request, prefill_worker, prefill_worker_id)
        stream = await self._outputs()
        queue = stream.register(request.request_id)  # None: the id runs here already (the worker will say so)
        if queue is not None:
            message.output_stream = stream.stream_id
        call = self._worker().Generate(message, timeout=self._generate_timeout_s)
        try:
            if queue is None:  # on the call's own stream, where the other's outputs are not mixed in
                async for message in call:
                    yield convert.output_from_proto(message)
                return
            async for output in stream.outputs(request.request_id, queue, call, request.sampling.n):
                yield output
        except grpc.aio.AioRpcError as exc:
            error = error_from_rpc(exc, self.address, self._generate_timeout_s)
            if isinstance(error, InvalidRequestError) and error.param == "output_stream":
                stream.is_closed = True  # the worker lost it (it restarted): the next request opens another
                raise WorkerUnavailableError(self.address, "it does not know our output stream") from exc
            raise error from exc
        finally:
            call.cancel()  # no-op once the call has ended
            if queue is not None:
                stream.forget(request.request_id)

    async def _outputs(self) -> OutputDemux:
        """The open output stream of this worker's requests; opened (again) when there is none."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._output_stream is None or self._output_stream.is_closed:
                if self._output_stream is not None:
                    await self._output_stream.close()
                stream = OutputDemux(self.address)
                try:
                    await stream.open(self._worker(), self._rpc_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    raise error_from_rpc(exc, self.address, self._rpc_timeout_s) from exc
                except TimeoutError:
                    raise WorkerTimeoutError(self.address, self._rpc_timeout_s) from None
                self._output_stream = stream
            return self._output_stream

    async def _call(self, method: Callable[..., Awaitable[R]], message: Message, timeout_s: float | None = None) -> R:
        timeout_s = timeout_s or self._rpc_timeout_s
        try:
            return await method(message, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.address, timeout_s) from exc

    async def abort(self, request_id: RequestId) -> None:
        await self._call(self._worker().Abort, wpb.AbortRequest(request_id=request_id))

    async def stats(self) -> EngineStats:
        reply = await self._call(self._worker().GetStats, wpb.GetStatsRequest())
        return convert.stats_from_proto(reply.stats)

    async def info(self) -> WorkerInfo:
        reply = await self._call(self._worker().GetInfo, wpb.GetInfoRequest())
        return WorkerInfo(convert.info_from_proto(reply.info), DeploymentId(reply.deployment_id) or None,
                          WorkerId(reply.worker_id) or None)

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """Load a LoRA adapter on the worker (its files are read there, within `LORA_TIMEOUT_S`)."""
        message = wpb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        reply = await self._call(self._lora_adapters().LoadLoraAdapter, message, LORA_TIMEOUT_S)
        return convert.lora_from_proto(reply.adapter)

    async def unload_lora_adapter(self, name: str) -> None:
        message = wpb.UnloadLoraAdapterRequest(lora_name=name)
        await self._call(self._lora_adapters().UnloadLoraAdapter, message, LORA_TIMEOUT_S)

    async def check_integrity(self) -> KvIntegrity:
        """The worker's KV cache self-check (see the CheckKvIntegrity RPC)."""
        r = await self._call(self._worker().CheckKvIntegrity, wpb.CheckKvIntegrityRequest())
        return KvIntegrity(r.ok, r.error, r.num_held_for_peer, r.num_used_blocks)

    async def is_serving(self) -> bool:
        """True if the worker answers health with SERVING; False if it is draining or its
        engine failed. Raises WorkerUnavailableError if it cannot be reached."""
        reply = await self._call(self._worker().Health, wpb.HealthRequest())
        return reply.status == wpb.SERVING_STATUS_SERVING

    async def close(self) -> None:
        """Close the channel; calls still running end with WorkerUnavailableError."""
        if self._output_stream is not None:
            await self._output_stream.close()
            self._output_stream = None
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None
            self._stub = None
            self._loras = None
