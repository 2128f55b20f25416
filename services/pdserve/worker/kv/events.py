"""The worker's KV cache events, streamed to routers (`rpc.kv_events_service`), and snapshots.

Events leave the engine thread through `ThreadedEngine.add_kv_event_listener` and reach the
event loop with `call_soon_threadsafe`; each subscriber has a bounded queue of batches. A
subscriber that falls behind is dropped with RESOURCE_EXHAUSTED (it subscribes again and
resyncs from a snapshot), so a slow router never holds the engine or the worker's memory.

Consistency contract: a subscriber registered before a snapshot was taken receives every
event with `seq >= snapshot.next_seq`; the snapshot runs on the engine thread between steps.
"""
import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from pdserve.kvcache import KvEvent
from pdserve.rpc import kv_events as convert
from pdserve.rpc.kv_events_service import SubscriberOverflow, add_kv_events_service
from pdserve.worker.async_engine import ThreadedEngine

Batch = tuple[str, Sequence[KvEvent]]  # (epoch, events)

MAX_QUEUED_BATCHES = 1024
SNAPSHOT_TIMEOUT_S = 30.0


@dataclass(slots=True, eq=False)
class _Subscriber:
    """A bounded queue of batches; None, queued alone, marks a subscriber that fell behind."""

    queue: asyncio.Queue[Batch | None]
    is_overflowed: bool = False

    def offer(self, batch: Batch) -> None:
        if self.is_overflowed:
            return
        if self.queue.full():
            self.is_overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(batch)


class KvEventPublisher:
    """Fans one engine's KV events out to subscribers. Build it inside the worker's event loop."""

    def __init__(self, engine: ThreadedEngine, max_queued_batches: int = MAX_QUEUED_BATCHES) -> None:
        self.epoch = uuid.uuid4().hex  # a restarted worker process is told apart by this
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._max_queued = max_queued_batches
        self._subscribers: set[_Subscriber] = set()
        engine.add_kv_event_listener(self._on_events)

    def _on_events(self, events: list[KvEvent]) -> None:
        """Engine thread. Events published while nobody listens are covered by the next snapshot."""
        if not self._subscribers:
            return
        try:
            self._loop.call_soon_threadsafe(self._fan_out, events)
        except RuntimeError:  # the loop closed: the worker is exiting
            pass

    def _fan_out(self, events: list[KvEvent]) -> None:
        batch = (self.epoch, events)
        for subscriber in self._subscribers:
            subscriber.offer(batch)

    async def subscribe(self, stopping: asyncio.Event) -> AsyncIterator[Batch]:
        """An empty batch at once (the subscription is live), then every batch published.

        Ends when `stopping` is set; raises `SubscriberOverflow` if the consumer fell behind."""
        subscriber = _Subscriber(asyncio.Queue(self._max_queued))
        self._subscribers.add(subscriber)
        try:
            yield self.epoch, ()
            while (batch := await _next_unless_stopping(subscriber.queue, stopping)) is not _STOPPING:
                if batch is None:
                    raise SubscriberOverflow(self._max_queued)
                yield batch
        finally:
            self._subscribers.discard(subscriber)

    async def snapshot(self) -> convert.KvSnapshot:
        """Every cached block and the seq of the first event not reflected (taken between steps)."""
        next_seq, blocks = await self._engine.kv_snapshot(SNAPSHOT_TIMEOUT_S)
        return convert.KvSnapshot(self.epoch, next_seq, tuple(blocks))


_STOPPING = object()


async def _next_unless_stopping(queue: asyncio.Queue, stopping: asyncio.Event) -> object:
    """The queue's next item, or `_STOPPING` once `stopping` is set."""
    if stopping.is_set():
        return _STOPPING
    getter = asyncio.ensure_future(queue.get())
    stopper = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else _STOPPING


def kv_events_service(engine: ThreadedEngine, stopping: asyncio.Event) -> Callable[[grpc.aio.Server], None]:
    """The `WorkerServer` service hook adding KvEvents for `engine` (call inside the event loop)."""
    publisher = KvEventPublisher(engine)
    return lambda server: add_kv_events_service(server, publisher, stopping)
