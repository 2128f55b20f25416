"""What the KV cache tiers buy, in one run:

1. `tier_ttft`: TTFT of a long prompt whose prefix sits in device memory, the host tier, the disk
   tier, or nowhere (recomputed), as ratios to recompute. One `pdserve serve --aggregated` with a
   small device cache, a small host tier and a disk tier; filler prompts push the prompt down
   tier by tier, and the router's tier counters say where each hit came from.
2. `multi_turn`: conversations whose contexts together are several times the device cache, one
   turn each in turn (each turn resends the history plus the model's answer and a new question):
   prompt tokens served from cache, TTFT and output throughput with device only, device + host,
   device + host + disk.
3. `priority_vs_lru`: the KV cache manager alone replaying a trace where retention priority
   matters — hot system prompts sent at priority 90 between long one-off documents that thrash
   the cache — under priority eviction and plain LRU: the system prompts' hit rate and overall.

    python benchmarks/tiers.py --json tiers.json
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

from pdserve.common.ids import RequestId
from pdserve.common.model_source import default_model_path
from pdserve.common.request import PriorityRange
from pdserve.kvcache import CacheRequest, KvCacheConfig, KvCacheManager

from serving_stack import COMMAND, READY_TIMEOUT_S, free_port, stop_process, work_dir

WORDS = ("river bridge lamp stair keeper night harbor stone window market garden letter winter "
         "engine signal valley forest copper mirror candle orbit thunder meadow castle").split()
COUNTERS = ("pdserve_kv_onboarded_blocks_total", "pdserve_kv_loaded_blocks_total", "vllm:prefix_cache_hits_total")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--keep-dir", metavar="DIR")
    parser.add_argument("--model")
    parser.add_argument("--trials", type=int, default=4, help="long prompts pushed down the tiers")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def text(rng: random.Random, words: int, tag: str) -> str:
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))


class Served:
    """`pdserve serve --aggregated` with `flags`, its HTTP client and its tier counters."""

    def __init__(self, model: str, flags: list[str], log: Path) -> None:
        port, metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # the one worker's own series
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self._process = subprocess.Popen([*COMMAND, "serve", "--aggregated", "--model", model, "--port", str(port),
                                          "--metrics-port", str(metrics_port), "--max-model-len", "2048",
                                          "--log-level", "warning", *flags], stdout=self._log, stderr=subprocess.STDOUT)
        started = time.monotonic()
        while not self._ready():
            if self._process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                self.close()
                raise RuntimeError(f"serve did not become ready; see {log}")
            time.sleep(0.2)
        self.client = httpx.Client(base_url=self.url, timeout=300.0)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2.0) as response:
                return response.status == 200
        except OSError:
            return False

    def ask(self, prompt: str, max_tokens: int = 4) -> tuple[float, int, int, str]:
        """TTFT (s), prompt tokens, cached prompt tokens, the text."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        started, ttft, usage, pieces = time.perf_counter(), None, None, []
        with self.client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    ttft = ttft or time.perf_counter() - started
                    pieces.append(chunk["choices"][0].get("text", ""))
                usage = chunk.get("usage") or usage
        assert ttft is not None and usage is not None
        return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], "".join(pieces)

    def counters(self, settle_s: float = 0.2) -> dict[str, float]:
        time.sleep(settle_s)  # the worker's snapshot follows its engine loop
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            lines = response.read().decode().splitlines()
        return {name: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
                for name in COUNTERS}

    def close(self) -> None:
        stop_process(self._process)
        self._log.close()


def tier_ttft(args: argparse.Namespace, model: str, out_dir: Path) -> list[dict]:
    """Each long prompt: first sent (nowhere), again (device), after fillers (host), after more
    fillers (disk); the tier of each hit is read from the counters that moved."""
    rng = random.Random(args.seed)
    served = Served(model, ["--kv-cache-memory", "96MiB", "--host-cache-size", "96MiB", "--disk-cache-dir",
                            str(out_dir / "tier-ttft-disk"), "--disk-cache-size", "2GiB"], out_dir / "tier-ttft.log")
    samples: dict[str, list[float]] = {"nowhere": [], "device": [], "host": [], "disk": []}
    try:
        served.ask("warm up")
        for trial in range(args.trials):
            prompt = text(rng, 700, f"Long prompt {trial}")
            for stage, num_fillers in (("nowhere", 0), ("device", 0), ("host", 6), ("disk", 12)):
                for f in range(num_fillers):
                    served.ask(text(rng, 700, f"Filler {trial}.{stage}.{f}"), max_tokens=1)
                before = served.counters()
                ttft, prompt_tokens, cached, _ = served.ask(prompt)
                after = served.counters()
                moved = {k: after[k] - before[k] for k in COUNTERS}
                tier = ("disk" if moved["pdserve_kv_loaded_blocks_total"] else
                        "host" if moved["pdserve_kv_onboarded_blocks_total"] else
                        "device" if cached else "nowhere")
                samples[tier].append(ttft)
    finally:
        served.close()
    recompute = statistics.median(samples["nowhere"])
    return [{"system": f"prefix in {tier}", "workload": "tier_ttft", "samples": len(values),
             "ttft_p50_ms": statistics.median(values) * 1e3, "ratio_to_recompute": statistics.median(values) / recompute}
            for tier, values in samples.items() if values]


def multi_turn(args: argparse.Namespace, model: str, out_dir: Path) -> list[dict]:
    configs = {"device only": [],
               "device + host": ["--host-cache-size", "1GiB"],
               "device + host + disk": ["--host-cache-size", "128MiB", "--disk-cache-dir", str(out_dir / "mt-disk"),
                                        "--disk-cache-size", "2GiB"]}
    rows = []
    for name, flags in configs.items():
        rng = random.Random(args.seed)
        histories = [text(rng, 250, f"Conversation {c} opens") for c in range(args.conversations)]
        served = Served(model, ["--kv-cache-memory", "128MiB", *flags], out_dir / f"mt-{name.replace(' ', '')}.log")
        ttfts, prompt_tokens, cached_tokens, output_tokens = [], 0, 0, 0
        try:
            served.ask("warm up")
            started = time.perf_counter()
            for turn in range(args.turns):
                for c in range(args.conversations):
                    histories[c] += "\n" + text(rng, 150, f"Question {turn}")
                    ttft, num_prompt, cached, answer = served.ask(histories[c], max_tokens=16)
                    histories[c] += answer
                    if turn:
                        ttfts.append(ttft)
                    prompt_tokens += num_prompt
                    cached_tokens += cached
                    output_tokens += 16
            elapsed = time.perf_counter() - started
        finally:
            served.close()
        rows.append({"system": name, "workload": "multi_turn", "cached_share": cached_tokens / prompt_tokens,
                     "ttft_p50_ms_after_turn_1": statistics.median(ttfts) * 1e3, "output_tok_s": output_tokens / elapsed,
                     "prompt_tokens": prompt_tokens})
    return rows


def priority_vs_lru(args: argparse.Namespace) -> list[dict]:
    """Hot system prompts (priority 90) each followed by a user question, between long one-off
    documents that alone overflow the cache."""
    rng = random.Random(args.seed)
    tpb, num_blocks = 16, 256
    systems = [[rng.randrange(32_000) for _ in range(tpb * 24)] for _ in range(4)]
    trace = []
    for i in range(3000):
        if i % 3:
            s = rng.randrange(len(systems))
            tokens = systems[s] + [rng.randrange(32_000) for _ in range(rng.randint(8, 40))]
            trace.append((CacheRequest(RequestId(f"r{i}"), tokens, priorities=(PriorityRange(0, len(systems[s]), 90),)),
                          True))
        else:
            tokens = [rng.randrange(32_000) for _ in range(tpb * rng.randint(40, 120))]
            trace.append((CacheRequest(RequestId(f"r{i}"), tokens), False))
    rows = []
    for policy in ("priority", "lru"):
        manager = KvCacheManager(KvCacheConfig(tokens_per_block=tpb, eviction_policy=policy), num_blocks)
        hits = {True: [0, 0], False: [0, 0]}
        for request, is_system in trace:
            analysis = manager.analyze_prefix_reuse(request)
            claim = manager.add_sequence(request)
            manager.mark_computed(request.request_id, len(request.token_ids) - claim.num_cached_tokens)
            manager.free(request.request_id)
            manager.drain_events()
            hits[is_system][0] += analysis.num_cached_tokens
            hits[is_system][1] += len(request.token_ids)
        rows.append({"system": policy, "workload": "priority_vs_lru",
                     "system_prompt_hit_rate": hits[True][0] / hits[True][1],
                     "overall_hit_rate": (hits[True][0] + hits[False][0]) / (hits[True][1] + hits[False][1])})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path()
    rows = priority_vs_lru(args)
    with work_dir(args.keep_dir, "tiers-") as out_dir:
        rows += tier_ttft(args, model, out_dir)
        rows += multi_turn(args, model, out_dir)
    by = {(r["workload"], r["system"]): r for r in rows}
    ratios = {f"ttft_p50_ms ({r['system']}) / recompute": r["ratio_to_recompute"]
              for r in rows if r["workload"] == "tier_ttft"}
    ratios["system prompt hit rate: priority / lru"] = (
        by[("priority_vs_lru", "priority")]["system_prompt_hit_rate"]
        / max(by[("priority_vs_lru", "lru")]["system_prompt_hit_rate"], 1e-9))
    base = by[("multi_turn", "device only")]
    for name in ("device + host", "device + host + disk"):
        row = by[("multi_turn", name)]
        ratios[f"output_tok_s (multi_turn): {name} / device only"] = row["output_tok_s"] / base["output_tok_s"]
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model}
    result = {"benchmark": "tiers", "config": config, "results": rows, "ratios": ratios}
    print(json.dumps({"results": rows, "ratios": ratios}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
