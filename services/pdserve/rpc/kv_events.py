"""The KvEvents service's messages as pdserve values, and back.

Events are the KV cache manager's own (`pdserve.kvcache.events`); a batch and a snapshot are
the two shapes they travel in. Every pair round-trips exactly:
`batch_from_proto(batch_to_proto(b)) == b`, `snapshot_from_proto(snapshot_to_proto(s)) == s`.
A message this build cannot read (an unknown tier, an event with no kind) raises `WorkerError`.
"""
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.errors import WorkerError
from pdserve.common.ids import BlockHash
from pdserve.kvcache import AllCleared, BlockRemoved, BlockStored, BlockUpdated, KvEvent, Tier
from pdserve.rpc.gen import kv_events_pb2 as pb

_TIER_TO_PROTO = {
    Tier.DEVICE: pb.STORAGE_TIER_DEVICE,
    Tier.HOST: pb.STORAGE_TIER_HOST,
    Tier.DISK: pb.STORAGE_TIER_DISK,
}
_TIER_FROM_PROTO = {v: k for k, v in _TIER_TO_PROTO.items()}


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events from one worker process (`epoch`), oldest first, `seq` increasing by one."""

    epoch: str
    events: tuple[KvEvent, ...]


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """Every cached block of a worker with its tier; reflects exactly the events before `next_seq`."""

    epoch: str
    next_seq: int
    blocks: tuple[tuple[BlockHash, Tier], ...]


def _tier_from_proto(value: int) -> Tier:
    if value not in _TIER_FROM_PROTO:
        raise WorkerError(f"worker sent storage tier {value}, which this router does not know")
    return _TIER_FROM_PROTO[value]


def event_to_proto(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, BlockStored):
        stored = pb.BlockStored(block_hashes=event.block_hashes, parent_hash=event.parent_hash,
                                tier=_TIER_TO_PROTO[event.tier], priority=event.priority, lora_id=event.lora_id)
        return pb.KvEvent(seq=event.seq, stored=stored)
    if isinstance(event, BlockRemoved):
        removed = pb.BlockRemoved(block_hashes=event.block_hashes, tier=_TIER_TO_PROTO[event.tier])
        return pb.KvEvent(seq=event.seq, removed=removed)
    if isinstance(event, BlockUpdated):
        updated = pb.BlockUpdated(block_hash=event.block_hash, tier=_TIER_TO_PROTO[event.tier],
                                  priority=event.priority,
                                  old_tier=_TIER_TO_PROTO[event.old_tier] if event.old_tier is not None else 0)
        return pb.KvEvent(seq=event.seq, updated=updated)
    return pb.KvEvent(seq=event.seq, cleared=pb.AllCleared())


def event_from_proto(msg: pb.KvEvent) -> KvEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        s = msg.stored
        return BlockStored(msg.seq, tuple(BlockHash(h) for h in s.block_hashes),
                           BlockHash(s.parent_hash) if s.HasField("parent_hash") else None,
                           _tier_from_proto(s.tier), s.priority, s.lora_id if s.HasField("lora_id") else None)
    if kind == "removed":
        r = msg.removed
        return BlockRemoved(msg.seq, tuple(BlockHash(h) for h in r.block_hashes), _tier_from_proto(r.tier))
    if kind == "updated":
        u = msg.updated
        old_tier = _tier_from_proto(u.old_tier) if u.old_tier else None
        return BlockUpdated(msg.seq, BlockHash(u.block_hash), _tier_from_proto(u.tier), u.priority, old_tier)
    if kind == "cleared":
        return AllCleared(msg.seq)
    raise WorkerError(f"worker sent KV event seq={msg.seq} with no kind this router knows")


def batch_to_proto(epoch: str, events: Sequence[KvEvent]) -> pb.KvEventBatch:
    return pb.KvEventBatch(epoch=epoch, events=[event_to_proto(e) for e in events])


def batch_from_proto(msg: pb.KvEventBatch) -> EventBatch:
    return EventBatch(msg.epoch, tuple(event_from_proto(e) for e in msg.events))


def snapshot_to_proto(snapshot: KvSnapshot) -> pb.SnapshotResponse:
    blocks = [pb.CachedBlock(block_hash=h, tier=_TIER_TO_PROTO[tier]) for h, tier in snapshot.blocks]
    return pb.SnapshotResponse(epoch=snapshot.epoch, next_seq=snapshot.next_seq, blocks=blocks)


def snapshot_from_proto(msg: pb.SnapshotResponse) -> KvSnapshot:
    blocks = tuple((BlockHash(b.block_hash), _tier_from_proto(b.tier)) for b in msg.blocks)
    return KvSnapshot(msg.epoch, msg.next_seq, blocks)
