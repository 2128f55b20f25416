"""Time prefill attention alone: the native paged kernel against torch's flash attention.

Both attend `--seqs` fresh prompts of `--prompt-len` tokens, causally, in bf16, with SmolLM2's
heads by default (9 query heads over 3 KV heads of 64): the native kernel reads K and V where
they lie in the paged cache (the worker's path); torch's `scaled_dot_product_attention` gets
each prompt's K and V gathered into contiguous tensors (gathering included in its time). The two
alternate `--rounds` times; each figure is one layer's time (mean of `--repeat` calls) scaled to
`--layers`; the JSON holds every round's figures, their medians and the ratio of the medians. On a CPU with AMX
tiles both kernels multiply on them; elsewhere the native one uses AVX512-BF16 dot products, or at
the AVX2 level float FMAs on K and V widened once per 32-key chunk.

    .venv/bin/python benchmarks/prefill_attention.py --prompt-len 1024 --json attn.json
"""
import argparse
import json
import statistics
import time

import torch

from pdserve.engine.model.native import KernelsUnavailable, load_native


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("seqs", 8), ("prompt-len", 1024), ("heads", 9), ("kv-heads", 3), ("head-dim", 64),
                          ("tokens-per-block", 64), ("layers", 30), ("threads", 2), ("rounds", 3), ("repeat", 5)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args()


class Problem:
    """Random bf16 queries and a paged KV cache holding every prompt's keys and values."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        seqs, length, tpb = args.seqs, args.prompt_len, args.tokens_per_block
        nh, kvh, hd = args.heads, args.kv_heads, args.head_dim
        per_seq = -(-length // tpb)
        g = torch.Generator().manual_seed(0)
        self.kv = torch.randn(seqs * per_seq, 1, 2, tpb, kvh, hd, generator=g).bfloat16()
        self.tables = torch.randperm(seqs * per_seq, generator=g).to(torch.int32).view(seqs, per_seq)
        self.segments = torch.tensor([[s * length, length, 0, 1] for s in range(seqs)], dtype=torch.int32)
        self.q = torch.randn(seqs * length, (nh + 2 * kvh) * hd, generator=g).bfloat16()  # q heads first

    def native(self, module) -> torch.Tensor:
        a = self.args
        return module.attention(self.q, self.kv, 0, self.segments, self.tables, a.heads, a.head_dim ** -0.5, 0)

    def flash(self) -> torch.Tensor:
        a = self.args
        length, nh, kvh, hd = a.prompt_len, a.heads, a.kv_heads, a.head_dim
        out = torch.empty(a.seqs * length, nh * hd, dtype=torch.bfloat16)
        for s in range(a.seqs):
            blocks = self.tables[s].long()
            k, v = (self.kv[blocks, 0, kind].reshape(-1, kvh, hd)[:length].transpose(0, 1).unsqueeze(0)
                    for kind in (0, 1))
            q = self.q[s * length:(s + 1) * length, :nh * hd].view(length, nh, hd).transpose(0, 1).unsqueeze(0)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5,
                                                                 enable_gqa=True)
            out[s * length:(s + 1) * length].view(length, nh, hd).copy_(o[0].transpose(0, 1))
        return out


def per_model_ms(run, repeat: int, layers: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat * layers * 1e3


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    try:
        module = load_native("native")
    except KernelsUnavailable as exc:
        raise SystemExit(f"needs the native kernels: {exc}") from None
    problem = Problem(args)
    runs = {"native": lambda: problem.native(module), "torch_flash": problem.flash}
    max_diff = (runs["native"]().float() - runs["torch_flash"]().float()).abs().max().item()
    tokens = args.seqs * args.prompt_len
    rows = []
    for r in range(args.rounds):
        for name, run in runs.items():
            ms = per_model_ms(run, args.repeat, args.layers)
            rows.append({"kernel": name, "round": r, "ms_per_model": ms, "tokens_per_s": tokens / (ms / 1e3)})
    medians = {name: statistics.median(row["ms_per_model"] for row in rows if row["kernel"] == name) for name in runs}
    config = {**vars(args), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "level": module.LEVEL}
    result = {
        "benchmark": "prefill_attention", "config": config,
        "results": rows, "median_ms_per_model": medians,
        "ratios": {"ms_per_model: native / torch_flash (medians)": medians["native"] / medians["torch_flash"]},
        "max_abs_difference": max_diff,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
