"""Soak: N minutes of steady streaming load against `pdserve serve` (1 prefill + 1 decode by
default), 10% of clients dropping their streams midway and one worker SIGKILLed once; samples,
every `--sample-interval` seconds, each worker's blocks in use and requests held for a peer
(`CheckKvIntegrity` over gRPC) and the RSS of every pdserve process, and writes them as JSON
and a plot. A benchmark, not a test: nothing here is asserted; flat curves are the finding.

The ratios compare the second half of the load after the killed worker answered again with the
first half of it (so every process, the restarted one included, is measured over the same
window), and the idle figures after the load with those before it: flat means RSS ratios near 1
and blocks in use / held for a peer back at their idle baseline (0) once the load stops.

    python benchmarks/soak.py --minutes 2 --json soak.json --plot soak.png [--model PATH]
"""
import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serving_stack import descendants, free_port, stop_process, work_dir

from pdserve.common.errors import PdserveError
from pdserve.common.tls import TlsConfig
from pdserve.rpc.worker_client import GrpcBackend

READY_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 60.0
WORDS = ("river", "castle", "engine", "garden", "signal", "harbor", "market", "winter", "letter", "forest")


@dataclass
class Load:
    """What the clients saw, by outcome."""

    num_completed: int = 0
    num_dropped: int = 0  # the client went away midway, on purpose
    num_errors: int = 0  # an error frame or status: expected around the kill
    error_times: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Workers:
    """serve's workers by role, and the credentials a client of theirs presents (None: plain text)."""

    addresses: dict[str, str]
    tls: TlsConfig | None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: the bundled model)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--drop-fraction", type=float, default=0.1, help="streams the client drops midway")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kill-role", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--kill-at", type=float, default=0.2, help="when to SIGKILL the worker, as a fraction of the load")
    parser.add_argument("--sample-interval", type=float, default=2.0)
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags, e.g. '--max-model-len 512'")
    parser.add_argument("--keep-dir", default=None, help="keep serve's logs here")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write the curves as a PNG (matplotlib: the bench extra)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# ---- serve -----------------------------------------------------------------------------------

def start_serve(args: argparse.Namespace, directory: Path) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """`pdserve serve` until its banner: the process, the router URL and each worker's address by role
    (the banner's restart metrics URL under "metrics")."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--max-model-len", "1024",
               *(["--model", args.model] if args.model else []), *args.serve_flags.split()]
    out_path = directory / "serve.out"
    with open(out_path, "wb") as out, open(directory / "serve.err", "wb") as err:
        serve = subprocess.Popen(command, stdout=out, stderr=err)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "pdserve is ready" not in out_path.read_text():
        if serve.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start:\n{(directory / 'serve.err').read_text()[-3000:]}")
        time.sleep(0.5)
    banner = out_path.read_text()
    workers = dict(re.findall(r"^  (prefill|decode|both) +(\S+)", banner, re.MULTILINE))
    workers["metrics"] = re.search(r"worker restarts: (\S+)", banner).group(1)
    return serve, f"http://127.0.0.1:{port}", workers


def restart_counts(metrics_url: str) -> dict[str, float]:
    """`pdserve_worker_restarts_total` by worker, from serve's own /metrics."""
    lines = httpx.get(metrics_url, timeout=10.0).text.splitlines()
    return {line.split("{")[1].split("}")[0]: float(line.split()[-1])
            for line in lines if line.startswith("pdserve_worker_restarts_total{")}


def process_role(pid: int) -> str | None:
    """"router", "prefill worker", ... from a pdserve process's command line; None if gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode() for a in argv]
    if "router" in words:
        return "router"
    if "worker" in words:
        return f"{words[words.index('--role') + 1]} worker"
    return "serve"


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return None if line is None else int(line.split()[1]) / 1024


def worker_pid(serve: subprocess.Popen, role: str) -> int | None:
    return next((pid for pid in descendants(serve.pid) if process_role(pid) == f"{role} worker"), None)


def router_tls(serve: subprocess.Popen) -> TlsConfig | None:
    """The router's credentials, from the `--tls-dir` on its command line: serve's authority keeps
    no key to issue the soak its own, and the workers answer any certificate of it. None in plain text."""
    router = next((pid for pid in descendants(serve.pid) if process_role(pid) == "router"), None)
    if router is None:
        raise SystemExit("serve runs no router")
    words = Path(f"/proc/{router}/cmdline").read_bytes().decode().split("\0")
    folder = words[words.index("--tls-dir") + 1] if "--tls-dir" in words else ""
    return TlsConfig.from_dir(folder) if folder else None


# ---- load ------------------------------------------------------------------------------------

def prompt(rng: random.Random) -> str:
    """A shared system-like prefix (prefix caching at work) and a random tail."""
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
    return "You are a careful assistant. Summarise the following notes. " * 3 + tail


async def client(url: str, args: argparse.Namespace, rng: random.Random, stop: asyncio.Event, load: Load,
                 started: float) -> None:
    async with httpx.AsyncClient(timeout=60.0) as http:
        while not stop.is_set():
            drop_after = rng.randint(1, args.max_tokens - 1) if rng.random() < args.drop_fraction else None
            body = {"prompt": prompt(rng), "max_tokens": args.max_tokens, "temperature": 0.8,
                    "ignore_eos": True, "stream": True, "seed": rng.randint(0, 1 << 30)}
            try:
                await one_stream(http, url, body, drop_after, load)
            except (httpx.HTTPError, ValueError):
                load.num_errors += 1
                load.error_times.append(time.monotonic() - started)
                await asyncio.sleep(0.5)


async def one_stream(http: httpx.AsyncClient, url: str, body: dict, drop_after: int | None, load: Load) -> None:
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ValueError(f"status {response.status_code}")
        num_frames = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if "error" in json.loads(line.removeprefix("data: ")):
                raise ValueError(line)
            num_frames += 1
            if drop_after is not None and num_frames >= drop_after:
                load.num_dropped += 1
                return  # leaving the block closes the connection midway
    load.num_completed += 1


# ---- sampling --------------------------------------------------------------------------------

async def kv_figures(address: str, tls: TlsConfig | None) -> dict[str, object]:
    backend = GrpcBackend(address, rpc_timeout_s=5.0, tls=tls)
    try:
        report = await backend.check_integrity()
    except PdserveError as exc:  # the killed worker, until it is back
        return {"up": False, "error": str(exc)[:200]}
    finally:
        await backend.close()
    return {"up": True, "ok": report.ok, "used_blocks": report.num_used_blocks,
            "held_for_peer": report.num_held_for_peer}


async def sample(serve: subprocess.Popen, workers: Workers, started: float, phase: str) -> dict:
    processes = {}
    for pid in [serve.pid, *descendants(serve.pid)]:
        role, rss = process_role(pid), rss_mib(pid)
        if role is not None and rss is not None:
            processes[role] = {"pid": pid, "rss_mib": round(rss, 1)}
    kv = {role: await kv_figures(address, workers.tls) for role, address in workers.addresses.items()}
    return {"t_s": round(time.monotonic() - started, 2), "phase": phase, "kv": kv, "processes": processes}


async def sampler(serve: subprocess.Popen, workers: Workers, started: float, interval_s: float,
                  stop: asyncio.Event, samples: list[dict]) -> None:
    while not stop.is_set():
        samples.append(await sample(serve, workers, started, "load"))
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass


async def wait_answering(url: str, since: float, limit_s: float = 120.0) -> float | None:
    """Seconds from `since` until a completion succeeds again; None if not within `limit_s`."""
    async with httpx.AsyncClient(timeout=30.0) as http:
        while time.monotonic() - since < limit_s:
            try:
                body = {"prompt": "Hello", "max_tokens": 2}
                if (await http.post(f"{url}/v1/completions", json=body)).status_code == 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    return None


async def settle(serve: subprocess.Popen, workers: Workers, started: float) -> dict:
    """The idle figures once every worker holds no block for a request (or after SETTLE_TIMEOUT_S)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        idle = await sample(serve, workers, started, "idle-after")
        kv = idle["kv"].values()
        if all(k.get("used_blocks") == 0 and k.get("held_for_peer") == 0 for k in kv) or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(1.0)


async def soak(args: argparse.Namespace, serve: subprocess.Popen, url: str, workers: Workers) -> dict:
    started = time.monotonic()
    baseline = await sample(serve, workers, started, "idle-before")
    stop, load, samples = asyncio.Event(), Load(), [baseline]
    rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
    tasks = [asyncio.create_task(client(url, args, rng, stop, load, started)) for rng in rngs]
    sampling = asyncio.create_task(sampler(serve, workers, started, args.sample_interval, stop, samples))
    duration_s = args.minutes * 60
    await asyncio.sleep(duration_s * args.kill_at)
    victim = worker_pid(serve, args.kill_role)
    killed_at = time.monotonic()
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    answering_after_s = await wait_answering(url, killed_at)
    await asyncio.sleep(max(0.0, started + duration_s - time.monotonic()))
    stop.set()
    await asyncio.gather(*tasks, sampling, return_exceptions=True)
    idle = await settle(serve, workers, started)
    samples.append(idle)
    kill = {"role": args.kill_role, "pid": victim, "t_s": round(killed_at - started, 2),
            "answering_again_after_s": None if answering_after_s is None else round(answering_after_s, 2)}
    return {"samples": samples, "kill": kill, "load": load, "duration_s": duration_s}


# ---- report ----------------------------------------------------------------------------------

def halves(samples: list[dict], t0: float, t1: float) -> tuple[list[dict], list[dict]]:
    """The load samples of the first and second half of [t0, t1]."""
    middle = (t0 + t1) / 2
    load = [s for s in samples if s["phase"] == "load" and s["t_s"] >= t0]
    return [s for s in load if s["t_s"] < middle], [s for s in load if s["t_s"] >= middle]


def median_of(samples: list[dict], pick) -> float | None:
    values = [v for v in map(pick, samples) if v is not None]
    return statistics.median(values) if values else None


def summarise(run: dict) -> tuple[list[dict], dict[str, float]]:
    samples, kill = run["samples"], run["kill"]
    back_at = kill["t_s"] + (kill["answering_again_after_s"] or 0.0)
    early, late = halves(samples, back_at, run["duration_s"])
    rows, ratios = [], {}
    roles = sorted({role for s in samples for role in s["processes"]})
    for role in roles:
        pick = (lambda role: lambda s: s["processes"].get(role, {}).get("rss_mib"))(role)
        first, last = median_of(early, pick), median_of(late, pick)
        peak = max((v for v in map(pick, samples) if v is not None), default=None)
        rows.append({"series": f"rss_mib {role}", "early_median": first, "late_median": last, "peak": peak})
        if first and last:
            ratios[f"rss_late_over_early {role}"] = round(last / first, 3)
    before, after = samples[0]["kv"], samples[-1]["kv"]
    for role in sorted(before):
        for name in ("used_blocks", "held_for_peer"):
            pick = (lambda role, name: lambda s: s["kv"].get(role, {}).get(name))(role, name)
            rows.append({"series": f"{name} {role} worker", "idle_before": before[role].get(name),
                         "early_median": median_of(early, pick), "late_median": median_of(late, pick),
                         "peak": max((v for v in map(pick, samples) if v is not None), default=None),
                         "idle_after": after[role].get(name)})
        ratios[f"integrity_ok_after {role}"] = float(bool(after[role].get("ok")))
    load = run["load"]
    num_streams = load.num_completed + load.num_dropped + load.num_errors
    rows.append({"series": "load", "completed": load.num_completed, "dropped": load.num_dropped,
                 "errors": load.num_errors, "errors_within_60s_of_kill":
                     sum(1 for t in load.error_times if 0 <= t - kill["t_s"] < 60)})
    ratios["dropped_fraction"] = round(load.num_dropped / num_streams, 3) if num_streams else 0.0
    return rows, ratios


def plot(run: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = run["samples"]
    figure, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    times = [s["t_s"] for s in samples]
    for role in sorted(samples[0]["kv"]):
        for axis, name in ((axes[0], "used_blocks"), (axes[1], "held_for_peer")):
            axis.plot(times, [s["kv"].get(role, {}).get(name) for s in samples], marker=".", label=f"{role} worker")
    for role in sorted({role for s in samples for role in s["processes"]}):
        axes[2].plot(times, [s["processes"].get(role, {}).get("rss_mib") for s in samples], marker=".", label=role)
    titles = ("KV blocks in use", "requests held for a peer", "RSS (MiB)")
    for axis, title in zip(axes, titles, strict=True):
        axis.axvline(run["kill"]["t_s"], color="red", linestyle="--", label=f"{run['kill']['role']} worker killed")
        axis.set_title(title)
        axis.legend(fontsize=7)
    axes[2].set_xlabel("seconds since the load started (last point: idle after the load)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    args = parse_args()
    with work_dir(args.keep_dir, "pdserve-soak-") as directory:
        serve, url, addresses = start_serve(args, directory)
        metrics_url = addresses.pop("metrics")
        try:
            run = asyncio.run(soak(args, serve, url, Workers(addresses, router_tls(serve))))
            restarts = {"log": re.findall(r"pdserve serve: .*", (directory / "serve.err").read_text()),
                        "pdserve_worker_restarts_total": restart_counts(metrics_url)}
        finally:
            stop_process(serve)
    rows, ratios = summarise(run)
    config = {key: value for key, value in vars(args).items() if key not in ("json", "plot", "keep_dir")}
    config |= {"machine": platform.machine(), "cpus": os.cpu_count(), "kill": run["kill"], "restarts": restarts}
    report = {"benchmark": "soak", "config": config, "results": rows, "ratios": ratios,
              "samples": run["samples"]}
    for row in rows:
        print(row)
    print(json.dumps(ratios, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(run, args.plot)


if __name__ == "__main__":
    main()
