"""What the lower KV tiers buy on this machine: long shared documents revisited after the device
cache has let them go, served by `pdserve serve --aggregated` with a small device KV cache and
(1) no lower tier, (2) a host tier holding every document, (3) a small host tier with a disk tier
below it — one run each.

Workload: `--docs` documents of about `--doc-tokens` tokens, each asked `--rounds` times (every
round in a new shuffled order) with a short question after it, one request at a time, so the
figure is TTFT: the device cache holds a few documents, the host tier all of them. Reported per
configuration: TTFT p50/p90, the share of prompt tokens served from cache, blocks moved.

    python benchmarks/kv_tiers.py --json kv-tiers.json
"""
import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx

from pdserve.common.model_source import default_model_path

from serving_stack import COMMAND, READY_TIMEOUT_S, free_port, stop_process, work_dir

WORDS = ("river bridge lamp stair keeper night harbor stone window market garden letter winter "
         "engine signal valley forest copper mirror candle orbit thunder meadow castle").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--keep-dir", metavar="DIR")
    parser.add_argument("--model")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--doc-words", type=int, default=700, help="about 1.4 tokens each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="192MiB", help="the device cache: a few documents")
    parser.add_argument("--host-cache-size", default="1GiB", help="the host tier: every document")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def configurations(args: argparse.Namespace, out_dir: Path) -> dict[str, list[str]]:
    return {"device only": [],
            "host tier": ["--host-cache-size", args.host_cache_size],
            "host + disk tier": ["--host-cache-size", "96MiB", "--disk-cache-dir", str(out_dir / "kv-disk"),
                                 "--disk-cache-size", "2GiB"]}


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2.0) as response:
            return response.status == 200
    except OSError:
        return False


def ask(client: httpx.Client, prompt: str) -> tuple[float, int, int]:
    """TTFT (s), prompt tokens, cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, ttft, usage = time.perf_counter(), None, None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage is not None
    return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    names = ("pdserve_kv_offloaded_blocks_total", "pdserve_kv_onboarded_blocks_total",
             "pdserve_kv_spilled_blocks_total", "pdserve_kv_loaded_blocks_total")
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)) for name in names}


def measure(name: str, flags: list[str], args: argparse.Namespace, model: str, prompts: list[list[str]],
            out_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*COMMAND, "serve", "--aggregated", "--model", model, "--port", str(port), "--kv-cache-memory",
            args.kv_cache_memory, "--log-level", "warning", *flags]
    with open(out_dir / f"{name.replace(' ', '-')}.log", "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            started = time.monotonic()
            while not _ready(url):
                if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                    raise RuntimeError(f"{name}: serve did not become ready")
                time.sleep(0.2)
            with httpx.Client(base_url=url, timeout=300.0) as client:
                ask(client, "warm up")
                rounds = [[ask(client, p) for p in round_prompts] for round_prompts in prompts]
            time.sleep(1.5)  # the router's next stats poll
            moved = metrics(url)
        finally:
            stop_process(process)
    later = [r for round_rows in rounds[1:] for r in round_rows]  # after the first visit of every document
    ttfts = sorted(t for t, _, _ in later)
    return {"system": name, "workload": "revisits", "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3,
            "first_visit_ttft_p50_ms": statistics.median(t for t, _, _ in rounds[0]) * 1e3,
            "cached_share": sum(c for _, _, c in later) / sum(p for _, p, _ in later), **moved}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path()
    rng = random.Random(args.seed)
    docs = [f"Document {d}: " + " ".join(rng.choice(WORDS) for _ in range(args.doc_words)) for d in range(args.docs)]
    prompts = []
    for r in range(args.rounds):
        order = list(range(args.docs))
        rng.shuffle(order)
        prompts.append([f"{docs[d]}\nQuestion {r}: what comes next?" for d in order])
    with work_dir(args.keep_dir, "kv-tiers-") as out_dir:
        rows = [measure(name, flags, args, model, prompts, out_dir)
                for name, flags in configurations(args, out_dir).items()]
    base = rows[0]
    ratios = {f"ttft_p50_ms: {row['system']} / device only": row["ttft_p50_ms"] / base["ttft_p50_ms"]
              for row in rows[1:]}
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model}
    result = {"benchmark": "kv_tiers", "config": config, "results": rows, "ratios": ratios}
    print(json.dumps({"results": rows, "ratios": ratios}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
