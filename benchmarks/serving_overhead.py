"""What serving costs apart from the model: CPU seconds of the router and of each worker per
1,000 output tokens, at 1 and at 64 concurrent streams, an older commit against this working
tree in one run.

Each worker runs with a stub forward that returns fixed logits (`stub_forward/sitecustomize.py`,
put first on the workers' PYTHONPATH; nothing of the package changes), so what the processes
spend is scheduling, KV bookkeeping, sampling, detokenizing, the RPCs and HTTP streaming. The
older commit (`--before`, default `9e25faf^`: the commit before "One output stream per router
and worker") is checked out with `git worktree add` into a temporary folder, given this tree's
compiled native kernels (untracked build outputs), and removed at the end; each tree's
processes run with its own `services` first on PYTHONPATH. Workers run `--kernels torch` on
one thread: the stubbed forward runs no kernel.

Per tree and repetition: a router and one `--role both` worker (`--topology disagg`: one
prefill and one decode worker) on a tiny random-weight checkpoint, then per `--streams` value a
warm-up round (one request per stream) and the measured window: each stream sends
`--requests-per-stream` requests one after another (default: enough for `--min-tokens` output
tokens), random `--prompt-len`-token prompts, `--max-tokens` out with `ignore_eos`. CPU is
utime + stime from /proc/<pid>/stat (every thread, reaped children, live descendants) just
before and after the window; the client's own CPU is reported beside, not counted. ITL: the
gaps between a stream's chunks, pooled over the window. The trees take turns first
(`--repeats`); the summary holds medians over the repetitions, ratios after / before beside.

    python benchmarks/serving_overhead.py --json overhead.json
    python benchmarks/serving_overhead.py --before none --streams 1,4 --max-tokens 8 --min-tokens 64
"""
import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.client import stream_request
from pdserve.models.tokenizer import load_tokenizer

from routing import tiny_checkpoint
from serving_stack import ServingStack, Started, descendants, work_dir

ROOT = Path(__file__).resolve().parents[1]
STUB_DIR = Path(__file__).resolve().parent / "stub_forward"
STUB_LINE = "pdserve benchmark stub: fixed-logits forward in"  # what the stub writes to stderr
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GIT_TIMEOUT_S = 300.0
ROLES = {"agg": ("both",), "disagg": ("prefill", "decode")}
PER_1K = "cpu_s_per_1k_tokens"


@dataclass(frozen=True, slots=True)
class Tree:
    """A checkout whose `services` the processes import: "before" (a worktree) or "after" (this one)."""

    name: str
    root: Path
    commit: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", "--out", dest="json", type=Path, help="write the report here "
                   "(default: serving-overhead-<time>.json in the temporary folder)")
    p.add_argument("--before", default="9e25faf^",
                   help="the commit measured against this tree ('none': this tree alone)")
    p.add_argument("--model", help="checkpoint (default: a 2-layer random-weight Llama with SmolLM2's tokenizer)")
    p.add_argument("--topology", choices=tuple(ROLES), default="agg")
    p.add_argument("--streams", default="1,64", help="concurrent streams, comma-separated")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=16384, help="output tokens of a window at the least")
    p.add_argument("--requests-per-stream", type=int, help="instead of --min-tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--keep-dir", help="keep logs here")
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    return args


def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=True,
                          timeout=GIT_TIMEOUT_S).stdout.strip()


@contextlib.contextmanager
def before_tree(ref: str, scratch: Path) -> Iterator[Tree]:
    """`ref` checked out in a worktree under `scratch`, with this tree's compiled extensions
    (untracked build outputs) at the same paths; the worktree is removed afterwards."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    root = scratch / "before-tree"
    git("worktree", "add", "--detach", str(root), commit)
    try:
        for built in (ROOT / "services").rglob("*.so"):
            target = root / built.relative_to(ROOT)
            if target.parent.is_dir():
                shutil.copy2(built, target)
        yield Tree("before", root, commit)
    finally:  # not git(): a failed removal must not hide what failed before it
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(root)], capture_output=True,
                       timeout=GIT_TIMEOUT_S)
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True, timeout=GIT_TIMEOUT_S)


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads) and of its reaped children, plus its live descendants'."""
    def ticks(p: int, with_children: bool) -> int:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0
        # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14-17
        return sum(int(f) for f in fields[11:15 if with_children else 13])
    return (ticks(pid, True) + sum(ticks(child, False) for child in descendants(pid))) / CLOCK_TICKS


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(count)]


async def run_streams(url: str, streams: list[list[list[int]]], args: argparse.Namespace) -> list:
    """Each stream sends its prompts one after another, the streams at once; every StreamResult."""
    body = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one_stream(http: httpx.AsyncClient, own: list[list[int]]) -> list:
        return [await stream_request(http, f"{url}/v1/completions", {**body, "prompt": p}, args.request_timeout)
                for p in own]

    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as http:
        return [r for rs in await asyncio.gather(*(one_stream(http, s) for s in streams)) for r in rs]


def percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def measure_window(router: Started, processes: dict[str, int], num_streams: int, rng: random.Random,
                   args: argparse.Namespace) -> dict:
    """A warm-up round, then the measured window at `num_streams`: CPU per process, tokens, ITL."""
    per_stream = args.requests_per_stream or -(-args.min_tokens // (num_streams * args.max_tokens))
    asyncio.run(run_streams(router.address, [prompts(rng, 1, args.prompt_len) for _ in range(num_streams)], args))
    load = [prompts(rng, per_stream, args.prompt_len) for _ in range(num_streams)]
    cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    client_before, started = time.process_time(), time.perf_counter()
    results = asyncio.run(run_streams(router.address, load, args))
    wall_s, client_s = time.perf_counter() - started, time.process_time() - client_before
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in processes.items()}
    done = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens or len(r.chunk_times) for r in done)
    itl_ms = [(b - a) * 1000 for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    per_1k = {f"{name}_{PER_1K}": cpu_s / tokens * 1000 if tokens else None for name, cpu_s in cpu.items()}
    return {"streams": num_streams, "requests": len(results), "failed": len(results) - len(done),
            "first_error": next((r.error for r in results if r.error), None), "output_tokens": tokens,
            "expected_tokens": len(results) * args.max_tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
            "cpu_s": cpu, **per_1k, f"total_{PER_1K}": sum(cpu.values()) / tokens * 1000 if tokens else None,
            f"client_{PER_1K}": client_s / tokens * 1000 if tokens else None,
            "itl_p50_ms": percentile(itl_ms, 50), "itl_p99_ms": percentile(itl_ms, 99),
            "load_1m": os.getloadavg()[0]}


def tree_env(tree: Tree, token_id: int) -> dict[str, str]:
    paths = [str(STUB_DIR), str(tree.root / "services"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PDSERVE_STUB_TOKEN_ID": str(token_id)}


def worker_flags(args: argparse.Namespace, model: str, role: str) -> list[str]:
    longest = args.prompt_len + args.max_tokens
    most = max(args.streams)
    return ["--model", model, "--role", role, "--device", "cpu", "--dtype", "float32", "--kernels", "torch",
            "--num-threads", "1", "--max-num-seqs", str(most), "--max-model-len", str(2 * longest),
            "--max-kv-tokens", str(max(4096, 4 * most * longest)), "--log-level", "warning"]


def check_stubbed(stack: ServingStack, tree: Tree, workers: list[Started]) -> None:
    """Each worker's log names the stubbed runner, and it is the tree's own."""
    expected = str(tree.root / "services" / "pdserve" / "engine" / "model" / "runner.py")
    for worker in workers:
        lines = [line for line in (stack.log_dir / f"{worker.name}.log").read_text(errors="replace").splitlines()
                 if line.startswith(STUB_LINE)]
        if not lines or expected not in lines[0]:
            raise RuntimeError(f"{worker.name} of the {tree.name} tree: no stub of {expected} in its log ({lines})")


def measure_tree(tree: Tree, repeat: int, model: str, token_id: int, scratch: Path,
                 args: argparse.Namespace) -> list[dict]:
    """One stack of `tree`'s processes; a window per --streams value."""
    log_dir = scratch / f"{tree.name}-{repeat}"
    log_dir.mkdir()
    rng = random.Random(args.seed + repeat)  # both trees of a repetition get the same prompts
    with ServingStack(log_dir, env=tree_env(tree, token_id)) as stack:
        workers = [stack.start_worker(f"worker_{role}", worker_flags(args, model, role))
                   for role in ROLES[args.topology]]
        router = stack.start_router(workers, ["--model", model, "--log-level", "warning"])
        check_stubbed(stack, tree, workers)
        processes = {"router": router.pid, **{w.name: w.pid for w in workers}}
        rows = []
        for num_streams in args.streams:
            row = {"tree": tree.name, "commit": tree.commit, "repeat": repeat,
                   **measure_window(router, processes, num_streams, rng, args)}
            if row["failed"]:
                raise RuntimeError(f"{tree.name}: {row['failed']} of {row['requests']} requests failed at "
                                   f"{num_streams} streams, the first: {row['first_error']}")
            print(f"  {tree.name} repeat {repeat} streams {num_streams}: total {row[f'total_{PER_1K}']:.3f} "
                  f"CPU s / 1k tokens, {row['tokens_per_s']:.0f} tok/s, ITL p99 {row['itl_p99_ms']:.1f} ms", flush=True)
            rows.append(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per tree and streams, the median of every figure over the repetitions."""
    keys = [k for k in rows[0] if k.endswith(PER_1K) or k in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms")]
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["tree"], row["streams"]), []).append(row)
    return [{"tree": tree, "streams": streams, "repeats": len(group),
             **{k: statistics.median(r[k] for r in group) for k in keys if all(r[k] is not None for r in group)}}
            for (tree, streams), group in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0] != "before"))]


def ratios_of(summary: list[dict]) -> dict[str, float]:
    by = {(s["tree"], s["streams"]): s for s in summary}
    ratios = {}
    for (tree, streams), after in by.items():
        before = by.get(("before", streams))
        if tree != "after" or before is None:
            continue
        for key, value in after.items():
            if key not in ("tree", "streams", "repeats") and before.get(key):
                ratios[f"{key} @{streams}: after / before"] = value / before[key]
    return ratios


def targets_of(ratios: dict[str, float], streams: int) -> dict:
    """The issue's acceptance at the most streams: CPU after / before <= 0.5, ITL p99 not worse."""
    def target(name: str, ratio: str, bound: float) -> tuple[str, dict]:
        value = ratios.get(f"{ratio} @{streams}: after / before")
        return f"{name}_after_over_before_at_{streams}", {"value": value, "target": bound,
                                                          "met": value is not None and value <= bound}
    return dict([target("total_cpu", f"total_{PER_1K}", 0.5), target("itl_p99", "itl_p99_ms", 1.0)])


def machine_facts() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    def line(key: str) -> str:
        return next((row.split(":", 1)[1].strip() for row in cpuinfo.splitlines() if row.startswith(key)), "")
    flags = set(line("flags").split())
    return {"cpu": line("model name"), "cores": len(os.sched_getaffinity(0)),
            "isa": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")},
            "load_1m_at_start": os.getloadavg()[0],
            "note": "other processes may share the machine: each row records the 1-minute load average"}


def print_table(summary: list[dict], ratios: dict[str, float], workers: list[str]) -> None:
    print(f"{'tree':<7}{'streams':>8}{'router':>9}" + "".join(f"{w:>16}" for w in workers)
          + f"{'total':>9}{'tok/s':>9}{'ITL p50':>9}{'ITL p99':>9}   (CPU s per 1k output tokens; ms)")
    for s in summary:
        print(f"{s['tree']:<7}{s['streams']:>8}{s[f'router_{PER_1K}']:>9.3f}"
              + "".join(f"{s[f'{w}_{PER_1K}']:>16.3f}" for w in workers)
              + f"{s[f'total_{PER_1K}']:>9.3f}{s['tokens_per_s']:>9.0f}{s['itl_p50_ms']:>9.2f}{s['itl_p99_ms']:>9.2f}")
    for name, value in ratios.items():
        if name.startswith(("total_", "router_", "itl_p99")) or "worker" in name:
            print(f"  {name}: {value:.3f}")


def run(args: argparse.Namespace, scratch: Path) -> dict:
    facts = machine_facts()
    model = args.model or tiny_checkpoint(scratch / "tiny", 2 * (args.prompt_len + args.max_tokens))
    token_id = load_tokenizer(model).encode(" the", add_special_tokens=False)[0]
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "services", "proto"))
    after = Tree("after", ROOT, git("rev-parse", "HEAD") + ("+working-tree" if dirty else ""))
    with contextlib.ExitStack() as stack:
        trees = [after] if args.before == "none" else [stack.enter_context(before_tree(args.before, scratch)), after]
        rows = []
        for repeat in range(args.repeats):
            for tree in trees if repeat % 2 == 0 else trees[::-1]:
                rows += measure_tree(tree, repeat, model, token_id, scratch, args)
    summary = summarize(rows)
    ratios = ratios_of(summary)
    workers = [f"worker_{role}" for role in ROLES[args.topology]]
    print_table(summary, ratios, workers)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "keep_dir")}
    return {"benchmark": "serving_overhead",
            "config": {**config, "model": args.model and Path(args.model).name or "tiny", "stub_token_id": token_id,
                       "trees": {t.name: t.commit for t in trees}, "workers": workers},
            "machine": {**facts, "load_1m_at_end": os.getloadavg()[0]},
            "summary": summary, "ratios": ratios, "targets": targets_of(ratios, max(args.streams)), "results": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with work_dir(args.keep_dir, "pdserve-serving-overhead-") as scratch:
        report = run(args, scratch)
        out = args.json or Path(tempfile.gettempdir()) / f"serving-overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
