"""Startup time and peak memory on the default GGUF model (SmolLM2-135M Q4_1), or `--model`.

Every figure comes from a fresh Python process, so imports and first-touch page faults
count as they do for a real start:
- metadata parse (a GGUF model): `gguf.GGUFReader` against pdserve's own `read_gguf`;
- worker: `build_llm_engine` (weights, KV cache, tokenizer) without a conversion cache,
  filling an empty cache, and reading a filled one;
- router: `load_tokenizer` without and with the cache (and whether torch got imported);
- with `--serve`: `pdserve serve` until it prints its ready banner, then one completion,
  with the peak RSS (VmHWM) of its processes summed and the kernels its workers run (from their
  start-up log), for an empty and a filled cache.
`--python` runs every child with another environment's interpreter (pdserve installed there from
a wheel, say), and `--no-compiler` with no C++ compiler reachable (CC and CXX /bin/false, PATH
only that interpreter's folder): what a machine or image without build tools does.
The JSON has the set's shape (`README.md`): one row per part and case, and as ratios each part's
time with a filled cache over its time without one. A benchmark, not a test: nothing here is asserted.

    python benchmarks/startup.py --json startup.json [--serve [--serve-flags='--aggregated --kv-cache-memory 256MiB']]
    python benchmarks/startup.py --serve --python /tmp/wheel-venv/bin/python --no-compiler --json startup.json
"""
import argparse
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve.common.model_source import default_model_path

from serving_stack import descendants, free_port, stop_process

CHILD_TIMEOUT_S = 300
SERVE_READY_TIMEOUT_S = 180


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_parse(args: argparse.Namespace) -> dict:
    import gguf

    from pdserve.models.gguf_file import read_gguf
    path = args.model
    start = time.perf_counter()
    ours = read_gguf(path)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    reader_s = time.perf_counter() - start
    return {"read_gguf_s": ours_s, "gguf_reader_s": reader_s, "num_keys": len(ours.metadata),
            "num_tensors": len(reader.tensors)}


def measure_worker(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    from pdserve.engine.core.scheduler import SchedulerConfig
    from pdserve.kvcache import KvCacheConfig
    from pdserve.worker.bootstrap import EngineSpec, build_llm_engine
    imported = time.perf_counter()
    spec = EngineSpec(model=args.model, served_model_name="smollm2", dtype=args.dtype, device="cpu",
                      kv=KvCacheConfig(max_total_bytes=args.kv_mib << 20),
                      scheduler=SchedulerConfig(64, 2048, 2048), cache_dir=args.cache_dir or None)
    build_llm_engine(spec)
    done = time.perf_counter()
    return {"import_s": imported - start, "build_s": done - imported, "total_s": done - start,
            "peak_rss_mib": peak_rss_mib()}


def measure_tokenizer(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    from pdserve.models.tokenizer import load_tokenizer
    imported = time.perf_counter()
    tokenizer = load_tokenizer(args.model, args.cache_dir or None)
    done = time.perf_counter()
    return {"import_s": imported - start, "load_s": done - imported, "total_s": done - start,
            "peak_rss_mib": peak_rss_mib(), "imports_torch": "torch" in sys.modules,
            "hello_world_ids": tokenizer.encode("Hello world")}


CHILDREN = {"parse": measure_parse, "worker": measure_worker, "tokenizer": measure_tokenizer}


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: this one, or one where no C++ compiler can be reached."""
    if not args.no_compiler:
        return dict(os.environ)
    keep = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "PDSERVE_BLOCK_SIZE")}
    return {**keep, "PATH": str(Path(args.python).parent), "CC": "/bin/false", "CXX": "/bin/false"}


def run_child(kind: str, args: argparse.Namespace, cache_dir: str = "") -> dict:
    command = [args.python, __file__, "--child", kind, "--model", args.model, "--dtype", args.dtype,
               "--kv-mib", str(args.kv_mib), "--cache-dir", cache_dir]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True,
                          env=child_env(args))
    return json.loads(done.stdout.strip().splitlines()[-1])


def vm_hwm_mib(pid: int) -> float:
    """Peak RSS of one live process, from /proc (0 when it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def measure_serve(args: argparse.Namespace, cache_dir: str) -> dict:
    """`pdserve serve` until its banner, one completion, peak RSS, its workers' kernels; then stop it."""
    port, worker_port = free_port(), free_port()
    command = [args.python, "-m", "pdserve.cli", "serve", "--model", args.model, "--port", str(port), "--worker-port",
               str(worker_port), "--dtype", args.dtype, "--cache-dir", cache_dir, *shlex.split(args.serve_flags)]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=child_env(args))
        try:
            ready_s = _wait_for_banner(serve, start)
            answer_s = _one_completion(port) if ready_s is not None else None
            processes = [serve.pid, *descendants(serve.pid)]
            peaks = {pid: vm_hwm_mib(pid) for pid in processes}
        finally:
            stop_process(serve)
        log.seek(0)
        kernels = sorted(set(re.findall(r"CPU: (native CPU kernels \(\w+\)|torch ops)", log.read())))
    return {"ready_s": ready_s, "first_completion_s": answer_s, "kernels": kernels,
            "peak_rss_mib_per_process": list(peaks.values()), "peak_rss_mib_sum": sum(peaks.values())}


def _wait_for_banner(serve: subprocess.Popen, start: float) -> float | None:
    deadline, stdout = start + SERVE_READY_TIMEOUT_S, serve.stdout
    if stdout is None:
        return None
    os.set_blocking(stdout.fileno(), False)
    while time.perf_counter() < deadline and serve.poll() is None:
        line = stdout.readline()
        if "is ready at" in line:
            return time.perf_counter() - start
        if not line:
            time.sleep(0.05)
    return None


def _one_completion(port: int) -> float:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8}).encode()  # the served model
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return time.perf_counter() - start


def run_all(args: argparse.Namespace) -> list[dict]:
    """One row per part and case, each measured in a fresh process."""
    is_gguf = Path(args.model).suffix == ".gguf"  # a checkpoint directory has no metadata to parse
    rows = [{"part": "metadata_parse", "case": "gguf", **run_child("parse", args)}] if is_gguf else []
    with tempfile.TemporaryDirectory(prefix="pdserve-startup-") as root:
        cache = str(Path(root) / "cache")
        rows += [{"part": "worker", "case": "no_cache", **run_child("worker", args)},
                 {"part": "worker", "case": "empty_cache", **run_child("worker", args, cache)},
                 {"part": "worker", "case": "filled_cache", **run_child("worker", args, cache)},
                 {"part": "router_tokenizer", "case": "no_cache", **run_child("tokenizer", args)},
                 {"part": "router_tokenizer", "case": "filled_cache", **run_child("tokenizer", args, cache)}]
        written = Path(cache).iterdir() if Path(cache).is_dir() else ()  # none for a checkpoint directory
        rows[-1]["cache_bytes"] = sum(p.stat().st_size for p in written)
        if args.serve:
            serve_cache = str(Path(root) / "serve-cache")
            rows += [{"part": "serve", "case": "empty_cache", **measure_serve(args, serve_cache)},
                     {"part": "serve", "case": "filled_cache", **measure_serve(args, serve_cache)}]
    return rows


def ratios(rows: list[dict]) -> dict[str, float | None]:
    """Each part's time with a filled cache over its time without one (or with an empty one)."""
    by = {(row["part"], row["case"]): row for row in rows}
    found: dict[str, float | None] = {}
    for part, metric, base in (("worker", "total_s", "no_cache"), ("router_tokenizer", "total_s", "no_cache"),
                               ("serve", "ready_s", "empty_cache")):
        filled, before = by.get((part, "filled_cache")), by.get((part, base))
        if filled and before:
            found[f"{part} {metric}: filled_cache / {base}"] = (
                filled[metric] / before[metric] if filled[metric] and before[metric] else None)
    return found


def print_table(rows: list[dict]) -> None:
    for row in rows:
        figures = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items() if k not in ("part", "case"))
        print(f"{row['part']:17s} {row['case']:13s} {figures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    parser.add_argument("--dtype", default="bfloat16", help="serving dtype of the worker")
    parser.add_argument("--kv-mib", type=int, default=256, help="KV cache size of the measured worker build")
    parser.add_argument("--serve", action="store_true", help="also time a whole `pdserve serve` start")
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags; pass as --serve-flags='--aggregated'")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the measured processes run")
    parser.add_argument("--no-compiler", action="store_true", help="run them with no C++ compiler reachable")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or default_model_path()
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    rows = run_all(args)
    print_table(rows)
    config = {"machine": platform.platform(), "cpus": os.cpu_count(),
              **{k: v for k, v in vars(args).items() if k not in ("json", "child", "cache_dir")}}
    if args.model == default_model_path():  # the bundled file by name, not this machine's path
        config["model"] = Path(args.model).name
    result = {"benchmark": "startup", "config": config, "results": rows, "ratios": ratios(rows)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
