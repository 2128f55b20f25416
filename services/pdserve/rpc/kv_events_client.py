"""The router's client of one worker's KvEvents service.

Failures are sorted by what the subscriber should do about them: `WorkerUnavailableError`
(the worker is gone: take it out of rotation), `KvEventsUnsupported` (it publishes no events:
stop asking) and `KvEventsError` (anything else: subscribe again and resync).
"""
from collections.abc import AsyncIterator

import grpc

from pdserve.common.errors import PdserveError, WorkerUnavailableError
from pdserve.common.pki import WORKER_NAME
from pdserve.common.tls import TlsConfig
from pdserve.rpc import kv_events as convert
from pdserve.rpc.gen import kv_events_pb2 as pb
from pdserve.rpc.gen import kv_events_pb2_grpc
from pdserve.rpc.tls import aio_channel
from pdserve.rpc.worker_client import CHANNEL_OPTIONS

# A snapshot names every cached block (about 40 bytes each); gRPC's 4 MiB default would cap
# a worker at some 100k blocks.
_MAX_SNAPSHOT_BYTES = 1 << 30
_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.max_receive_message_length", _MAX_SNAPSHOT_BYTES))


class KvEventsError(PdserveError):
    """The event stream or a snapshot failed for a reason worth retrying."""


class KvEventsUnsupported(PdserveError):
    """The worker serves no KvEvents service."""


def _error(exc: grpc.aio.AioRpcError, address: str) -> PdserveError:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return WorkerUnavailableError(address, exc.details() or code.name)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return KvEventsUnsupported(f"worker {address} publishes no KV events")
    return KvEventsError(f"KV events of worker {address}: {code.name}: {exc.details()}")


class KvEventsClient:
    """Use from one event loop; `close()` there. The channel opens at the first call."""

    def __init__(self, address: str, rpc_timeout_s: float, snapshot_timeout_s: float = 60.0,
                 tls: TlsConfig | None = None) -> None:
        self.address = address
        self._tls = tls
        self._rpc_timeout_s = rpc_timeout_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: kv_events_pb2_grpc.KvEventsStub | None = None

    def _events(self) -> kv_events_pb2_grpc.KvEventsStub:
        if self._stub is None:
            self._channel = aio_channel(self.address, self._tls, WORKER_NAME, _OPTIONS)
            self._stub = kv_events_pb2_grpc.KvEventsStub(self._channel)
        return self._stub

    async def subscribe(self) -> AsyncIterator[convert.EventBatch]:
        """The worker's event batches, the first one empty, until the stream fails (it never
        ends on its own). Closing the iterator cancels the call."""
        call = self._events().Subscribe(pb.SubscribeRequest())
        try:
            async for batch in call:
                yield convert.batch_from_proto(batch)
            raise KvEventsError(f"the KV event stream of worker {self.address} ended")
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from exc
        finally:
            call.cancel()

    async def snapshot(self) -> convert.KvSnapshot:
        try:
            reply = await self._events().Snapshot(pb.SnapshotRequest(), timeout=self._snapshot_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from exc
        return convert.snapshot_from_proto(reply)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None
            self._stub = None
