"""Disaggregated against aggregated pdserve on one workload, each behind a pdserve router.

Topologies, started one after another by this script on loopback (same model, same workload,
same seed, so every topology gets the same text):
- `agg-1`:  one role=both worker with every core (the single-process baseline);
- `agg-2`:  two role=both workers, `--num-threads 1` each, the router balancing them;
- `disagg`: one prefill + one decode worker, `--num-threads 1` each; prompts are prefilled on
  the prefill worker and their KV pushed over NIXL into the decode worker.
Per topology: start-to-ready times and summed worker peak RSS, then `pdserve bench` through the
router for random prompts and for the same length with a shared prefix: throughput, TTFT /
TPOT / ITL percentiles. The decode worker's transfer counters show how many prompts actually
moved KV and how many were prefilled locally. Ratios: disagg over agg-2, each over agg-1.

    python benchmarks/disagg_vs_agg.py --json disagg.json
    python benchmarks/disagg_vs_agg.py --num-prompts 8 --input-len 64 --output-len 16 --prefix-len 48
"""
import argparse
import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.model_source import default_model_path

from serving_load import Workload, ratio, run_online
from serving_stack import ServingStack, free_port, vm_hwm_mib, work_dir

COMPARED = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
TRANSFER_METRICS = ("pdserve_kv_transfer_blocks_count", "pdserve_kv_transfer_blocks_sum",
                    "pdserve_kv_transfer_failures_total", "pdserve_local_prefills_total")  # line prefixes


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    roles: tuple[str, ...]
    num_threads: int | None  # None: torch's default (every core)


TOPOLOGIES = (Topology("agg-1", ("both",), None), Topology("agg-2", ("both", "both"), 1),
              Topology("disagg", ("prefill", "decode"), 1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--keep-dir", metavar="DIR", help="keep process logs and raw `pdserve bench` JSON here "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens, shared prefix included")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=192, help="shared prefix of the prefix workload")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="each worker's KV cache bytes")
    parser.add_argument("--routing-policy", default="kv_aware", help="the router's --routing-policy")
    parser.add_argument("--only", action="append", choices=[t.name for t in TOPOLOGIES],
                        help="run only this topology (repeatable)")
    args = parser.parse_args(argv)
    if not 0 <= args.prefix_len < args.input_len:
        parser.error(f"--prefix-len {args.prefix_len} must be in [0, --input-len {args.input_len})")
    return args


def workloads(args: argparse.Namespace) -> list[Workload]:
    """Random prompts, then the same lengths with a shared prefix: each its own seed, so the
    second finds nothing of the first in the prefix cache."""
    common = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups}
    return [Workload("random", seed=args.seed, **common),
            Workload(f"prefix{args.prefix_len}", prefix_len=args.prefix_len, seed=args.seed + 1, **common)]


def worker_flags(args: argparse.Namespace, model: str, role: str, threads: int | None, metrics_port: int) -> list[str]:
    flags = ["--model", model, "--role", role, "--device", "cpu", "--dtype", args.dtype,
             "--max-num-seqs", str(max(args.max_concurrency, args.num_prompts)),
             "--kv-cache-memory", args.kv_cache_memory, "--metrics-port", str(metrics_port), "--log-level", "warning"]
    return flags + (["--num-threads", str(threads)] if threads else [])


def transfer_counters(metrics_port: int) -> dict[str, float]:
    """The decode worker's KV transfer counters, one entry per metric and label set."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5.0) as response:
        lines = response.read().decode().splitlines()
    found = {}
    for line in lines:
        if line.startswith(TRANSFER_METRICS):
            key, value = line.rsplit(" ", 1)
            found[key.removeprefix("pdserve_")] = float(value)
    return found


def measure(args: argparse.Namespace, topology: Topology, model: str, out_dir: Path) -> list[dict]:
    """Start the topology, run every workload through its router, stop it."""
    log_dir = out_dir / topology.name
    log_dir.mkdir(exist_ok=True)
    ports = [free_port() for _ in topology.roles]
    with ServingStack(log_dir) as stack:
        workers = [stack.start_worker(f"{role}{i}", worker_flags(args, model, role, topology.num_threads, port))
                   for i, (role, port) in enumerate(zip(topology.roles, ports))]
        router = stack.start_router(workers, ["--model", model, "--routing-policy", args.routing_policy,
                                              "--log-level", "warning"])
        rows = [run_online(topology.name, w, router.address, model, None, log_dir) for w in workloads(args)]
        startup = {"system": topology.name, "workload": "startup",
                   "worker_ready_s": max(w.ready_s for w in workers), "router_ready_s": router.ready_s,
                   "workers_peak_rss_mib": sum(vm_hwm_mib(w.pid) or 0.0 for w in workers)}
        if "decode" in topology.roles:
            startup.update(transfer_counters(ports[topology.roles.index("decode")]))
    return [startup, *rows]


def ratios(rows: list[dict]) -> dict[str, float | None]:
    by_key = {(r["system"], r["workload"]): r for r in rows}
    found: dict[str, float | None] = {}
    pairs = [("disagg", "agg-2"), ("disagg", "agg-1"), ("agg-2", "agg-1")]
    for workload in sorted({w for _, w in by_key if w != "startup"}):
        for ours, base in pairs:
            if (ours, workload) in by_key and (base, workload) in by_key:
                for metric in COMPARED:
                    found[f"{metric} ({workload}): {ours} / {base}"] = ratio(
                        by_key[(ours, workload)][metric], by_key[(base, workload)][metric])
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path()
    chosen = [t for t in TOPOLOGIES if args.only is None or t.name in args.only]
    rows = []
    with work_dir(args.keep_dir, "disagg-vs-agg-") as out_dir:
        for topology in chosen:
            print(f"disagg_vs_agg: {topology.name} ({', '.join(topology.roles)})", flush=True)
            rows += measure(args, topology, model, out_dir)
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model,
              "topologies": [{"name": t.name, "roles": t.roles, "num_threads": t.num_threads} for t in chosen],
              "workloads": [w.as_dict() for w in workloads(args)]}
    result = {"benchmark": "disagg_vs_agg", "config": config, "results": rows, "ratios": ratios(rows)}
    print(json.dumps({"results": rows, "ratios": result["ratios"]}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
