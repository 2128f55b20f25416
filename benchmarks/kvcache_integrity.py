"""`KvCacheManager.check_integrity()` cost against the number of blocks.

The worker runs the check on its engine thread (the `CheckKvIntegrity` RPC), so it must stay
linear in blocks. Each size is filled the same way: a quarter of the blocks in use by live
sequences, half cached-free (one-block prompts, so every one is an evictable leaf, the case
that costs most), the rest free. Prints a table; `--json PATH` writes it.
A benchmark, not a test: nothing here is asserted.

    python benchmarks/kvcache_integrity.py --sizes 1024 4096 16384 --json kvcache_integrity.json
"""
import argparse
import json
import platform
import time

from pdserve.common.ids import RequestId
from pdserve.kvcache import CacheRequest, KvCacheConfig, KvCacheManager


def make_filled_manager(num_blocks: int, tokens_per_block: int) -> KvCacheManager:
    manager = KvCacheManager(KvCacheConfig(tokens_per_block=tokens_per_block, event_buffer_max_size=0), num_blocks)
    for i in range(num_blocks // 2):  # cached-free leaves
        request = CacheRequest(RequestId(f"c{i}"), [i, *range(1, tokens_per_block)])
        manager.add_sequence(request)
        manager.mark_computed(request.request_id, tokens_per_block)
        manager.free(request.request_id)
    for i in range(num_blocks // 4):  # in use, one block each
        manager.add_sequence(CacheRequest(RequestId(f"u{i}"), [num_blocks + i] * (tokens_per_block - 1)))
    return manager


def measure(num_blocks: int, args: argparse.Namespace) -> dict:
    manager = make_filled_manager(num_blocks, args.tokens_per_block)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        manager.check_integrity()
        times.append(time.perf_counter() - start)
    best = min(times)
    return {"num_blocks": num_blocks, "ms": 1e3 * best, "us_per_block": 1e6 * best / num_blocks,
            "num_used_blocks": manager.num_used_blocks, "num_cached_blocks": len(manager.pool.cached)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many checks per size")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = [measure(n, args) for n in args.sizes]
    report = {
        "benchmark": "kvcache_integrity",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "results": rows,
        # 1.0 when linear; 16.0 for 16x the blocks when quadratic
        "ratios": {"us_per_block_largest_over_smallest": rows[-1]["us_per_block"] / rows[0]["us_per_block"]},
    }
    print(f"{'blocks':>8}{'ms':>12}{'us/block':>10}")
    for r in rows:
        print(f"{r['num_blocks']:>8}{r['ms']:>12.2f}{r['us_per_block']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
