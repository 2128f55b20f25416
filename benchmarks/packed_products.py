"""Time one step's matrix products alone: oneDNN's kernel against `blocked_linear`.

Both read the same packed bf16 weights (SmolLM2-135M's shapes by default: per layer the fused
QKV, output, fused gate/up and down projections, then the LM head), `--layers` distinct copies
so that they stream from memory as in a real step. For each row count the two alternate
`--rounds` times; each figure is the median of `--repeat` passes over every product. The JSON
holds every round's figures, their medians and the ratio blocked / oneDNN per row count: the
measurement behind `BLOCKED_ROWS` in `engine/model/native_forward.py` (on a CPU with AMX tiles,
run it to see where oneDNN's tiles overtake the kernel).

    .venv/bin/python benchmarks/packed_products.py --threads 1 --rows 1,10,64 --json products.json
"""
import argparse
import json
import statistics
import time

import torch

from pdserve.engine.model.native import load_native
from pdserve.engine.model.native_forward import pack, packs_weights


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("hidden", 576), ("intermediate", 1536), ("heads", 9), ("kv-heads", 3), ("head-dim", 64),
                          ("vocab", 49152), ("layers", 30), ("threads", 2), ("rounds", 3), ("repeat", 7)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rows", default="1,4,10,16,32,64,128,256", help="row counts, comma-separated")
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args()


def model_with(module, blocked_rows: int):
    """A weightless NativeModel, only for its `linear` (the layers' own dispatch)."""
    e = torch.zeros(4, 64, dtype=torch.bfloat16)
    return module.NativeModel(e, torch.ones(64, dtype=torch.bfloat16), e, [], torch.ones(16), 1, 1, 64, 1e-5, 0,
                              True, blocked_rows)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    module = load_native(None)
    if module is None or not packs_weights(torch.bfloat16):
        raise SystemExit("needs the native kernels and oneDNN's bf16 kernels on this CPU")
    h, qkv = args.hidden, (args.heads + 2 * args.kv_heads) * args.head_dim
    shapes = [(qkv, h), (h, args.heads * args.head_dim), (2 * args.intermediate, h), (h, args.intermediate)]
    g = torch.Generator().manual_seed(0)
    weights, layouts_read = [], []
    for n, k in shapes * args.layers + [(args.vocab, h)]:
        plain = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        weights.append(pack(plain))
        layouts_read.append(module.blocked_layout(weights[-1], plain))
    if not all(layouts_read):
        raise SystemExit("oneDNN packs bf16 weights in another layout on this CPU: blocked_linear stays off")
    row_counts = [int(r) for r in args.rows.split(",")]
    kernels = {"onednn": model_with(module, 0), "blocked": model_with(module, max(row_counts))}

    def one_pass(model, xs) -> float:
        start = time.perf_counter()
        for w in weights:
            model.linear(xs[w.shape[1]], w, None, None)
        return time.perf_counter() - start

    results = []
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in shapes}}
        rounds = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, model in kernels.items():
                one_pass(model, xs)  # warm
                rounds[name].append(statistics.median(one_pass(model, xs) for _ in range(args.repeat)) * 1e3)
        medians = {name: statistics.median(ms) for name, ms in rounds.items()}
        row = {"rows": m, "rounds_ms": rounds, "median_ms": medians,
               "ratio_blocked_to_onednn": medians["blocked"] / medians["onednn"]}
        results.append(row)
        print(f"{m:5d} rows: oneDNN {medians['onednn']:8.2f} ms  blocked {medians['blocked']:8.2f} ms  "
              f"ratio {row['ratio_blocked_to_onednn']:.2f}", flush=True)
    weight_bytes = sum(n * k * 2 for n, k in shapes * args.layers + [(args.vocab, h)])
    result = {"benchmark": "packed_products",
              "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "weight_bytes": weight_bytes,
                         "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "results": results,
              "ratios": {f"blocked_to_onednn_{r['rows']}_rows": r["ratio_blocked_to_onednn"] for r in results}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
