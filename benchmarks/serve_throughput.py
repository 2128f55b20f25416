"""Serving throughput and latency of pdserve aggregated: one worker (role both) + router.

Starts the processes itself on loopback, then measures, in one run:
- start-to-ready time of the worker and of the router, and the worker's peak RSS (VmHWM)
  once ready and after the load;
- offline: every prompt sent at once straight to the worker over gRPC, output tokens/s;
- online, through the router with `pdserve bench`: random prompts at `--max-concurrency`
  (default 64 x 256 in / 64 out, ignore_eos), and the same total length with a shared
  `--prefix-len` prefix (prefix caching on): TTFT / TPOT / ITL / E2EL percentiles, throughput.
`--compare-url` runs the same online workloads (same text, same seed) against any other
OpenAI-compatible server right after, and reports pdserve / other ratios. Nothing is asserted.

Each workload draws its own prompts (seeds `--seed`, +1, +2 for offline), so none finds
another's prompts in the prefix cache. The compared server keeps its cache between runs:
give each run another `--seed`, or restart that server.

    python benchmarks/serve_throughput.py --json serve.json
    python benchmarks/serve_throughput.py --num-prompts 8 --input-len 64 --output-len 16 --prefix-len 48
    python benchmarks/serve_throughput.py --random-160m --json serve-160m.json
    python benchmarks/serve_throughput.py --compare-url http://127.0.0.1:8001 --compare-label vllm
"""
import argparse
import json
import sys
from pathlib import Path

from pdserve.common.model_source import default_model_path
from pdserve.models.tokenizer import load_tokenizer

from serving_load import Workload, ratio, run_offline, run_online
from serving_stack import ServingStack, make_random_160m, vm_hwm_mib, work_dir

COMPARED = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--keep-dir", metavar="DIR", help="keep process logs and raw `pdserve bench` JSON here "
                        "(default: a temporary directory, removed at the end)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    model.add_argument("--random-160m", action="store_true",
                       help="serve a random-weight Llama (hidden 1024, 8 layers, vocab 32000) made here")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens, shared prefix included")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=192, help="shared prefix of the prefix workload")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, help="the worker's torch threads (default: torch's)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="the worker's KV cache bytes (it is "
                        "touched at start, so it counts in the peak RSS)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--compare-url", help="another OpenAI-compatible server to run the online workloads on")
    parser.add_argument("--compare-model", help="model name there (default: first of its /v1/models)")
    parser.add_argument("--compare-label", default="other", help="its name in the results")
    args = parser.parse_args(argv)
    if not 0 <= args.prefix_len < args.input_len:
        parser.error(f"--prefix-len {args.prefix_len} must be in [0, --input-len {args.input_len})")
    return args


def workloads(args: argparse.Namespace) -> list[Workload]:
    """The online workloads: random, then the same lengths with a shared prefix."""
    common = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups}
    return [Workload("random", seed=args.seed, **common),
            Workload(f"prefix{args.prefix_len}", prefix_len=args.prefix_len, seed=args.seed + 1, **common)]


def worker_flags(args: argparse.Namespace, model: str) -> list[str]:
    flags = ["--model", model, "--device", "cpu", "--dtype", args.dtype, "--max-num-seqs",
             str(max(args.max_concurrency, args.num_prompts)), "--kv-cache-memory", args.kv_cache_memory,
             "--log-level", "warning"]
    return flags + (["--num-threads", str(args.num_threads)] if args.num_threads else [])


def measure_pdserve(args: argparse.Namespace, model: str, out_dir: Path) -> list[dict]:
    """Startup row, offline row and one row per online workload."""
    online = workloads(args)
    rows = []
    with ServingStack(out_dir) as stack:
        worker = stack.start_worker("worker", worker_flags(args, model))
        hwm_at_ready = vm_hwm_mib(worker.pid)
        router = stack.start_router([worker], ["--model", model, "--log-level", "warning"])
        if not args.skip_offline:
            offline = Workload("offline", args.num_prompts, args.input_len, args.output_len,
                               num_warmups=args.num_warmups, seed=args.seed + 2)
            rows.append(run_offline("pdserve", offline, worker.address, load_tokenizer(model), stack.client_tls()))
        rows += [run_online("pdserve", w, router.address, model, None, out_dir) for w in online]
        rows.insert(0, {"system": "pdserve", "workload": "startup", "worker_ready_s": worker.ready_s,
                        "router_ready_s": router.ready_s, "worker_peak_rss_mib_ready": hwm_at_ready,
                        "worker_peak_rss_mib": vm_hwm_mib(worker.pid)})
    return rows


def measure_other(args: argparse.Namespace, model: str, out_dir: Path) -> list[dict]:
    return [run_online(args.compare_label, w, args.compare_url, model, args.compare_model, out_dir)
            for w in workloads(args)]


def ratios(rows: list[dict], label: str) -> dict[str, float | None]:
    """Same-run ratios: prefix over random, online over offline, pdserve over the other server."""
    ours = {r["workload"]: r for r in rows if r["system"] == "pdserve"}
    theirs = {r["workload"]: r for r in rows if r["system"] == label}
    prefix = next((name for name in ours if name.startswith("prefix")), None)
    found: dict[str, float | None] = {}
    if "random" in ours and prefix:
        for metric in ("ttft_p50_ms", "output_tok_s"):
            found[f"pdserve {metric}: {prefix} / random"] = ratio(ours[prefix][metric], ours["random"][metric])
    if "offline" in ours and "random" in ours:
        found["pdserve output_tok_s: online random / offline"] = ratio(
            ours["random"]["output_tok_s"], ours["offline"]["output_tok_s"])
    for workload, row in theirs.items():
        for metric in COMPARED:
            found[f"{metric} ({workload}): pdserve / {label}"] = ratio(ours[workload][metric], row[metric])
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with work_dir(args.keep_dir, "serve-throughput-") as out_dir:
        model, num_params = args.model or default_model_path(), None
        if args.random_160m:
            (out_dir / "random-160m").mkdir(exist_ok=True)
            path, num_params = make_random_160m(out_dir / "random-160m")
            model = str(path)
        rows = measure_pdserve(args, model, out_dir)
        if args.compare_url:
            rows += measure_other(args, model, out_dir)
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model, "num_params": num_params,
              "workloads": [w.as_dict() for w in workloads(args)]}
    result = {"benchmark": "serve_throughput", "config": config, "results": rows,
              "ratios": ratios(rows, args.compare_label)}
    print(json.dumps({"results": rows, "ratios": result["ratios"]}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
