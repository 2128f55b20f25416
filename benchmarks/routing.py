"""KV-aware routing against round robin on the same worker processes, on a multi-turn
shared-prefix workload.

Workload: `--num-system-prompts` system prompts, `--num-users` users, each bound to one of
them and holding a conversation of `--turns` turns. Turn t's prompt is the system prompt, every
earlier turn (user message plus a reply of `--reply-len` tokens) and turn t's user message, so
each prompt extends the user's previous one. Token ids are drawn from a seeded generator; a
reply is appended as drawn tokens (the model's own words would not change the prefix structure).
Users run concurrently, each one turn after another.

Workers are started once (`--prefill`/`--decode`, or `--both`); then per policy a router is
started on them, the workload is sent through it with a cache salt of its own (so no policy
reuses blocks another one left in the workers' caches), and the router is stopped. Per policy:
- prefix-cache hit rate: hit over queried prompt tokens, summed over the workers' own counters
  (`pdserve_router_worker_prefix_cache_*`), and by role; the API's `cached_tokens` share too;
- the router's view: overlap blocks over prompt blocks of the workers it chose;
- TTFT p50/p99 (request sent to first streamed text), throughput (requests/s, output tokens/s).
Ratios: kv_aware over round_robin. A benchmark, not a test: nothing is asserted.

    python benchmarks/routing.py --json routing.json
    python benchmarks/routing.py --both 4 --num-users 8 --turns 3 --tiny
"""
import argparse
import asyncio
import json
import random
import statistics
from collections import Counter
import sys
import time
import urllib.request
from pathlib import Path

import httpx
from serving_stack import ServingStack, Started, work_dir

from pdserve.common.model_source import default_model_path

POLICIES = ("kv_aware", "round_robin")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled SmolLM2-135M GGUF)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random-weight Llama instead (fast, for a smoke run)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--both", type=int, default=0, help="aggregated workers instead of prefill/decode")
    p.add_argument("--num-system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--num-users", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=48)
    p.add_argument("--reply-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-kv-tokens", type=int, default=16384, help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--keep-dir", default=None, help="keep logs here")
    return p.parse_args(argv)


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per user, the prompt of each turn (each one extends the one before)."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    systems = [draw(args.system_len) for _ in range(args.num_system_prompts)]
    users = []
    for user in range(args.num_users):
        history, turns = list(systems[user % len(systems)]), []
        for _ in range(args.turns):
            history += draw(args.user_len)
            turns.append(list(history))
            history += draw(args.reply_len)
        users.append(turns)
    return users


async def one_turn(client: httpx.AsyncClient, url: str, prompt: list[int], salt: str, output_len: int) -> dict:
    """One streamed completion; a failure (HTTP error, error event, transport error) is `ok: False`."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": salt}
    sent = time.perf_counter()
    ttft, usage = None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False}
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return {"ok": False}
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - sent
                usage = chunk.get("usage") or usage
    except httpx.HTTPError:
        return {"ok": False}
    if ttft is None or usage is None:
        return {"ok": False}
    return {"ok": True, "ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "output_tokens": usage["completion_tokens"]}


async def run_workload(url: str, users: list[list[list[int]]], salt: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    async def converse(turns: list[list[int]]) -> list[dict]:
        return [await one_turn(client, url, prompt, salt, args.output_len) for prompt in turns]

    limits = httpx.Limits(max_connections=len(users) + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        start = time.perf_counter()
        per_user = await asyncio.gather(*(converse(turns) for turns in users))
        return [turn for turns in per_user for turn in turns], time.perf_counter() - start


def router_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10.0) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("pdserve_router_")}


def summed(metrics: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name + "{") and label in k)


def cache_figures(before: dict[str, float], after: dict[str, float], roles: dict[str, str]) -> dict:
    """Hit rates from the workers' own counters over the run, in all and by role."""
    figures = {}
    for scope, workers in [("all", list(roles))] + [(r, [w for w, rr in roles.items() if rr == r])
                                                    for r in sorted(set(roles.values()))]:
        def delta(name: str) -> float:
            return sum(summed(after, name, f'worker="{w}"') - summed(before, name, f'worker="{w}"') for w in workers)
        queried = delta("pdserve_router_worker_prefix_cache_queries_total")
        figures[f"hit_rate_{scope}"] = delta("pdserve_router_worker_prefix_cache_hits_total") / queried if queried else 0.0
    routed_prompt = summed(after, "pdserve_router_routed_prompt_blocks_total")
    figures["routed_overlap_rate"] = summed(after, "pdserve_router_routed_overlap_blocks_total") / routed_prompt \
        if routed_prompt else 0.0
    return figures


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure_policy(policy: str, stack: ServingStack, workers: list[Started], roles: dict[str, str],
                   args: argparse.Namespace, model: str) -> dict:
    """One router of `policy` on `workers`, started in their stack (their authority signs its
    certificate) and stopped after the workload, so the next policy's router meets the same workers."""
    router = stack.start_router(workers, ["--model", model, "--routing-policy", policy, "--worker-poll-interval",
                                          "0.2", "--log-level", "warning"], name=f"router-{policy}")
    try:
        before = router_metrics(router.address)
        turns, wall_s = asyncio.run(run_workload(router.address, conversations(args), f"bench-{policy}", args))
        time.sleep(1.0)  # a few polls: the workers' counters reach the router
        after = router_metrics(router.address)
    finally:
        stack.stop(router)
    done = [t for t in turns if t["ok"]]
    ttfts = [t["ttft_s"] * 1000 for t in done]
    prompt_tokens = sum(t["prompt_tokens"] for t in done)
    return {"policy": policy, "num_requests": len(turns), "num_failed": len(turns) - len(done), "wall_s": wall_s,
            "requests_per_s": len(done) / wall_s, "output_tok_s": sum(t["output_tokens"] for t in done) / wall_s,
            "ttft_p50_ms": percentile(ttfts, 50) if ttfts else None, "ttft_p99_ms": percentile(ttfts, 99) if ttfts else None,
            "api_cached_rate": sum(t["cached_tokens"] for t in done) / prompt_tokens if prompt_tokens else 0.0,
            **cache_figures(before, after, roles)}


def start_workers(stack: ServingStack, args: argparse.Namespace, model: str) -> tuple[list[Started], dict[str, str]]:
    roles = ["both"] * args.both if args.both else ["prefill"] * args.prefill + ["decode"] * args.decode
    common = ["--model", model, "--device", "cpu", "--num-threads", "1", "--max-kv-tokens", str(args.max_kv_tokens),
              "--log-level", "warning"]
    if args.tiny:
        common += ["--dtype", "float32"]
    workers = [stack.start_worker(f"{role}-{i}", ["--role", role, *common]) for i, role in enumerate(roles)]
    return workers, {w.address: role for w, role in zip(workers, roles, strict=True)}


def tiny_checkpoint(directory: Path, max_model_len: int) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_model_len,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    longest = args.system_len + args.turns * (args.user_len + args.reply_len) + args.output_len
    with work_dir(args.keep_dir, "pdserve-routing-") as scratch:
        model = args.model or (tiny_checkpoint(scratch / "tiny", 2 * longest) if args.tiny else default_model_path())
        with ServingStack(scratch) as stack:
            workers, roles = start_workers(stack, args, model)
            results = [measure_policy(p, stack, workers, roles, args, model) for p in POLICIES]
    by_policy = {r["policy"]: r for r in results}
    kv, rr = by_policy["kv_aware"], by_policy["round_robin"]
    ratios = {f"kv_aware_over_round_robin_{k}": kv[k] / rr[k] for k in
              ("hit_rate_all", "ttft_p50_ms", "ttft_p99_ms", "output_tok_s") if kv[k] and rr[k]}
    config = {k: v for k, v in vars(args).items() if k not in ("json", "keep_dir", "prefill", "decode", "both")}
    topology = dict(Counter(roles.values()))
    named = args.model or ("tiny" if args.tiny else Path(model).name)  # not this machine's paths
    report = {"benchmark": "routing", "config": {**config, "workers": topology, "model": named,
                                                 "longest_prompt": longest},
              "results": results, "ratios": ratios}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
