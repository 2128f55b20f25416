"""A burst against `pdserve serve` as a new user runs it: the default 1 prefill + 1 decode
topology and `--aggregated`, one after the other, each sent every prompt of one random workload
at once (64 prompts of 256 tokens, 64 out by default: what `vllm bench serve --dataset-name
random --num-prompts 64` sends). Per topology: throughput and TTFT / TPOT percentiles, and from
the decode worker's metrics how its prompts were prefilled (KV moved, prefilled locally and
why) and how many transfers failed or timed out. Ratios: 1P+1D over aggregated.

    python benchmarks/burst.py --json burst.json
    python benchmarks/burst.py --num-prompts 8 --input-len 64 --output-len 8 --model PATH
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.common.model_source import default_model_path
from pdserve.common.ports import is_port_free

from serving_load import Workload, ratio, run_online
from serving_stack import free_port, stop_process, work_dir

READY_TIMEOUT_S = 300.0
TOPOLOGIES = {"1p1d": (), "aggregated": ("--aggregated",)}
COUNTERS = ("pdserve_kv_transfer_failures_total", "pdserve_local_prefills_total", "pdserve_kv_transfer_blocks_count")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or checkpoint directory (default: the bundled model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags for both topologies")
    parser.add_argument("--only", action="append", choices=tuple(TOPOLOGIES), help="run only this topology")
    parser.add_argument("--keep-dir", help="keep serve's logs and the bench JSON here")
    parser.add_argument("--json", help="write the report here")
    return parser.parse_args(argv)


def start_serve(name: str, flags: tuple[str, ...], args: argparse.Namespace,
                directory: Path) -> tuple[subprocess.Popen, str, list[int]]:
    """`pdserve serve` until its banner: the process, the router URL and the workers' metrics ports."""
    port, metrics = free_port(), free_port()
    while not is_port_free("127.0.0.1", metrics + 1):  # serve puts worker i on the base + i
        metrics = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--metrics-port", str(metrics),
               *(["--model", args.model] if args.model else []), *flags, *args.serve_flags.split()]
    out_path, err_path = directory / f"{name}.out", directory / f"{name}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        serve = subprocess.Popen(command, stdout=out, stderr=err)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "pdserve is ready" not in out_path.read_text():
        if serve.poll() is not None or time.monotonic() > deadline:
            stop_process(serve)
            raise SystemExit(f"serve ({name}) did not start:\n{err_path.read_text()[-3000:]}")
        time.sleep(0.5)
    ports = [int(p) for p in re.findall(r"metrics port (\d+)", out_path.read_text())]
    return serve, f"http://127.0.0.1:{port}", ports


def counters(metrics_ports: list[int]) -> dict[str, float]:
    """The transfer and local-prefill counters, summed over the workers, by series."""
    found: dict[str, float] = {}
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(COUNTERS):
                    series, value = line.rsplit(" ", 1)
                    found[series] = found.get(series, 0.0) + float(value)
    return found


def measure(name: str, args: argparse.Namespace, directory: Path) -> dict:
    workload = Workload("burst", args.num_prompts, args.input_len, args.output_len, max_concurrency=None,
                        num_warmups=args.num_warmups, seed=args.seed)
    serve, url, metrics_ports = start_serve(name, TOPOLOGIES[name], args, directory)
    try:
        before = counters(metrics_ports)
        row = run_online(name, workload, url, args.model or str(default_model_path()), None, directory)
        after = counters(metrics_ports)
    finally:
        stop_process(serve)
    moved = {series: after[series] - before.get(series, 0.0) for series in after}
    row["counters"] = {series: value for series, value in moved.items() if value}
    row["transfer_failures"] = sum(v for s, v in moved.items() if s.startswith("pdserve_kv_transfer_failures_total"))
    row["remote_prefills"] = moved.get('pdserve_kv_transfer_blocks_count{direction="received"}', 0.0)
    row["local_prefills"] = sum(v for s, v in moved.items() if s.startswith("pdserve_local_prefills_total"))
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.only or list(TOPOLOGIES)
    with work_dir(args.keep_dir, "pdserve-burst-") as directory:
        rows = []
        for name in names:
            print(f"burst: {name}", flush=True)
            rows.append(measure(name, args, directory))
    by_name = {row["system"]: row for row in rows}
    ratios = {}
    if {"1p1d", "aggregated"} <= by_name.keys():
        for metric in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s"):
            ratios[f"{metric}: 1p1d / aggregated"] = ratio(by_name["1p1d"][metric], by_name["aggregated"][metric])
    config = {key: value for key, value in vars(args).items() if key not in ("json", "keep_dir")}
    config |= {"model": Path(args.model or default_model_path()).name, "machine": platform.machine(),
               "cpus": os.cpu_count()}
    report = {"benchmark": "burst", "config": config, "results": rows, "ratios": ratios}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
