"""Synthetic cluster caches for `router_scale.py`: the KV event streams W workers holding N blocks
in all publish, and the prompts a router then routes.

Shape (16 tokens per block; prompts of 1k-8k tokens, 64-512 blocks):
- `num_system_prompts` shared system prompts of 32-128 blocks, picked with a Zipf-like skew;
- conversations: a system prompt plus a body, 64-512 blocks in all, each cached on the worker a
  KV-aware router sent it to, a `replication` share of them on a second worker as well;
- each worker publishes what its `KvCacheManager` would (see `kvcache/pool.py`): one `BlockStored`
  per block, naming its parent; churn (after each chain, a one-off chain `churn` times as long,
  evicted one `BlockRemoved` per block after the next chain); at the end offloads as an LRU makes
  them: the oldest conversations' bodies, leaves first, `host_fraction` of the worker's blocks
  (`BlockUpdated` device to host), the oldest `disk_fraction` on to disk; system prompts stay on
  the device. Batches of `batch_size` events, serialised by `batch_to_proto` exactly as the
  worker's KvEvents service writes them.
Every worker ends holding num_blocks / num_workers blocks (the first ones one more for a remainder).
Block keys are random 32-byte strings: the index treats keys as opaque, and SHA-256 over millions
of blocks would take minutes without changing what is measured (`router_scale.py` times the
router's own key hashing apart).

Prompts: 60 % the next turn of a cached conversation (its chain plus 4-32 new blocks), 30 % a new
conversation on a system prompt, 10 % nothing cached.
"""
import itertools
import random
from dataclasses import dataclass, field

from pdserve.common.ids import BlockHash, WorkerId
from pdserve.kvcache import BlockRemoved, BlockStored, BlockUpdated, KvEvent, Tier
from pdserve.rpc.kv_events import batch_to_proto

MIN_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS = 64, 512
PRIORITY = 35


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    num_workers: int
    num_blocks: int  # indexed (worker, block) entries once every stream is applied
    tokens_per_block: int = 16
    num_system_prompts: int = 32
    replication: float = 0.1
    churn: float = 0.1
    host_fraction: float = 0.1
    disk_fraction: float = 0.02
    batch_size: int = 64
    num_prompts: int = 2000
    seed: int = 0


@dataclass(slots=True)
class Prompt:
    block_hashes: list[BlockHash]
    num_tokens: int


@dataclass(slots=True)
class Workload:
    epochs: dict[WorkerId, str]
    streams: dict[WorkerId, list[bytes]]  # serialised KvEventBatch messages, oldest first
    prompts: list[Prompt]
    num_events: int = 0
    num_unique_blocks: int = 0


@dataclass(slots=True)
class _Conversation:
    system: int
    body: list[BlockHash]
    holders: set[int] = field(default_factory=set)


def worker_ids(num_workers: int) -> list[WorkerId]:
    return [WorkerId(f"10.0.{i // 250}.{i % 250 + 1}:50051") for i in range(num_workers)]


class _Cluster:
    """Draws the system prompts and conversations, and what each worker caches of them."""

    def __init__(self, shape: WorkloadShape) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed)
        self.systems = [self.new_keys(self.rng.randint(32, 128)) for _ in range(shape.num_system_prompts)]
        self._system_weights = list(itertools.accumulate(1.0 / (r + 1) for r in range(shape.num_system_prompts)))
        self.conversations: list[_Conversation] = []
        self.system_keys = {key for system in self.systems for key in system}

    def new_keys(self, n: int) -> list[BlockHash]:
        return [BlockHash(self.rng.randbytes(32)) for _ in range(n)]

    def pick_system(self) -> int:
        return self.rng.choices(range(len(self.systems)), cum_weights=self._system_weights)[0]

    def new_conversation(self) -> _Conversation:
        system = self.pick_system()
        total = self.rng.randint(MIN_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS)
        conversation = _Conversation(system, self.new_keys(max(total - len(self.systems[system]), 1)))
        self.conversations.append(conversation)
        return conversation

    def chains_of(self, worker: int, budget: int) -> list[tuple[BlockHash | None, list[BlockHash]]]:
        """The chains `worker` stores, in order, `budget` blocks in all, each with the parent of
        its first block: a system prompt the worker already holds is not stored again."""
        chains, held_systems = [], set()
        while budget > 0:
            others = [c for c in self.conversations[-64:] if worker not in c.holders]
            if others and self.rng.random() < self.shape.replication:
                conversation = self.rng.choice(others)
            else:
                conversation = self.new_conversation()
            conversation.holders.add(worker)
            system = self.systems[conversation.system]
            parent = system[-1] if conversation.system in held_systems else None
            held_systems.add(conversation.system)
            chain = (conversation.body if parent else system + conversation.body)[:budget]
            budget -= len(chain)
            chains.append((parent, chain))
        return chains

    def prompt(self) -> Prompt:
        draw, tpb = self.rng.random(), self.shape.tokens_per_block
        if draw < 0.6 and self.conversations:
            conversation = self.rng.choice(self.conversations)
            keys = self.systems[conversation.system] + conversation.body + self.new_keys(self.rng.randint(4, 32))
        elif draw < 0.9:
            system = self.systems[self.pick_system()]
            keys = system + self.new_keys(max(self.rng.randint(MIN_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS) - len(system), 1))
        else:
            keys = self.new_keys(self.rng.randint(MIN_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS))
        keys = keys[:MAX_PROMPT_BLOCKS]
        return Prompt(keys, len(keys) * tpb + self.rng.randint(1, tpb))  # the last block partial


class _EventLog:
    """One worker's events, numbered as its `EventBuffer` numbers them."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def store(self, chain: list[BlockHash], parent: BlockHash | None) -> None:
        for block_hash in chain:
            self.events.append(BlockStored(len(self.events), (block_hash,), parent, Tier.DEVICE, PRIORITY, None))
            parent = block_hash

    def remove(self, chain: list[BlockHash]) -> None:
        for block_hash in reversed(chain):  # leaves before parents
            self.events.append(BlockRemoved(len(self.events), (block_hash,), Tier.DEVICE))

    def move(self, block_hash: BlockHash, tier: Tier, old_tier: Tier) -> None:
        self.events.append(BlockUpdated(len(self.events), block_hash, tier, PRIORITY, old_tier))


def _worker_events(cluster: _Cluster, chains: list[tuple[BlockHash | None, list[BlockHash]]]) -> list[KvEvent]:
    shape, log = cluster.shape, _EventLog()
    evict_next: list[BlockHash] = []
    for parent, chain in chains:
        log.store(chain, parent)
        log.remove(evict_next)
        evict_next = cluster.new_keys(round(shape.churn * len(chain)))
        log.store(evict_next, chain[0])
    log.remove(evict_next)
    num_held = sum(len(chain) for _, chain in chains)
    coldest = [key for _, chain in chains for key in reversed(chain) if key not in cluster.system_keys]
    offloaded = coldest[:round(shape.host_fraction * num_held)]
    for block_hash in offloaded:
        log.move(block_hash, Tier.HOST, Tier.DEVICE)
    for block_hash in offloaded[:round(shape.disk_fraction * num_held)]:
        log.move(block_hash, Tier.DISK, Tier.HOST)
    return log.events


def build_workload(shape: WorkloadShape) -> Workload:
    cluster = _Cluster(shape)
    workers = worker_ids(shape.num_workers)
    per_worker, extra = divmod(shape.num_blocks, shape.num_workers)
    workload = Workload({w: f"epoch-{i}" for i, w in enumerate(workers)}, {}, [])
    unique: set[BlockHash] = set()
    for i, worker in enumerate(workers):
        chains = cluster.chains_of(i, per_worker + (i < extra))
        unique.update(key for _, chain in chains for key in chain)
        events = _worker_events(cluster, chains)
        workload.num_events += len(events)
        epoch = workload.epochs[worker]
        workload.streams[worker] = [batch_to_proto(epoch, events[at:at + shape.batch_size]).SerializeToString()
                                    for at in range(0, len(events), shape.batch_size)]
    workload.num_unique_blocks = len(unique)
    workload.prompts = [cluster.prompt() for _ in range(shape.num_prompts)]
    return workload
