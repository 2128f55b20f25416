"""The cost of LoRA batching in the model forward, on the native kernels and on torch ops in one
run: prefill and decode throughput with LoRA off, and with 0, 1 and 4 adapters in the batch.

A random-weight Llama (`model_forward.py`'s shape flags) runs on each path; 4 random adapters of
rank `--rank` on every projection are loaded. Each case runs the same `--seqs` sequences: prefill
of `--prompt-len` tokens each, then `--decode-steps` decode steps of one token per sequence,
sequence i under adapter i mod k (k = 0: the base model, LoRA enabled but unused). The cases take
turns for `--rounds` rounds and each keeps its best round (a shared machine's noise only ever
slows a round down). Prints one JSON object (and writes it to `--json PATH`) in the set's shape
(`README.md`): ratios against LoRA off on the same path, and native over torch ops per case.
(That the native path's tokens equal PEFT's: tests/unit/engine/test_lora_fidelity.py.)

    .venv/bin/python benchmarks/lora_batching.py --json results-lora-batching.json
"""
import argparse
import json
import time

import torch

from model_forward import block_tables, random_runner  # sibling module: this directory is on sys.path
from pdserve.engine.loading.lora_files import TARGET_MODULES, LoraCheckpoint, LoraModule
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.model.lora import LoraAdapters, LoraSettings, projection_shape
from pdserve.engine.model.native import cpu_levels
from pdserve.engine.model.runner import ModelRunner

ADAPTERS_IN_BATCH = (0, 1, 4)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("hidden", 512), ("layers", 8), ("heads", 8), ("kv-heads", 8), ("intermediate", 2048),
                          ("vocab", 32000), ("seqs", 16), ("prompt-len", 64), ("decode-steps", 16),
                          ("prefill-budget", 2048), ("tokens-per-block", 16), ("threads", 0), ("rank", 16),
                          ("rounds", 3)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None, help="also write the JSON here")
    args = p.parse_args()
    args.kv_cache_dtype = "auto"
    return args


def random_adapter(runner: ModelRunner, seed: int, rank: int) -> LoraCheckpoint:
    config, generator = runner.config, torch.Generator().manual_seed(seed)
    modules = {}
    for layer in range(config.num_layers):
        for name in TARGET_MODULES:
            out, width = projection_shape(config, name)
            modules[(layer, name)] = LoraModule(torch.randn(rank, width, generator=generator) * 0.01,
                                                torch.randn(out, rank, generator=generator) * 0.01, rank)
    return LoraCheckpoint(seed, f"random-{seed}", rank, modules)


def with_lora(runner: ModelRunner, args: argparse.Namespace) -> ModelRunner:
    """`runner`'s model and forward path, with the adapters loaded."""
    native = runner.native
    adapters = LoraAdapters(runner.config, LoraSettings(max(ADAPTERS_IN_BATCH), args.rank), runner.dtype,
                            runner.device, native.lora_weights if native else None)
    for seed in range(1, max(ADAPTERS_IN_BATCH) + 1):
        adapters.add(random_adapter(runner, seed, args.rank))
    return ModelRunner(runner.model, runner.kv, runner.dtype, runner.device, native, adapters)


def run_case(runner: ModelRunner, args: argparse.Namespace, num_adapters: int) -> dict:
    """Prefill and decode throughput, sequence i under adapter 1 + i mod num_adapters (or the base)."""
    lora = [None if not num_adapters else 1 + i % num_adapters for i in range(args.seqs)]
    tables = block_tables(args)
    prompts = torch.randint(3, args.vocab, (args.seqs, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    per_step = max(1, args.prefill_budget // args.prompt_len)
    runner.forward(ForwardBatch((SeqChunk("warm", tuple(prompts[0]), 0, tables[0], lora_id=lora[0]),)))
    start = time.perf_counter()
    for first in range(0, args.seqs, per_step):
        runner.forward(ForwardBatch(tuple(SeqChunk(str(i), tuple(prompts[i]), 0, tables[i], lora_id=lora[i])
                                          for i in range(first, min(first + per_step, args.seqs)))))
    prefill_s = time.perf_counter() - start
    last, start = [1] * args.seqs, time.perf_counter()
    for step in range(args.decode_steps):
        batch = ForwardBatch(tuple(SeqChunk(str(i), (last[i],), args.prompt_len + step, tables[i], lora_id=lora[i])
                                   for i in range(args.seqs)))
        last = torch.cat(runner.forward(batch).logits).argmax(dim=-1).tolist()
    decode_s = time.perf_counter() - start
    return {"prefill_tokens_per_s": round(args.seqs * args.prompt_len / prefill_s, 1),
            "decode_tokens_per_s": round(args.seqs * args.decode_steps / decode_s, 1)}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = {}
    for path in ("torch", "native") if cpu_levels() else ("torch",):
        args.kernels = path
        plain = random_runner(args)
        lora_runner = with_lora(plain, args)
        runs[f"{path}_lora_off"] = (plain, 0)
        runs.update({f"{path}_lora_on_{k}_adapters": (lora_runner, k) for k in ADAPTERS_IN_BATCH})
    cases: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, (runner, k) in runs.items():
            result = run_case(runner, args, k)
            best = cases.setdefault(name, result)
            for key, value in result.items():
                best[key] = max(best[key], value)
    ratios = {}
    for name, figures in cases.items():
        path, case = name.split("_", 1)
        for phase in ("prefill", "decode"):
            key = f"{phase}_tokens_per_s"
            if case != "lora_off":
                ratios[f"{phase} {name} / {path}_lora_off"] = round(figures[key] / cases[f"{path}_lora_off"][key], 3)
            if path == "native":
                ratios[f"{phase} {name} / torch_{case}"] = round(figures[key] / cases[f"torch_{case}"][key], 3)
    level = runs["native_lora_off"][0].native.level if "native_lora_off" in runs else None
    result = {"benchmark": "lora_batching",
              "config": {**{k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate",
                                                          "vocab", "seqs", "prompt_len", "decode_steps", "rank",
                                                          "dtype", "rounds")},
                         "threads": torch.get_num_threads(), "adapter_targets": list(TARGET_MODULES),
                         "native_level": level},
              "results": [{"case": name, **figures} for name, figures in cases.items()],
              "ratios": ratios}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
