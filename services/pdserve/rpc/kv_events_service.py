"""The KvEvents gRPC service: a thin shell over a worker's `KvEventSource`.

Every Subscribe stream ends (UNAVAILABLE) once `stopping` is set; a subscriber that fell
behind is dropped with RESOURCE_EXHAUSTED (it subscribes again and resyncs from a snapshot).
"""
import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Protocol

import grpc

from pdserve.kvcache import KvEvent
from pdserve.rpc import kv_events as convert
from pdserve.rpc.gen import kv_events_pb2_grpc

log = logging.getLogger(__name__)


class SubscriberOverflow(Exception):
    """Raised by a source's subscription whose consumer fell too far behind."""

    def __init__(self, max_queued: int) -> None:
        super().__init__(f"subscriber fell {max_queued} event batches behind; subscribe again and resync")


class KvEventSource(Protocol):
    def subscribe(self, stopping: asyncio.Event) -> AsyncIterator[tuple[str, Sequence[KvEvent]]]:
        """(epoch, events) batches: an empty one at once, then every batch published, until
        `stopping` is set; raises SubscriberOverflow if the consumer fell behind."""

    async def snapshot(self) -> convert.KvSnapshot: ...


class KvEventsServicer(kv_events_pb2_grpc.KvEventsServicer):
    def __init__(self, source: KvEventSource, stopping: asyncio.Event) -> None:
        self._source = source
        self._stopping = stopping

    async def Subscribe(self, request, context: grpc.aio.ServicerContext) -> None:
        try:
            async with aclosing(self._source.subscribe(self._stopping)) as batches:
                async for epoch, events in batches:
                    await context.write(convert.batch_to_proto(epoch, events))
        except SubscriberOverflow as exc:
            log.warning("dropped a KV event subscriber: %s", exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is stopping")

    async def Snapshot(self, request, context: grpc.aio.ServicerContext):
        return convert.snapshot_to_proto(await self._source.snapshot())


def add_kv_events_service(server: grpc.aio.Server, source: KvEventSource, stopping: asyncio.Event) -> None:
    kv_events_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer(source, stopping), server)
