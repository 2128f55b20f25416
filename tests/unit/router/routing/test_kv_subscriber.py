"""The KV event subscriber's failure paths, on a scripted event source: a sequence gap, a
restarted worker (new epoch), a broken stream, an unreachable worker, a worker without events."""
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.kvcache import BlockStored, Tier, hash_request_blocks
from pdserve.rpc.kv_events_client import KvEventsError, KvEventsUnsupported
from pdserve.router.routing.kv_subscriber import KvEventSubscriber
from pdserve.router.routing.prefix_index import Overlap, PrefixIndex
from pdserve.router.routing.routing_metrics import RoutingCounters
from pdserve.rpc.kv_events import EventBatch, KvSnapshot

W = WorkerId("w:1")
KEYS = hash_request_blocks(list(range(40)), 4)  # 10 blocks


def stored(seq: int, i: int) -> BlockStored:
    return BlockStored(seq, (KEYS[i],), None, Tier.DEVICE, 35, None)


class ScriptedSource:
    """Each `subscribe` plays the next script (batches, then an exception or an endless wait);
    each `snapshot` returns the next snapshot."""

    def __init__(self, streams: list[tuple[list[EventBatch], BaseException | None]], snapshots: list[KvSnapshot]) -> None:
        self.streams = streams
        self.snapshots = snapshots
        self.num_snapshots = 0

    async def subscribe(self) -> AsyncIterator[EventBatch]:
        batches, failure = self.streams.pop(0)
        for batch in batches:
            yield batch
            await asyncio.sleep(0)
        if failure is not None:
            raise failure
        await asyncio.Event().wait()

    async def snapshot(self) -> KvSnapshot:
        self.num_snapshots += 1
        return self.snapshots.pop(0)

    async def close(self) -> None:
        pass


@dataclass(frozen=True)
class Seen:
    """The subscriber's results while it still ran (cancelling it unsyncs the worker)."""

    overlap: Overlap
    resyncs: dict
    unreachable: list[str]


def follow(source: ScriptedSource) -> Seen:
    """Run the subscriber until its script is exhausted (or it stops)."""
    index, counters, unreachable = PrefixIndex(), RoutingCounters(), []
    subscriber = KvEventSubscriber(W, source, index, counters, lambda w, reason: unreachable.append(reason),
                                   first_batch_timeout_s=1.0, retry_s=0.0)

    async def scenario() -> Seen:
        task = asyncio.create_task(subscriber.run())
        for _ in range(200):
            if task.done() or not source.streams and not source.snapshots:
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        seen = Seen(index.overlaps(KEYS, [W])[W], dict(counters.resyncs), unreachable)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return seen

    return asyncio.run(scenario())


def test_a_sequence_gap_triggers_a_new_snapshot_on_the_same_stream() -> None:
    source = ScriptedSource(
        [([EventBatch("e1", ()), EventBatch("e1", (stored(2, 0),)), EventBatch("e1", (stored(4, 1),)),
           EventBatch("e1", (stored(7, 2),))], None)],
        [KvSnapshot("e1", 2, ()), KvSnapshot("e1", 7, ((KEYS[0], Tier.DEVICE), (KEYS[1], Tier.DEVICE)))],
    )
    seen = follow(source)
    assert seen.resyncs == {(W, "subscribe"): 1, (W, "gap"): 1}
    assert seen.overlap == Overlap(num_device=3)  # the second snapshot's two, then seq 7


def test_a_new_epoch_on_the_stream_means_a_restart_and_a_fresh_subscription() -> None:
    source = ScriptedSource(
        [([EventBatch("e1", ()), EventBatch("e2", (stored(0, 5),))], None), ([EventBatch("e2", ())], None)],
        [KvSnapshot("e1", 0, ((KEYS[0], Tier.DEVICE),)), KvSnapshot("e2", 1, ())],
    )
    seen = follow(source)
    assert seen.resyncs == {(W, "subscribe"): 1, (W, "reconnect"): 1}
    assert seen.overlap == Overlap()  # synced, from the restarted worker's empty snapshot


def test_a_snapshot_from_another_epoch_than_the_stream_is_not_loaded() -> None:
    source = ScriptedSource(
        [([EventBatch("e1", ())], None), ([EventBatch("e2", ())], None)],
        [KvSnapshot("e2", 3, ((KEYS[0], Tier.DEVICE),)), KvSnapshot("e2", 3, ((KEYS[0], Tier.DEVICE),))],
    )
    seen = follow(source)
    assert seen.resyncs == {(W, "reconnect"): 1}
    assert seen.overlap == Overlap(num_device=1)


def test_a_broken_stream_leaves_the_worker_unsynced_until_it_resubscribes() -> None:
    source = ScriptedSource(
        [([EventBatch("e1", ()), EventBatch("e1", (stored(0, 0),))], KvEventsError("RESOURCE_EXHAUSTED")),
         ([EventBatch("e1", ())], None)],
        [KvSnapshot("e1", 0, ()), KvSnapshot("e1", 9, ((KEYS[0], Tier.DEVICE), (KEYS[1], Tier.DEVICE)))],
    )
    seen = follow(source)
    assert seen.resyncs == {(W, "subscribe"): 1, (W, "reconnect"): 1}
    assert seen.overlap == Overlap(num_device=2)


def test_an_unreachable_worker_is_reported_and_not_followed_any_more() -> None:
    source = ScriptedSource([([EventBatch("e1", ())], WorkerUnavailableError("w:1", "Socket closed"))],
                            [KvSnapshot("e1", 0, ())])
    seen = follow(source)
    assert seen.unreachable == ["KV event stream broke: Socket closed"]
    assert seen.overlap == Overlap(is_synced=False)


def test_a_worker_without_kv_events_is_left_unknown() -> None:
    source = ScriptedSource([([], KvEventsUnsupported("worker w:1 publishes no KV events"))], [])
    assert follow(source) == Seen(Overlap(is_synced=False), {}, [])
