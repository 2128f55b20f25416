"""Time one step's matrix products alone, in bf16, on the kernels of the level this CPU runs.

At the AVX-512 levels: oneDNN's kernel against `blocked_linear`, both on the same packed weights
(the measurement behind `BLOCKED_ROWS` in `engine/model/native_forward.py`; on a CPU with AMX
tiles, run it to see where oneDNN's tiles overtake the kernel). At the AVX2 level, where oneDNN
packs no bf16: the panel kernel against torch's own bf16 product on plain weights (what `--kernels
torch` runs) and against float32 weights through `at::linear` (what `--dtype float32` runs).
SmolLM2-135M's shapes by default (per layer the fused QKV, output, fused gate/up and down
projections, then the LM head), `--layers` distinct copies so that they stream from memory as in
a real step. For each row count the kernels alternate `--rounds` times; each figure is the median
of `--repeat` passes over every product. The JSON holds every round's figures, their medians and
each kernel's ratio to the first.

    .venv/bin/python benchmarks/packed_products.py --threads 1 --rows 1,10,64 --json products.json
"""
import argparse
import json
import statistics
import time

import torch

from pdserve.engine.model.native import KernelsUnavailable, load_native
from pdserve.engine.model.native_forward import pack, weight_form


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("hidden", 576), ("intermediate", 1536), ("heads", 9), ("kv-heads", 3), ("head-dim", 64),
                          ("vocab", 49152), ("layers", 30), ("threads", 2), ("rounds", 3), ("repeat", 7)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rows", default="1,4,10,16,32,64,128,256", help="row counts, comma-separated")
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args()


def model_with(module, packed: bool, blocked_rows: int):
    """A weightless NativeModel, only for its `linear` (the layers' own dispatch)."""
    e = torch.zeros(4, 64, dtype=torch.bfloat16)
    return module.NativeModel(e, torch.ones(64, dtype=torch.bfloat16), e, layers=[], ropes=[], num_heads=1,
                              num_kv_heads=1, head_dim=64, eps=1e-5, attention_scale=0.125, embed_scale=None,
                              packed=packed, blocked_rows=blocked_rows)


def kernels_of(module, plains: list[torch.Tensor], max_rows: int) -> dict:
    """name -> (product of x and one of the weights, the weights as it reads them), the level's
    own kernel last."""
    if weight_form(module, torch.bfloat16) == "panels":
        panels = [(module.to_panels(w), w.shape[0]) for w in plains]
        model = model_with(module, False, 0)
        return {"torch_bf16": (lambda x, w: torch.nn.functional.linear(x, w), plains),
                "torch_f32": (lambda x, w: torch.nn.functional.linear(x.float(), w), [w.float() for w in plains]),
                "panels": (lambda x, w: model.linear(x, w[0], None, None, w[1]), panels)}
    packed = [pack(w) for w in plains]
    if not all(module.blocked_layout(p, w) for p, w in zip(packed, plains)):
        raise SystemExit("oneDNN packs bf16 weights in another layout on this CPU: blocked_linear stays off")
    onednn, blocked = model_with(module, True, 0), model_with(module, True, max_rows)
    return {"onednn": (lambda x, w: onednn.linear(x, w, None, None), packed),
            "blocked": (lambda x, w: blocked.linear(x, w, None, None), packed)}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    try:
        module = load_native("native")
    except KernelsUnavailable as exc:
        raise SystemExit(f"needs the native kernels: {exc}") from None
    h, qkv = args.hidden, (args.heads + 2 * args.kv_heads) * args.head_dim
    shapes = [(qkv, h), (h, args.heads * args.head_dim), (2 * args.intermediate, h), (h, args.intermediate)]
    g = torch.Generator().manual_seed(0)
    plains = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes * args.layers + [(args.vocab, h)]]
    row_counts = [int(r) for r in args.rows.split(",")]
    kernels = kernels_of(module, plains, max(row_counts))
    del plains

    def one_pass(product, weights, xs) -> float:
        start = time.perf_counter()
        for w, k in zip(weights, [k for _, k in shapes] * args.layers + [h]):
            product(xs[k], w)
        return time.perf_counter() - start

    results, first = [], next(iter(kernels))
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in shapes}}
        rounds = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, (product, weights) in kernels.items():
                one_pass(product, weights, xs)  # warm
                rounds[name].append(statistics.median(one_pass(product, weights, xs) for _ in range(args.repeat)) * 1e3)
        medians = {name: statistics.median(ms) for name, ms in rounds.items()}
        row = {"rows": m, "rounds_ms": rounds, "median_ms": medians,
               "ratios": {f"{name}_to_{first}": medians[name] / medians[first] for name in kernels if name != first}}
        results.append(row)
        print(f"{m:5d} rows: " + "  ".join(f"{name} {ms:8.2f} ms" for name, ms in medians.items()), flush=True)
    weight_bytes = sum(n * k * 2 for n, k in shapes * args.layers + [(args.vocab, h)])
    result = {"benchmark": "packed_products",
              "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "weight_bytes": weight_bytes,
                         "cpu_capability": torch.backends.cpu.get_cpu_capability(), "level": module.LEVEL},
              "results": results,
              "ratios": {f"{name}_{r['rows']}_rows": value for r in results for name, value in r["ratios"].items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
