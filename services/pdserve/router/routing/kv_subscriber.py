"""Keeps one worker's part of the prefix index in step with the worker's KV event stream.

The protocol (see kv_events.proto): subscribe, wait for the first (empty) batch, take a
snapshot, then apply batches. A gap in sequence numbers, a batch from another epoch (the
worker restarted) or a snapshot from another epoch than the stream's means events were
lost: take a new snapshot. Until it is loaded the worker's part is unsynced (its old entries
stay, as an estimate). A stream that fails is subscribed again after `retry_s`; one that
fails with UNAVAILABLE reports the worker unreachable and stops (the pool brings the worker
back, and a new subscriber with it).
"""
import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Protocol

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.rpc.kv_events_client import KvEventsError, KvEventsUnsupported
from pdserve.router.routing.prefix_index import ApplyResult, PrefixIndex
from pdserve.router.routing.routing_metrics import RoutingCounters
from pdserve.rpc.kv_events import EventBatch, KvSnapshot

log = logging.getLogger(__name__)


class EventSource(Protocol):
    """A worker's KvEvents (`KvEventsClient`)."""

    def subscribe(self) -> AsyncIterator[EventBatch]: ...

    async def snapshot(self) -> KvSnapshot: ...

    async def close(self) -> None: ...


class _EpochChanged(Exception):
    """The worker restarted between the stream's first batch and now."""


class KvEventSubscriber:
    def __init__(self, worker: WorkerId, source: EventSource, index: PrefixIndex, counters: RoutingCounters,
                 on_unreachable: Callable[[WorkerId, str], None], first_batch_timeout_s: float,
                 retry_s: float = 1.0) -> None:
        self._worker = worker
        self._source = source
        self._index = index
        self._counters = counters
        self._on_unreachable = on_unreachable
        self._first_batch_timeout_s = first_batch_timeout_s
        self._retry_s = retry_s

    async def run(self) -> None:
        """Follow the worker's events until cancelled, the worker is unreachable, or it
        publishes none."""
        reason = "subscribe"
        while True:
            try:
                await self._follow(reason)
            except WorkerUnavailableError as exc:
                self._on_unreachable(self._worker, f"KV event stream broke: {exc.reason}")
                return
            except KvEventsUnsupported as exc:
                log.warning("%s; its cache counts as unknown", exc)
                return
            except (KvEventsError, _EpochChanged, TimeoutError) as exc:
                log.info("worker %s: KV events interrupted (%s); subscribing again", self._worker, exc)
            reason = "reconnect"
            await asyncio.sleep(self._retry_s)

    async def _follow(self, reason: str) -> None:
        """Never returns: it ends with the stream, leaving the worker's part unsynced."""
        self._index.mark_unsynced(self._worker)
        try:
            await self._apply_stream(reason)
        finally:
            self._index.mark_unsynced(self._worker)  # whatever ended the stream, events may be lost

    async def _apply_stream(self, reason: str) -> None:
        async with aclosing(self._source.subscribe()) as batches:
            async with asyncio.timeout(self._first_batch_timeout_s):
                first = await anext(batches)
            epoch = first.epoch
            await self._resync(epoch, reason)
            async for batch in batches:
                if batch.epoch != epoch:
                    raise _EpochChanged(f"epoch {epoch} became {batch.epoch}")
                result = self._index.apply(self._worker, batch.events)
                if result is not ApplyResult.APPLIED:
                    await self._resync(epoch, result.value)

    async def _resync(self, epoch: str, reason: str) -> None:
        self._index.mark_unsynced(self._worker)
        snapshot = await self._source.snapshot()
        if snapshot.epoch != epoch:
            raise _EpochChanged(f"stream epoch {epoch}, snapshot epoch {snapshot.epoch}")
        self._index.load_snapshot(self._worker, snapshot.blocks, snapshot.next_seq)
        self._counters.count_resync(self._worker, reason)
        log.info("worker %s: prefix index synced (%s, %d blocks, next seq %d)",
                 self._worker, reason, len(snapshot.blocks), snapshot.next_seq)
