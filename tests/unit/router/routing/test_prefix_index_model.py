"""The prefix index's bitmask layout against a plain model of its contract: per worker a map from
key to tier, an overlap the leading run each worker holds, counted by tier. Random event streams
over many workers (more than fit one machine word of mask) and short chains with gaps."""
import random

import pytest

from pdserve.common.ids import BlockHash, WorkerId
from pdserve.kvcache import AllCleared, BlockRemoved, BlockStored, BlockUpdated, KvEvent, Tier
from pdserve.router.routing.prefix_index import ApplyResult, Overlap, PrefixIndex

KEYS = [BlockHash(bytes([i]) * 32) for i in range(24)]  # a request is a run of these, in order
TIERS = list(Tier)


class Model:
    """What the index promises, written the obvious way."""

    def __init__(self) -> None:
        self.blocks: dict[WorkerId, dict[BlockHash, Tier]] = {}
        self.synced: set[WorkerId] = set()

    def apply(self, worker: WorkerId, event: KvEvent) -> None:
        held = self.blocks[worker]
        if isinstance(event, BlockStored):
            held.update(dict.fromkeys(event.block_hashes, event.tier))
        elif isinstance(event, BlockRemoved):
            for key in event.block_hashes:
                if held.get(key) == event.tier:
                    del held[key]
        elif isinstance(event, BlockUpdated):
            if event.block_hash in held:
                held[event.block_hash] = event.tier
        else:
            held.clear()

    def overlap(self, keys: list[BlockHash], worker: WorkerId) -> Overlap:
        held = self.blocks.get(worker, {})
        counts = dict.fromkeys(TIERS, 0)
        for key in keys:
            if key not in held:
                break
            counts[held[key]] += 1
        return Overlap(counts[Tier.DEVICE], counts[Tier.HOST], counts[Tier.DISK], worker in self.synced)


def random_event(rng: random.Random, seq: int) -> KvEvent:
    kind = rng.random()
    if kind < 0.5:
        start = rng.randrange(len(KEYS))
        return BlockStored(seq, tuple(KEYS[start:start + rng.randint(1, 6)]), None, rng.choice(TIERS), 35, None)
    if kind < 0.75:
        return BlockRemoved(seq, tuple(rng.sample(KEYS, rng.randint(1, 3))), rng.choice(TIERS))
    if kind < 0.97:
        return BlockUpdated(seq, rng.choice(KEYS), rng.choice(TIERS), 35)
    return AllCleared(seq)


def check(index: PrefixIndex, model: Model, workers: list[WorkerId], rng: random.Random) -> None:
    start = rng.choice([0, 0, rng.randrange(len(KEYS))])
    keys = KEYS[start:start + rng.randint(0, len(KEYS))]
    asked = rng.sample(workers, rng.randint(1, len(workers)))
    assert index.overlaps(keys, asked) == {w: model.overlap(keys, w) for w in asked}
    for worker in asked:
        assert index.num_blocks(worker) == len(model.blocks.get(worker, {}))
        key = rng.choice(KEYS)
        assert index.tier_of(worker, key) == model.blocks.get(worker, {}).get(key)


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_match_the_model(seed: int) -> None:
    rng = random.Random(seed)
    workers = [WorkerId(f"w{i}:1") for i in range(rng.choice([3, 40, 70]))]
    index, model, next_seq = PrefixIndex(), Model(), {}
    for _ in range(600):
        worker, action = rng.choice(workers), rng.random()
        if worker not in next_seq or action < 0.02:  # (re)sync from a snapshot of what the model holds
            blocks = [(k, rng.choice(TIERS)) for k in rng.sample(KEYS, rng.randint(0, 8))]
            next_seq[worker] = rng.randint(0, 5)
            index.load_snapshot(worker, blocks, next_seq[worker])
            model.blocks[worker] = dict(blocks)
            model.synced.add(worker)
        elif action < 0.03:
            index.mark_unsynced(worker)
            model.synced.discard(worker)
            del next_seq[worker]
        elif action < 0.04:
            index.remove_worker(worker)
            model.blocks.pop(worker, None)
            model.synced.discard(worker)
            del next_seq[worker]
        else:
            event = random_event(rng, next_seq[worker])
            assert index.apply(worker, [event]) is ApplyResult.APPLIED
            model.apply(worker, event)
            next_seq[worker] += 1
        check(index, model, workers, rng)


def test_a_removed_workers_bit_is_reused_without_inheriting_its_blocks() -> None:
    index = PrefixIndex()
    a, b, c = WorkerId("a:1"), WorkerId("b:1"), WorkerId("c:1")
    index.load_snapshot(a, [(KEYS[0], Tier.HOST), (KEYS[1], Tier.DEVICE)], 0)
    index.load_snapshot(b, [(KEYS[0], Tier.DEVICE)], 0)
    index.remove_worker(a)
    index.load_snapshot(c, [], 0)  # takes a's bit
    assert index.overlaps(KEYS[:2], [a, b, c]) == {a: Overlap(is_synced=False), b: Overlap(num_device=1),
                                                   c: Overlap()}
    assert index.tier_of(c, KEYS[0]) is None
