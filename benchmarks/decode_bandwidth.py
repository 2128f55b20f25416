"""Batch-1 decode against the memory-bandwidth limit, measured in the same run.

A batch-1 decode step reads every weight once, so `weight bytes / read bandwidth` is the
fastest a step can be. This script measures the machine's read bandwidth (a large tensor
reduced by the same torch threads), counts the bytes one step reads, and times batch-1 decode
steps of the model forward with the native kernels and with plain torch ops, then (unless
`--skip-serve`) the TPOT of `pdserve serve --aggregated` answering one request at a time. The
read rate is measured again at the end: on a shared host it can move between runs minutes
apart, and two figures far apart say the limit moved under the steps.

    python benchmarks/decode_bandwidth.py --json decode-bw.json
    python benchmarks/decode_bandwidth.py --model CKPT_DIR --context 1024 --skip-serve
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.common.model_source import default_model_path
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.model.runner import ModelRunner
from pdserve.worker.memory_budget import num_parameters

from serving_load import Workload, ratio
from vs_vllm import measure_topology

BANDWIDTH_BYTES = 1 << 30  # larger than any last-level cache here


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--skip-serve", action="store_true", help="only the model forward, no served TPOT")
    parser.add_argument("--serve-prompts", type=int, default=8, help="prompts of the served run, one at a time")
    parser.add_argument("--serve-output-len", type=int, default=64, help="tokens each served prompt decodes")
    return parser.parse_args(argv)


def read_bandwidth() -> float:
    """Bytes per second of reading a 1 GiB tensor once (best of five)."""
    data = torch.ones(BANDWIDTH_BYTES // 2, dtype=torch.int16)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.max()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best


def step_bytes(runner: ModelRunner) -> int:
    """Weight bytes one decode step reads: every layer's matrices, biases and norms, final norm,
    LM head (an untied embedding is not read: a step looks up one row of it)."""
    config = runner.config
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return (num_parameters(config) - untied_embedding) * runner.dtype.itemsize


def decode_step_s(runner: ModelRunner, context: int, steps: int) -> float:
    """Median seconds of a batch-1 decode step `context` tokens into a sequence."""
    tpb = runner.tokens_per_block
    table = tuple(range(-(-(context + steps + 1) // tpb)))
    runner.forward(ForwardBatch((SeqChunk("r", tuple(range(1, context + 1)), 0, table, is_prompt=True),)))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        runner.forward(ForwardBatch((SeqChunk("r", (7,), context + i, table),)))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    bandwidth = read_bandwidth()
    rows, limit_ms = [], None
    for kernels in ("native", "torch"):
        runner = ModelRunner.load(model, args.dtype, "cpu", num_blocks=-(-(args.context + args.steps + 1) // 16),
                                  kernels=kernels)
        limit_ms = 1e3 * step_bytes(runner) / bandwidth
        step_ms = 1e3 * decode_step_s(runner, args.context, args.steps)
        rows.append({"system": f"forward-{kernels}", "step_ms": step_ms, "fraction_of_limit": limit_ms / step_ms})
        del runner
    if not args.skip_serve:
        single = Workload("single", args.serve_prompts, args.context, args.serve_output_len, max_concurrency=1, seed=1)
        with tempfile.TemporaryDirectory(prefix="decode-bw-") as scratch:
            _, served = measure_topology("pdserve-agg", ["--aggregated"], model, [single], Path(scratch))
        tpot = served["tpot_p50_ms"]
        rows.append({"system": "served-agg (TPOT p50)", "step_ms": tpot, "fraction_of_limit": limit_ms / tpot})
    bandwidth_after = read_bandwidth()
    result = {"benchmark": "decode_bandwidth",
              "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model,
                         "threads": torch.get_num_threads()},
              "read_bandwidth_gb_s": bandwidth / 1e9, "read_bandwidth_after_gb_s": bandwidth_after / 1e9,
              "limit_ms": limit_ms, "results": rows,
              "ratios": {"forward step: torch / native": ratio(rows[1]["step_ms"], rows[0]["step_ms"])}}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
