"""pdserve against vLLM, llama.cpp (or any OpenAI-compatible server): the same workloads, one run.

Starts `pdserve serve --aggregated` and `pdserve serve` (1 prefill + 1 decode worker) the way a
user does (with `--torch-ops`, also `--aggregated --kernels torch`: pdserve without its native
kernels), then runs each workload with `pdserve bench` on each of them and on every server given
by `--compare LABEL=URL` (or `--compare-url`), back to back, and reports each system's figures
and the ratios measured side by side. Workloads (each its own seed, so none finds another's prompts cached):

    random     64 prompts, 256 in / 64 out, all at once
    single     8 prompts, 256 in / 64 out, one at a time (batch-1 TPOT)
    prefix192  64 prompts, a 192-token shared prefix + 64 own tokens, 64 out, all at once
    long       32 prompts, 1024 in / 128 out, 8 in flight

Startup rows: seconds from `pdserve serve` to a served `/v1/models`, and the peak RSS summed
over the launcher and its children. Nothing is asserted.

With `--rounds N` every workload runs N times on every system, each round with seeds of its own
and the systems in a rotated order; a row is then the median of its rounds, each ratio the
median of the rounds' ratios (systems measured minutes apart share less of the host's drift
than those measured back to back), and `ratios_by_round` keeps each round's, so the spread of
this machine's noise is there to read. Peak memory grows with traffic (the allocator's arenas, to a
plateau), so the startup row then also gives the peak after the first round.

    python benchmarks/vs_vllm.py --json vs-vllm.json
    python benchmarks/vs_vllm.py --model CKPT_DIR --compare-url http://127.0.0.1:8001 --compare-label vllm
    python benchmarks/vs_vllm.py --model CKPT_DIR --torch-ops single --compare vllm=http://127.0.0.1:8001 \
        --compare llama.cpp=http://127.0.0.1:8002
    python benchmarks/vs_vllm.py --scale 0.25      # every prompt count a quarter (a quick look)
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.model_source import default_model_path

from serving_load import Workload, ratio, run_online
from serving_stack import COMMAND, READY_TIMEOUT_S, descendants, free_port, stop_process, vm_hwm_mib, work_dir

TOPOLOGIES = {"pdserve-agg": ["--aggregated"], "pdserve-disagg": []}
TORCH_OPS = {"pdserve-agg-torch": ["--aggregated", "--kernels", "torch"]}  # with --torch-ops
COMPARED = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")


def workloads(scale: float, seed: int) -> list[Workload]:
    def n(count: int) -> int:
        return max(1, round(count * scale))
    return [Workload("random", n(64), 256, 64, max_concurrency=n(64), seed=seed),
            Workload("single", n(8), 256, 64, max_concurrency=1, seed=seed + 1),
            Workload("prefix192", n(64), 256, 64, prefix_len=192, max_concurrency=n(64), seed=seed + 2),
            Workload("long", n(32), 1024, 128, max_concurrency=8, seed=seed + 3)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--keep-dir", metavar="DIR", help="keep logs and raw bench JSON here")
    parser.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    parser.add_argument("--serve-flags", default="", help="extra `pdserve serve` flags, e.g. '--kernels torch'")
    parser.add_argument("--only", action="append", choices=[*TOPOLOGIES, *TORCH_OPS],
                        help="run only this topology")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's prompt count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="run every workload this many times (medians)")
    parser.add_argument("--compare-url", help="another OpenAI-compatible server to run the workloads on")
    parser.add_argument("--compare-model", help="model name there (default: first of its /v1/models)")
    parser.add_argument("--compare-label", default="other", help="its name in the results")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=URL",
                        help="one more server to run the workloads on (repeatable; model: first of its /v1/models)")
    parser.add_argument("--torch-ops", nargs="*", metavar="WORKLOAD", default=None,
                        choices=["random", "single", "prefix192", "long"],
                        help="also measure `pdserve serve --aggregated --kernels torch` (pdserve-agg-torch), on "
                             "these workloads (none named: all; torch ops take ~10x as long as the rest)")
    args = parser.parse_args(argv)
    for spec in args.compare:
        if "=" not in spec:
            parser.error(f"--compare {spec!r}: give LABEL=URL")
    return args


def runs_on(system: str, workload: str, args: argparse.Namespace) -> bool:
    """Whether `system` runs `workload` (the torch-ops system only the workloads asked for)."""
    return system not in TORCH_OPS or not args.torch_ops or workload in args.torch_ops


def compared(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(label, url, model) of every other server to measure."""
    servers = [(args.compare_label, args.compare_url, args.compare_model)] if args.compare_url else []
    for spec in args.compare:
        label, url = spec.split("=", 1)
        servers.append((label, url.rstrip("/"), None))
    return servers


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2.0) as response:
            return response.status == 200
    except OSError:
        return False


@dataclass
class Served:
    """A running `pdserve serve` topology."""

    name: str
    url: str
    process: subprocess.Popen
    ready_s: float

    def peak_rss_mib(self) -> float:
        return sum(vm_hwm_mib(pid) or 0.0 for pid in [self.process.pid, *descendants(self.process.pid)])

    def startup_row(self, first_round_peak: float | None = None) -> dict:
        row = {"system": self.name, "workload": "startup", "ready_s": self.ready_s, "peak_rss_mib_all": self.peak_rss_mib()}
        return row if first_round_peak is None else {**row, "peak_rss_mib_first_round": first_round_peak}


def start_topology(name: str, flags: list[str], model: str, out_dir: Path, stack: ExitStack) -> Served:
    """`pdserve serve` with `flags`, ready; stopped when `stack` closes."""
    port, worker_port = free_port(), free_port()
    argv = [*COMMAND, "serve", "--model", model, "--port", str(port), "--worker-port", str(worker_port),
            "--max-num-seqs", "64", "--log-level", "warning", *flags]
    url = f"http://127.0.0.1:{port}"
    print(f"{name}: {' '.join(argv[2:])}", flush=True)
    log = stack.enter_context(open(out_dir / f"{name}.log", "w"))
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(stop_process, process)
    while not _is_ready(url):
        if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
            raise RuntimeError(f"{name} did not become ready; see {out_dir / (name + '.log')}")
        time.sleep(0.2)
    return Served(name, url, process, time.monotonic() - started)


def measure_topology(name: str, flags: list[str], model: str, runs: list[Workload], out_dir: Path) -> list[dict]:
    """`pdserve serve` with `flags`: one row per workload of `runs`, then its startup row."""
    with ExitStack() as stack:
        served = start_topology(name, flags, model, out_dir, stack)
        rows = [run_online(name, w, served.url, model, None, out_dir) for w in runs]
        return [served.startup_row(), *rows]


def ratios(rows: list[dict], labels: list[str]) -> dict[str, float | None]:
    """Every system's figures over each other server's (`labels`) and over pdserve-agg's."""
    by = {(r["system"], r["workload"]): r for r in rows}
    found: dict[str, float | None] = {}
    for (system, workload), row in by.items():
        if workload == "startup":
            continue
        for other in (*labels, "pdserve-agg"):
            base = by.get((other, workload))
            if base is None or other == system or system in labels:
                continue
            for metric in COMPARED:
                found[f"{metric} ({workload}): {system} / {other}"] = ratio(row[metric], base[metric])
    return found


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (system, workload): each figure the median of its rounds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["workload"]), []).append(row)
    merged = []
    for (system, workload), group in groups.items():
        row = {"system": system, "workload": workload, "rounds": len(group)}
        for key in group[0]:
            values = [r[key] for r in group if isinstance(r.get(key), (int, float))]
            if key not in row and key != "round" and len(values) == len(group):
                row[key] = statistics.median(values)
        merged.append(row)
    return merged


def ratios_by_round(rows: list[dict], labels: list[str]) -> dict[str, list[float | None]]:
    """Each round's ratios, side by side per ratio."""
    found: dict[str, list[float | None]] = {}
    for r in sorted({row["round"] for row in rows}):
        for key, value in ratios([row for row in rows if row["round"] == r], labels).items():
            found.setdefault(key, []).append(value)
    return found


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    model = args.model or default_model_path()
    measured = []
    with work_dir(args.keep_dir, "vs-vllm-") as out_dir, ExitStack() as stack:
        # Every system is up before the first workload, and each workload runs on all of them
        # back to back: the load of this shared machine drifts over a run, so a system measured
        # minutes after another would carry the drift into the ratios.
        topologies = {**TOPOLOGIES, **(TORCH_OPS if args.torch_ops is not None else {})}
        servers = [start_topology(name, flags + args.serve_flags.split(), model, out_dir, stack)
                   for name, flags in topologies.items() if not args.only or name in args.only]
        targets = [(s.name, s.url, None) for s in servers] + compared(args)
        first_round_peaks: dict[str, float] = {}
        for r in range(args.rounds):
            round_dir = out_dir / f"round-{r}" if args.rounds > 1 else out_dir
            round_dir.mkdir(exist_ok=True)
            order = targets[r % len(targets):] + targets[:r % len(targets)]  # who goes first rotates
            for workload in workloads(args.scale, args.seed + 10 * r):
                measured += [{**run_online(name, workload, url, model, served_model, round_dir), "round": r}
                             for name, url, served_model in order if runs_on(name, workload.name, args)]
            if r == 0 and args.rounds > 1:  # the peak one run of the workloads reaches, as with --rounds 1
                first_round_peaks = {s.name: s.peak_rss_mib() for s in servers}
        startup = [s.startup_row(first_round_peaks.get(s.name)) for s in servers]
    rows = startup + median_rows(measured)
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model,
              "workloads": [w.as_dict() for r in range(args.rounds) for w in workloads(args.scale, args.seed + 10 * r)]}
    labels = [label for label, _, _ in compared(args)]
    result = {"benchmark": "vs_vllm", "config": config, "results": rows, "ratios": ratios(rows, labels)}
    if args.rounds > 1:
        by_round = ratios_by_round(measured, labels)
        result.update(ratios={key: median_of(values) for key, values in by_round.items()},
                      ratios_by_round=by_round, rounds=measured)
    print(json.dumps({k: v for k, v in result.items() if k in ("results", "ratios", "ratios_by_round")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
