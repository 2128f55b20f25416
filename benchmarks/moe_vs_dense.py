"""A mixture of experts against a dense model of the same active parameters, served as users run
them: tokens per second with one stream and with `--in-flight` streams at once.

Two random-weight bf16 checkpoints with the same attention, embeddings and SmolLM2 tokenizer (cut
to `--vocab` ids): a Mixtral of `--experts` experts of intermediate size `--expert-intermediate`,
`--top-k` per token, and a Llama whose MLP is `--top-k` times as wide, so a token runs as many MLP
weights in each (the mixture holds experts / top-k times as many). Each is served by `pdserve
serve --aggregated --model DIR` and measured with `pdserve bench` (random prompts, ignore_eos):
`--single-prompts` prompts one at a time, then `--in-flight` prompts all at once. The models take
turns for `--rounds` rounds; the ratios compare each model's best round (a shared machine's noise
only ever slows a round down), every round's row is in `results`. One stream reads top-k experts
per layer and step, about the dense MLP's bytes; many read every expert once a step, so the
mixture's ratio is expected to fall with the batch where reading weights bounds a step. The
forward path each model runs on (a native level, or torch ops where the kernels refuse it) is in
`config`.

    python benchmarks/moe_vs_dense.py --json results-moe-vs-dense.json
    python benchmarks/moe_vs_dense.py --hidden 128 --layers 2 --in-flight 4 --output-len 4
"""
import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from burst import start_serve  # sibling modules: this directory is on sys.path
from serving_load import Workload, ratio, run_online
from serving_stack import save_tokenizer, stop_process, work_dir

MODELS = ("moe", "dense")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("hidden", 512), ("layers", 4), ("heads", 8), ("kv-heads", 4), ("experts", 8),
                          ("top-k", 2), ("expert-intermediate", 768), ("vocab", 8192), ("input-len", 64),
                          ("output-len", 32), ("single-prompts", 4), ("in-flight", 64), ("num-warmups", 1),
                          ("rounds", 2), ("seed", 0)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--serve-flags", default="--kv-cache-memory 256MiB --max-model-len 512",
                        help="more `pdserve serve` flags, for both models")
    parser.add_argument("--keep-dir", help="keep the checkpoints, serve's logs and the bench JSON here")
    parser.add_argument("--json", help="write the report here")
    return parser.parse_args(argv)


def make_checkpoints(args: argparse.Namespace, directory: Path) -> dict[str, dict]:
    """Both checkpoints; per model its folder and parameter counts (all, and run per token)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shared = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, vocab_size=args.vocab, max_position_embeddings=2048,
                  tie_word_embeddings=True, dtype="bfloat16")
    built = {"moe": (MixtralForCausalLM, MixtralConfig(intermediate_size=args.expert_intermediate,
                                                      num_local_experts=args.experts,
                                                      num_experts_per_tok=args.top_k, **shared)),
             "dense": (LlamaForCausalLM, LlamaConfig(intermediate_size=args.top_k * args.expert_intermediate,
                                                    **shared))}
    models = {}
    for name, (model_class, config) in built.items():
        folder = directory / name
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = save_tokenizer(folder, args.vocab)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        torch.manual_seed(args.seed)
        model = model_class(config).to(torch.bfloat16)
        model.save_pretrained(folder)
        total = sum(p.numel() for p in model.parameters())
        idle_experts = (args.experts - args.top_k) * 3 * args.hidden * args.expert_intermediate * args.layers
        models[name] = {"path": folder, "parameters": total,
                        "active_parameters": total - idle_experts if name == "moe" else total}
    return models


def forward_path(path: Path) -> str:
    """The kernels `--kernels auto` runs the checkpoint on: a native level's name, or torch."""
    from pdserve.engine.model.runner import ModelRunner

    runner = ModelRunner.load(path, dtype="bfloat16", device="cpu", num_blocks=4, kernels="auto")
    return runner.native.level if runner.native is not None else "torch"


def measure(name: str, model: dict, args: argparse.Namespace, directory: Path, round_: int) -> list[dict]:
    workloads = [Workload("single", args.single_prompts, args.input_len, args.output_len, max_concurrency=1,
                          num_warmups=args.num_warmups, seed=args.seed),
                 Workload("in_flight", args.in_flight, args.input_len, args.output_len,
                          max_concurrency=args.in_flight, num_warmups=args.num_warmups, seed=args.seed)]
    serve_args = argparse.Namespace(model=str(model["path"]), serve_flags=args.serve_flags)
    serve, url, _ = start_serve(f"{name}-{round_}", ("--aggregated",), serve_args, directory)
    try:
        return [{**run_online(name, w, url, str(model["path"]), None, directory), "streams": w.max_concurrency,
                 "round": round_} for w in workloads]
    finally:
        stop_process(serve)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with work_dir(args.keep_dir, "pdserve-moe-vs-dense-") as directory:
        models = make_checkpoints(args, directory)
        paths = {name: forward_path(model["path"]) for name, model in models.items()}
        rows = []
        for round_ in range(args.rounds):
            for name in MODELS:
                print(f"moe_vs_dense: round {round_}, {name} ({paths[name]})", flush=True)
                rows += measure(name, models[name], args, directory, round_)
    by_key = {}  # (model, workload) -> its best round
    for row in rows:
        best = by_key.setdefault((row["system"], row["workload"]), row)
        if row["output_tok_s"] > best["output_tok_s"]:
            by_key[(row["system"], row["workload"])] = row
    ratios = {}
    for workload in ("single", "in_flight"):
        moe, dense = by_key[("moe", workload)], by_key[("dense", workload)]
        for metric in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms"):
            ratios[f"{metric} ({workload}): moe / dense"] = ratio(moe[metric], dense[metric])
    config = {key: value for key, value in vars(args).items() if key not in ("json", "keep_dir")}
    config |= {"forward_path": paths, "machine": platform.machine(), "cpus": os.cpu_count(),
               "parameters": {name: m["parameters"] for name, m in models.items()},
               "active_parameters": {name: m["active_parameters"] for name, m in models.items()}}
    report = {"benchmark": "moe_vs_dense", "config": config, "results": rows, "ratios": ratios}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
