"""The router at cluster size: routing decision cost, KV event ingestion rate and prefix-index
memory for 1-64 workers and 10k-1M indexed blocks.

Per cell (workers x indexed blocks), in a fresh process:
1. `router_scale_workload.py` draws what the workers cache and serialises their KV event streams
   as the workers' KvEvents service writes them;
2. ingestion: the router's own `WorkerPool` (fake worker clients answering info and stats), its
   `PrefixIndex`, and one real `KvEventSubscriber` per worker reading its stream from a replay
   source that decodes each batch with `rpc.kv_events` as `KvEventsClient` does. Events/s and
   block keys/s over the wall time from the first subscription until every stream is applied
   (protobuf decoding included; its share is reported), and the bytes the index holds per indexed
   block (`index_bytes`);
3. decisions: `Planner.plan` (the index's overlaps, loads, costs and the kv_aware policy) for each
   prompt, with requests in flight booked on the pool as `RoutedBackend` books them, finished in
   order, and load reports polled every `--poll-every` decisions. Each decision is taken
   `--repeats` times: the fastest is its cost (p50/p99 over prompts), the first what a request met
   on this machine (`plan_first_*`, with other processes' waits in it); `PrefixIndex.overlaps`
   alone over the same prompts (`overlaps_*`).
Workers: half prefill, half decode (one worker: aggregated). Besides the cells, the SHA-256 block
keys of a prompt (`prompt_block_keys`, computed once per request whatever the cluster) are timed.
A benchmark, not a test: nothing is asserted.

    python benchmarks/router_scale.py --json results-router-scale.json     # 3x3 grid, ~90 s of CPU
    python benchmarks/router_scale.py --quick                              # 10k and 100k, ~15 s of CPU
"""
import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from router_scale_workload import Workload, WorkloadShape, build_workload  # sibling module
from run_all import machine_info  # sibling module: the machine facts every report states

from pdserve.common.ids import DeploymentId, RequestId
from pdserve.common.request import GenerationRequest
from pdserve.common.stats import EngineStats, ModelInfo, WorkerInfo, WorkerRole
from pdserve.kvcache import HASH_ALGORITHM
from pdserve.router.routing.kv_subscriber import KvEventSubscriber
from pdserve.router.routing.planner import Planner, RoutingConfig
from pdserve.router.routing.prefix_index import PrefixIndex
from pdserve.router.routing.routed_backend import prompt_block_keys
from pdserve.router.routing.routing_metrics import RoutingCounters
from pdserve.router.routing.worker_pool import PoolConfig, WorkerPool
from pdserve.rpc.gen import kv_events_pb2 as pb
from pdserve.rpc.kv_events import EventBatch, KvSnapshot, batch_from_proto

FULL_GRID = {"workers": [1, 8, 64], "blocks": [10_000, 100_000, 1_000_000]}
QUICK_GRID = {"workers": [1, 8, 64], "blocks": [10_000, 100_000]}
NUM_BLOCKS_PER_WORKER = 4096  # what a worker reports as its KV capacity


class BenchWorker:
    """A `WorkerClient` that answers registration and load reports (drawn per report)."""

    def __init__(self, role: WorkerRole, tokens_per_block: int, rng: random.Random) -> None:
        self._info = ModelInfo("bench", 131072, tokens_per_block, HASH_ALGORITHM, role, 32000, (0,))
        self._rng = rng

    async def info(self) -> WorkerInfo:
        return WorkerInfo(self._info, DeploymentId("bench"))

    async def stats(self) -> EngineStats:
        running, used = self._rng.randint(0, 32), self._rng.randint(0, NUM_BLOCKS_PER_WORKER)
        return EngineStats(running, self._rng.randint(0, 4), NUM_BLOCKS_PER_WORKER - used, NUM_BLOCKS_PER_WORKER,
                           used, self._rng.randint(0, 8192), 0, 0, 0)

    async def close(self) -> None:
        pass


class ReplaySource:
    """An `EventSource` replaying one worker's serialised stream: the empty first batch, then
    every batch decoded as `KvEventsClient` decodes it; then it waits, as a live stream does."""

    def __init__(self, epoch: str, stream: list[bytes], on_drained: asyncio.Event) -> None:
        self._epoch = epoch
        self._stream = stream
        self._on_drained = on_drained
        self.decode_s = 0.0

    async def subscribe(self) -> AsyncIterator[EventBatch]:
        yield EventBatch(self._epoch, ())
        for raw in self._stream:
            started = time.perf_counter()
            batch = batch_from_proto(pb.KvEventBatch.FromString(raw))
            self.decode_s += time.perf_counter() - started
            yield batch
            await asyncio.sleep(0)  # let the other workers' streams in, as network reads would
        self._on_drained.set()
        await asyncio.Event().wait()

    async def snapshot(self) -> KvSnapshot:
        return KvSnapshot(self._epoch, 0, ())  # the stream starts with the worker's first event

    async def close(self) -> None:
        pass


def index_bytes(index: PrefixIndex) -> int:
    """What the index's tables and every object they hold take (`sys.getsizeof`), each object
    counted once: a key several workers hold is one bytes object per event that stored it.
    (An RSS delta would not do: the memory the workload's build freed is reused by the index.)"""
    seen: set[int] = set()

    def once(obj: object) -> int:
        if id(obj) in seen or (isinstance(obj, int) and -5 <= obj <= 256):  # small ints are shared
            return 0
        seen.add(id(obj))
        return sys.getsizeof(obj)

    tables = [index._holders, index._host, index._disk]  # the layout prefix_index.py documents
    total = sum(map(sys.getsizeof, tables))
    for table in tables:
        total += sum(once(key) + once(value) for key, value in table.items())
    for part in index._parts.values():
        total += sys.getsizeof(part) + sys.getsizeof(part.keys) + sum(map(once, part.keys))
    return total


def role_of(i: int, num_workers: int) -> WorkerRole:
    if num_workers == 1:
        return WorkerRole.BOTH
    return WorkerRole.PREFILL if i < num_workers // 2 else WorkerRole.DECODE


def percentiles_us(samples_ns: list[int]) -> dict:
    cuts = statistics.quantiles(samples_ns, n=100, method="inclusive")
    return {"p50": cuts[49] / 1e3, "p99": cuts[98] / 1e3, "max": max(samples_ns) / 1e3}


async def _ingest(workload: Workload, pool: WorkerPool, index: PrefixIndex) -> tuple[list[asyncio.Task], dict]:
    drained = {w: asyncio.Event() for w in workload.streams}
    sources = {w: ReplaySource(workload.epochs[w], s, drained[w]) for w, s in workload.streams.items()}
    counters = RoutingCounters()
    started = time.perf_counter()
    tasks = [asyncio.create_task(KvEventSubscriber(w, sources[w], index, counters, pool.mark_down, 30.0).run())
             for w in workload.streams]
    await asyncio.wait_for(asyncio.gather(*(d.wait() for d in drained.values())), timeout=600)
    await asyncio.sleep(0)  # the last batches are applied once their sources yield control back
    seconds = time.perf_counter() - started
    decode_s = sum(s.decode_s for s in sources.values())
    return tasks, {"seconds": seconds, "decode_share": decode_s / seconds,
                   "events_per_s": workload.num_events / seconds}


def _best_of(repeats: int, call) -> tuple[int, int]:
    """(first, fastest) wall time of `repeats` calls, in ns: the first is what a request met on
    this machine; the fastest is the decision's own cost, without the waits other processes on a
    shared machine add."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    return times[0], min(times)


async def _decide(workload: Workload, pool: WorkerPool, index: PrefixIndex, shape: WorkloadShape,
                  args: argparse.Namespace) -> dict:
    planner = Planner(pool, index, RoutingConfig(), shape.tokens_per_block, random.Random(shape.seed))
    workers = list(pool.handles)
    in_flight: deque = deque()
    first_ns, plan_ns, overlaps_ns, hits = [], [], [], 0
    for i, prompt in enumerate(workload.prompts):
        decisions = []
        first, best = _best_of(args.repeats,
                               lambda: decisions.append(planner.plan(prompt.block_hashes, prompt.num_tokens)))
        first_ns.append(first)
        plan_ns.append(best)
        overlaps_ns.append(_best_of(args.repeats, lambda: index.overlaps(prompt.block_hashes, workers))[1])
        decision = decisions[0]
        hits += decision.decode.overlap.num_blocks
        for leg in filter(None, (decision.decode, decision.prefill)):  # booked as RoutedBackend books them
            handle = pool.handles[leg.worker]
            in_flight.append((handle, pool.dispatch(handle, prompt.num_tokens, decision.num_prompt_blocks),
                              prompt.block_hashes))
            index.hold(leg.worker, prompt.block_hashes)
        while len(in_flight) > args.in_flight_per_worker * len(workers):
            handle, entry, keys = in_flight.popleft()
            pool.finish(handle, entry)
            index.release(handle.address, keys)
        if i % args.poll_every == args.poll_every - 1:
            await asyncio.gather(*(pool.poll(h) for h in pool.handles.values()))
    num_prompt_blocks = sum(len(p.block_hashes) for p in workload.prompts)
    return {"plan_us": percentiles_us(plan_ns), "plan_first_us": percentiles_us(first_ns),
            "overlaps_us": percentiles_us(overlaps_ns), "decode_overlap_share": hits / num_prompt_blocks,
            "mean_prompt_blocks": num_prompt_blocks / len(workload.prompts)}


async def measure_cell(shape: WorkloadShape, args: argparse.Namespace) -> dict:
    """One cell's figures (see the module docstring)."""
    started = time.perf_counter()
    workload = build_workload(shape)
    build_s = time.perf_counter() - started
    rng = random.Random(shape.seed)
    workers = list(workload.streams)
    clients = {w: BenchWorker(role_of(i, len(workers)), shape.tokens_per_block, rng) for i, w in enumerate(workers)}
    pool = WorkerPool(workers, clients.__getitem__, PoolConfig(poll_interval_s=3600.0, wait_timeout_s=5.0,
                                                               deployment_id=DeploymentId("bench")), HASH_ALGORITHM)
    await pool.start()
    index = PrefixIndex()
    tasks, ingest = await _ingest(workload, pool, index)
    num_indexed = sum(index.num_blocks(w) for w in workers)
    decide = await _decide(workload, pool, index, shape, args)
    is_synced = all(index.is_synced(w) for w in workers)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    plan, first, overlaps = decide["plan_us"], decide["plan_first_us"], decide["overlaps_us"]
    return {"workers": shape.num_workers, "indexed_blocks": num_indexed, "unique_blocks": workload.num_unique_blocks,
            "events": workload.num_events, "all_synced": is_synced, "ingest_s": ingest["seconds"],
            "ingest_events_per_s": ingest["events_per_s"], "ingest_decode_share": ingest["decode_share"],
            "index_bytes_per_indexed_block": index_bytes(index) / max(num_indexed, 1),
            "plan_us_p50": plan["p50"], "plan_us_p99": plan["p99"],
            "plan_first_us_p50": first["p50"], "plan_first_us_p99": first["p99"],
            "overlaps_us_p50": overlaps["p50"], "overlaps_us_p99": overlaps["p99"],
            "decode_overlap_share": decide["decode_overlap_share"], "mean_prompt_blocks": decide["mean_prompt_blocks"],
            "num_decisions": len(workload.prompts), "build_s": build_s}


def key_hashing_rows(tokens_per_block: int, repeats: int) -> list[dict]:
    """`prompt_block_keys` (SHA-256 chain) per prompt length: per request, whatever the cluster."""
    rows = []
    for num_tokens in (1024, 4096, 8192):
        request = GenerationRequest(RequestId("r"), tuple(range(100, 100 + num_tokens)))
        samples = []
        for _ in range(repeats):
            started = time.perf_counter_ns()
            prompt_block_keys(request, tokens_per_block)
            samples.append(time.perf_counter_ns() - started)
        rows.append({"prompt_tokens": num_tokens, "block_keys_us_median": statistics.median(samples) / 1e3})
    return rows


def run_cell_process(num_workers: int, num_blocks: int, args: argparse.Namespace) -> dict:
    """`measure_cell` in a fresh interpreter: no cell inherits another's heap."""
    command = [sys.executable, str(Path(__file__).resolve()), "--cell", str(num_workers), str(num_blocks),
               "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
               "--in-flight-per-worker", str(args.in_flight_per_worker), "--poll-every", str(args.poll_every),
               "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'workers':>7} {'blocks':>9} {'unique':>9} {'events/s':>10} {'B/block':>8} "
              f"{'plan p50':>9} {'plan p99':>9} {'idx p50':>8} {'idx p99':>8}  (us)", flush=True)
    print(f"{r['workers']:>7} {r['indexed_blocks']:>9} {r['unique_blocks']:>9} {r['ingest_events_per_s']:>10.0f} "
          f"{r['index_bytes_per_indexed_block']:>8.0f} {r['plan_us_p50']:>9.1f} {r['plan_us_p99']:>9.1f} "
          f"{r['overlaps_us_p50']:>8.1f} {r['overlaps_us_p99']:>8.1f}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--quick", action="store_true", help="10k and 100k blocks only, 300 prompts per cell")
    p.add_argument("--workers", type=int, nargs="+", help="worker counts (default 1 8 64)")
    p.add_argument("--blocks", type=int, nargs="+", help="indexed block counts (default 10k 100k 1M)")
    p.add_argument("--num-prompts", type=int, default=None, help="decisions per cell (default 2000; quick 300)")
    p.add_argument("--in-flight-per-worker", type=int, default=8, help="requests booked on the pool")
    p.add_argument("--poll-every", type=int, default=64, help="decisions between load reports")
    p.add_argument("--repeats", type=int, default=3, help="times each decision is taken; the fastest is its cost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cell", type=int, nargs=2, metavar=("WORKERS", "BLOCKS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 300 if args.quick else 2000
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell:
        shape = WorkloadShape(args.cell[0], args.cell[1], num_prompts=args.num_prompts, seed=args.seed)
        print(json.dumps(asyncio.run(measure_cell(shape, args))))
        return 0
    grid = QUICK_GRID if args.quick else FULL_GRID
    workers, blocks = args.workers or grid["workers"], args.blocks or grid["blocks"]
    rows = []
    for num_blocks in blocks:
        for num_workers in workers:
            rows.append(run_cell_process(num_workers, num_blocks, args))
            print_row(rows[-1], header=len(rows) == 1)
    largest = max(rows, key=lambda r: (r["indexed_blocks"], r["workers"]))
    smallest = min(rows, key=lambda r: (r["indexed_blocks"], r["workers"]))
    report = {
        "benchmark": "router_scale",
        "machine": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "cell")} | {"workers": workers,
                                                                                        "blocks": blocks},
        "results": rows,
        "block_keys": key_hashing_rows(WorkloadShape(1, 1).tokens_per_block, repeats=20),
        "ratios": {"plan_p50_largest_over_smallest": largest["plan_us_p50"] / smallest["plan_us_p50"],
                   "plan_p99_largest_over_smallest": largest["plan_us_p99"] / smallest["plan_us_p99"]},
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
