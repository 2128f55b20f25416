"""KV cache manager bookkeeping cost and hit rate on a synthetic shared-prefix trace.

Replays the same trace through priority eviction and through plain LRU, side by side in one run:
each request is analysed, claimed, computed and freed. Prints a table; `--json PATH` writes it.
A benchmark, not a test: nothing here is asserted.

    python benchmarks/kvcache_ops.py --num-requests 10000 --json kvcache_ops.json
"""
import argparse
import json
import platform
import random
import time

from pdserve.common.ids import RequestId
from pdserve.common.request import PriorityRange
from pdserve.kvcache import CacheRequest, KvCacheConfig, KvCacheManager


def make_trace(args: argparse.Namespace) -> list[CacheRequest]:
    """Prefixes of 1..64 blocks with Zipf-like popularity; the hottest few are high-priority system prompts."""
    rng = random.Random(args.seed)
    tpb = args.tokens_per_block
    prefixes = [[rng.randrange(32_000) for _ in range(tpb * rng.randint(1, 64))] for _ in range(args.num_prefixes)]
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(args.num_prefixes)]
    trace = []
    for i in range(args.num_requests):
        p = rng.choices(range(args.num_prefixes), weights)[0]
        suffix = [rng.randrange(32_000) for _ in range(rng.randint(1, 4 * tpb))]
        prio = (PriorityRange(0, len(prefixes[p]), 80),) if p < args.num_system_prompts else ()
        trace.append(CacheRequest(RequestId(f"r{i}"), prefixes[p] + suffix, priorities=prio))
    return trace


def replay(trace: list[CacheRequest], policy: str, args: argparse.Namespace) -> dict:
    manager = KvCacheManager(
        KvCacheConfig(tokens_per_block=args.tokens_per_block, eviction_policy=policy, event_buffer_max_size=1000),
        args.num_blocks,
    )
    for request in trace:  # block keys are the router's to compute once; keep hashing out of the timing
        request.block_hashes(args.tokens_per_block)
    num_blocks = hit_tokens = prompt_tokens = 0
    start = time.perf_counter()
    for request in trace:
        analysis = manager.analyze_prefix_reuse(request)
        claim = manager.add_sequence(request)
        manager.mark_computed(request.request_id, len(request.token_ids) - claim.num_cached_tokens)
        manager.free(request.request_id)
        manager.drain_events()
        num_blocks += len(claim.block_ids)
        hit_tokens += analysis.num_cached_tokens
        prompt_tokens += len(request.token_ids)
    elapsed = time.perf_counter() - start
    manager.check_integrity()
    return {
        "policy": policy,
        "us_per_request": 1e6 * elapsed / len(trace),
        "blocks_per_s": num_blocks / elapsed,
        "hit_rate": hit_tokens / prompt_tokens,
        "num_requests": len(trace),
        "num_blocks_claimed": num_blocks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--num-prefixes", type=int, default=300)
    parser.add_argument("--num-system-prompts", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=2048, help="capacity; small enough to force eviction")
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    trace = make_trace(args)
    rows = [replay(trace, "priority", args), replay(make_trace(args), "lru", args)]
    report = {
        "benchmark": "kvcache_ops",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "results": rows,
        "ratios": {
            "hit_rate_priority_over_lru": rows[0]["hit_rate"] / max(rows[1]["hit_rate"], 1e-9),
            "us_per_request_priority_over_lru": rows[0]["us_per_request"] / rows[1]["us_per_request"],
        },
    }
    print(f"{'policy':<10}{'us/request':>12}{'blocks/s':>14}{'hit rate':>10}")
    for r in rows:
        print(f"{r['policy']:<10}{r['us_per_request']:>12.1f}{r['blocks_per_s']:>14.0f}{r['hit_rate']:>10.3f}")
    print(f"hit-rate ratio priority/LRU: {report['ratios']['hit_rate_priority_over_lru']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
