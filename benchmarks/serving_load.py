"""Workloads for the serving benchmarks, and one result row per measured run (with the
machine's 1-minute load average at its end: on a shared machine it explains outliers).

Online: `pdserve bench`'s Python API against a base URL (streamed HTTP, vLLM-compatible JSON);
the same workload and seed send the same text to every server. Offline: every prompt sent at
once straight to a worker's gRPC service (no HTTP, no router), as token ids.
"""
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.cli import run_benchmark
from pdserve.bench.datasets import DatasetSpec, build_dataset
from pdserve.bench.options import parse_config
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.tls import TlsConfig
from pdserve.models.tokenizer import Tokenizer
from pdserve.rpc.worker_client import GrpcBackend

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
OFFLINE_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class Workload:
    """Random prompts of `prefix_len` shared + `input_len - prefix_len` own tokens."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    prefix_len: int = 0
    max_concurrency: int | None = None  # None: every request sent at once
    num_warmups: int = 2
    seed: int = 0

    def as_dict(self) -> dict:
        return {"name": self.name, "num_prompts": self.num_prompts, "input_len": self.input_len,
                "output_len": self.output_len, "prefix_len": self.prefix_len,
                "max_concurrency": self.max_concurrency, "num_warmups": self.num_warmups, "seed": self.seed}


def bench_argv(workload: Workload, base_url: str, tokenizer: str, model: str | None, json_path: Path) -> list[str]:
    """The `pdserve bench` command line (also valid for `vllm bench serve`, less --json)."""
    argv = ["--base-url", base_url, "--endpoint", "/v1/completions", "--dataset-name", "random",
            "--num-prompts", str(workload.num_prompts),
            "--random-input-len", str(workload.input_len - workload.prefix_len),
            "--random-prefix-len", str(workload.prefix_len), "--random-output-len", str(workload.output_len),
            "--ignore-eos", "--seed", str(workload.seed), "--num-warmups", str(workload.num_warmups),
            "--tokenizer", tokenizer, "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--disable-tqdm", "--json", str(json_path)]
    if workload.max_concurrency is not None:
        argv += ["--max-concurrency", str(workload.max_concurrency)]
    return argv + (["--model", model] if model else [])


def result_row(system: str, workload: str, bench: dict) -> dict:
    """One row from a `pdserve bench` JSON document: throughput, then latency percentiles."""
    row = {"system": system, "workload": workload, "completed": bench["completed"], "failed": bench["failed"],
           "duration_s": bench["duration"], "output_tok_s": bench["output_throughput"],
           "total_tok_s": bench["total_token_throughput"], "req_s": bench["request_throughput"]}
    for name in LATENCIES:
        row.update({f"{name}_p{p}_ms": bench.get(f"p{p}_{name}_ms") for p in PERCENTILES})
    return row


def run_online(system: str, workload: Workload, base_url: str, tokenizer: str, model: str | None,
               out_dir: Path) -> dict:
    """Run `workload` against `base_url`; the full bench JSON stays in `out_dir`."""
    json_path = out_dir / f"{system}-{workload.name}.json"
    argv = bench_argv(workload, base_url, tokenizer, model, json_path)
    print(f"  pdserve bench {' '.join(argv)}", flush=True)
    exit_code = asyncio.run(run_benchmark(parse_config(argv)))
    if exit_code != 0:
        raise RuntimeError(f"pdserve bench against {base_url} failed (exit {exit_code})")
    return {**result_row(system, workload.name, json.loads(json_path.read_text())), "load_1m": os.getloadavg()[0]}


def offline_prompts(workload: Workload, tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The token ids of the online workload's prompts (same dataset builder and seed)."""
    spec = DatasetSpec(name="random", num_prompts=workload.num_prompts,
                       random_input_len=workload.input_len - workload.prefix_len,
                       random_output_len=workload.output_len, random_prefix_len=workload.prefix_len)
    conversations = build_dataset(spec, tokenizer, workload.seed)
    return [tuple(tokenizer.encode(c.turns[0].text, add_special_tokens=False)) for c in conversations]


async def _generate_all(address: str, prompts: list[tuple[int, ...]], output_len: int, tag: str,
                        tls: TlsConfig | None) -> int:
    """Send every prompt at once; the number of output tokens received."""
    backend = GrpcBackend(address, generate_timeout_s=OFFLINE_TIMEOUT_S, tls=tls)
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: tuple[int, ...]) -> int:
        request = GenerationRequest(RequestId(f"{tag}-{i}"), prompt, sampling)
        return sum([len(out.token_ids) async for out in backend.generate(request)])

    try:
        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await backend.close()


def run_offline(system: str, workload: Workload, address: str, tokenizer: Tokenizer, tls: TlsConfig | None) -> dict:
    """Offline throughput of the worker at `address`: all prompts at once over gRPC (mutual TLS
    with `tls`, the credentials of the worker's own authority; plain text with None)."""
    prompts = offline_prompts(workload, tokenizer)
    warmup = [tuple(reversed(p)) for p in prompts[: workload.num_warmups]]  # nothing the run could reuse
    if warmup:
        asyncio.run(_generate_all(address, warmup, workload.output_len, "warmup", tls))
    started = time.perf_counter()
    num_output = asyncio.run(_generate_all(address, prompts, workload.output_len, "offline", tls))
    duration = time.perf_counter() - started
    num_input = sum(len(p) for p in prompts)
    return {"system": system, "workload": workload.name, "completed": len(prompts), "failed": 0,
            "duration_s": duration, "output_tok_s": num_output / duration,
            "total_tok_s": (num_input + num_output) / duration, "req_s": len(prompts) / duration,
            "load_1m": os.getloadavg()[0]}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator
