"""The prompt-cache isolation audit (Gu et al., ICML 2025) against `pdserve serve` with two
tenants, by timing as an attacker would measure it: TTFT of the victim's cache hits, of the
attacker sending the victim's prompt, and of prompts nobody sent, compared with two-sample
Kolmogorov–Smirnov tests (`pdserve.bench.isolation`). Within a tenant the difference must be
significant (the cache works and the audit can see it); across tenants it must not be.

    python benchmarks/isolation_audit.py --json isolation-audit.json
    python benchmarks/isolation_audit.py --aggregated --num-prompts 20 --prompt-words 400
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

from pdserve.bench.isolation import Sample, report, run_audit
from pdserve.common.model_source import default_model_path

from serving_stack import COMMAND, READY_TIMEOUT_S, free_port, stop_process, work_dir

VICTIM_KEY, ATTACKER_KEY = "sk-audit-victim-0001", "sk-audit-attacker-0002"
WORDS = ("river bridge lamp stair keeper night harbor stone window market garden letter winter "
         "engine signal valley forest copper mirror candle orbit thunder meadow castle").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--keep-dir", metavar="DIR", help="keep the serve log here")
    parser.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    parser.add_argument("--aggregated", action="store_true", help="one role=both worker (default: prefill + decode)")
    parser.add_argument("--num-prompts", type=int, default=30, help="audit prompts (samples of each kind)")
    parser.add_argument("--prompt-words", type=int, default=600, help="words per prompt (about 1.3 tokens each)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def prompts(rng: random.Random, count: int, words: int, tag: str) -> list[str]:
    return [f"{tag} {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def _ready(url: str) -> bool:
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {VICTIM_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return response.status == 200
    except OSError:
        return False


def kind_row(samples: list[Sample], kind: str) -> dict:
    """One kind's TTFT median and how many of its requests were served cached tokens."""
    mine = [s for s in samples if s.kind == kind]
    return {"kind": kind, "samples": len(mine), "ttft_p50_ms": statistics.median(s.ttft_s for s in mine) * 1e3,
            "num_with_cached_tokens": sum(1 for s in mine if s.cached_tokens > 0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path()
    rng = random.Random(args.seed)
    audit, fresh = (prompts(rng, args.num_prompts, args.prompt_words, tag) for tag in ("Audit", "Fresh"))
    with work_dir(args.keep_dir, "isolation-audit-") as out_dir:
        keys = out_dir / "api-keys"
        keys.write_text(f"{VICTIM_KEY} victim\n{ATTACKER_KEY} attacker\n")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv_serve = [*COMMAND, "serve", "--model", model, "--port", str(port), "--api-keys-file", str(keys),
                      "--log-level", "warning", *(["--aggregated"] if args.aggregated else [])]
        with open(out_dir / "serve.log", "w") as log:
            process = subprocess.Popen(argv_serve, stdout=log, stderr=subprocess.STDOUT)
            try:
                started = time.monotonic()
                while not _ready(url):
                    if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                        raise RuntimeError(f"serve did not become ready; see {out_dir / 'serve.log'}")
                    time.sleep(0.2)
                with httpx.Client(base_url=url, timeout=120.0) as client:
                    run_audit(client, VICTIM_KEY, ATTACKER_KEY, audit[:2], fresh[:2])  # warm-up, discarded
                    samples = run_audit(client, VICTIM_KEY, ATTACKER_KEY, audit[2:], fresh[2:])
            finally:
                stop_process(process)
    audited = report(samples)
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model}
    rows = [kind_row(samples, kind) for kind in ("hit", "cross", "miss")]
    medians = {row["kind"]: row["ttft_p50_ms"] for row in rows}
    ratios = {f"ttft_p50_ms: {kind} / miss": medians[kind] / medians["miss"] for kind in ("hit", "cross")}
    result = {"benchmark": "isolation_audit", "config": config, "results": rows, "ratios": ratios,
              "ttft_p50_ms": medians, **audited}
    print(json.dumps({"ttft_p50_ms": medians, "verdicts": audited["verdicts"]}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
