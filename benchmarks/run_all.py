"""Run every benchmark script in this directory and write ONE Markdown report.

Each script is run as `python SCRIPT --json PATH` (plus the extra arguments listed in
SCRIPTS), one after another so they do not compete for the CPU. The report states the
machine and the date, then per script its configuration, its absolute figures and, beside
them, the ratios measured in the same run. A script that is not in the checkout is reported
as missing; one that fails is reported with the end of its output. Nothing is asserted.

    python benchmarks/run_all.py                     # everything, report under bench-results/
    python benchmarks/run_all.py --only kvcache_ops --output report.md

Scripts write JSON shaped {"benchmark", "config", "results": [rows], "ratios": {name: value}};
other shapes are shown as flat key/value tables.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from report_markdown import render_report  # sibling module: this directory is on sys.path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"run_all.py", "report_markdown.py"}
# The benchmark set, each with extra arguments; any other script here that takes --json runs too.
EXPECTED_SCRIPTS: dict[str, list[str]] = {
    "kvcache_ops.py": [],
    "kvcache_integrity.py": [],
    "guided_sampling.py": [],
    "sampler_processors.py": [],
    "transfer_bandwidth.py": [],
    "serve_throughput.py": [],
    "disagg_vs_agg.py": [],
    "burst.py": [],
    "routing.py": [],
    "router_scale.py": [],
    "model_forward.py": [],
    "tiers.py": [],
    "internal_tls.py": ["--scale", "0.5"],
    "isolation_audit.py": [],
    "abuse.py": [],
    "soak.py": ["--minutes", "2"],  # a health figure (flat curves), kept short in the set
}
OUTPUT_TAIL_CHARS = 2000


def machine_info() -> dict:
    """CPU model, cores, RAM and load: the context every figure in the report needs."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(ram_bytes / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def benchmark_scripts() -> dict[str, list[str]]:
    """The expected set (present or not) plus every other `--json`-taking script here."""
    scripts = dict(EXPECTED_SCRIPTS)
    for path in sorted(HERE.glob("*.py")):
        if path.name not in scripts and path.name not in NOT_BENCHMARKS and not path.name.startswith("_"):
            text = path.read_text(encoding="utf-8")
            if "__main__" in text and "--json" in text:
                scripts[path.name] = []
    return scripts


def run_script(name: str, extra: list[str], out_dir: Path, timeout_s: float) -> dict:
    """Run one script; returns {"name", "status", "seconds", "result" | "output_tail"}."""
    script = HERE / name
    if not script.exists():
        return {"name": name, "status": "missing", "seconds": 0.0}
    json_path = out_dir / f"{script.stem}.json"
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(script), "--json", str(json_path), *extra],
                              capture_output=True, text=True, timeout=timeout_s, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": f"timed out after {timeout_s:.0f} s",
                "seconds": time.perf_counter() - started}
    seconds = time.perf_counter() - started
    (out_dir / f"{script.stem}.log").write_text(done.stdout + done.stderr)
    tail = (done.stdout + done.stderr)[-OUTPUT_TAIL_CHARS:]
    if done.returncode != 0:
        return {"name": name, "status": f"failed (exit {done.returncode})", "seconds": seconds, "output_tail": tail}
    try:
        result = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return {"name": name, "status": f"no JSON written ({exc})", "seconds": seconds, "output_tail": tail}
    return {"name": name, "status": "ok", "seconds": seconds, "result": result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only this script (repeatable, no .py)")
    parser.add_argument("--output", help="report path (default bench-results/report-DATE.md)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per script")
    args = parser.parse_args(argv)
    now = datetime.now(timezone.utc)
    stamp = now.strftime("%Y%m%d-%H%M%S")
    out_dir = HERE.parent / "bench-results" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    scripts = benchmark_scripts()
    names = [n for n in scripts if args.only is None or n.removesuffix(".py") in args.only]
    unknown = sorted(set(args.only or ()) - {n.removesuffix(".py") for n in scripts})
    if unknown:
        print(f"run_all: unknown script(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    machine = machine_info()
    runs = []
    for name in names:
        print(f"run_all: {name} ...", file=sys.stderr, flush=True)
        runs.append(run_script(name, scripts[name], out_dir, args.timeout))
        print(f"run_all: {name}: {runs[-1]['status']} ({runs[-1]['seconds']:.1f} s)", file=sys.stderr)
    report = Path(args.output) if args.output else HERE.parent / "bench-results" / f"report-{stamp}.md"
    report.write_text(render_report(now.strftime("%Y-%m-%d %H:%M:%S UTC"), machine, runs))
    print(f"run_all: wrote {report} (raw JSON and logs in {out_dir})", file=sys.stderr)
    return 0 if any(run["status"] == "ok" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
