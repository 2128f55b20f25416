"""What each logits processor costs the batched sampler, per step, against plain sampling.

One `Sampler.sample` call on a decode step's logits (`--batch` rows × `--vocab`), every row
with a `--prompt-len` prompt and `--output-len` tokens generated so far, for: no processor, each
processor alone on every row (presence, frequency, repetition penalties, logit_bias with
`--num-biases` entries, min_tokens not yet reached, `--num-bad-words` two-token bad words), all
of them together, and all of them on one row in eight (the rest plain). Greedy and sampled rows
(temperature 0.8, top-p 0.95) each. Ratios are each case's step time over the plain one.
A benchmark, not a test: nothing here is asserted.

    python benchmarks/sampler_processors.py --json sampler_processors.json
"""
import argparse
import json
import os
import platform
import random
import time
from dataclasses import replace

import torch

from pdserve.common.request import SamplingParams
from pdserve.engine.model.logits_processors import TokenHistory
from pdserve.engine.model.sampler import Sampler, SamplingRow


def cases(args: argparse.Namespace, vocab: list[int]) -> dict[str, SamplingParams]:
    pick = random.Random(1)
    biases = tuple(sorted({pick.choice(vocab): 5.0 for _ in range(args.num_biases)}.items()))
    bad_words = tuple((pick.choice(vocab), pick.choice(vocab)) for _ in range(args.num_bad_words))
    base = SamplingParams(max_tokens=args.output_len + 64)
    each = {
        "presence_penalty": replace(base, presence_penalty=0.5),
        "frequency_penalty": replace(base, frequency_penalty=0.5),
        "repetition_penalty": replace(base, repetition_penalty=1.2),
        "logit_bias": replace(base, logit_bias=biases),
        "min_tokens": replace(base, min_tokens=args.output_len + 1, stop_token_ids=(1, 2)),
        "bad_words": replace(base, bad_words=bad_words),
    }
    every = replace(base, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias=biases,
                    min_tokens=args.output_len + 1, bad_words=bad_words)
    return {"none": base, **each, "all": every}


def step_ms(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], repeats: int) -> float:
    sampler.sample(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(logits, rows)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def measure(args: argparse.Namespace) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((args.batch, args.vocab), generator=generator)  # (B, V)
    pick = random.Random(0)
    histories = [TokenHistory([pick.randrange(args.vocab) for _ in range(args.prompt_len + args.output_len)],
                              args.prompt_len) for _ in range(args.batch)]
    sampler = Sampler(seed=0, eos_token_ids=(0,))
    rows = []
    for name, params in cases(args, list(range(args.vocab))).items():
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            chosen = replace(params, temperature=temperature, top_p=1.0 if temperature == 0.0 else 0.95)
            plain = replace(SamplingParams(max_tokens=chosen.max_tokens), temperature=chosen.temperature,
                            top_p=chosen.top_p)
            every_row = [SamplingRow(chosen, history=h) for h in histories]
            rows.append({"case": name, "mode": mode, "rows_with_it": args.batch,
                         "ms_per_step": step_ms(sampler, logits, every_row, args.repeats)})
            if name == "all":
                some = [SamplingRow(chosen if i % 8 == 0 else plain, history=h) for i, h in enumerate(histories)]
                rows.append({"case": "all", "mode": mode, "rows_with_it": len(range(0, args.batch, 8)),
                             "ms_per_step": step_ms(sampler, logits, some, args.repeats)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-biases", type=int, default=16)
    parser.add_argument("--num-bad-words", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10, help="best of this many steps per case")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args)
    plain = {r["mode"]: r["ms_per_step"] for r in results if r["case"] == "none"}
    report = {
        "benchmark": "sampler_processors",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch_threads": torch.get_num_threads(), "load_average_1m": os.getloadavg()[0]},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "results": results,
        "ratios": {f"{r['case']}_{r['mode']}_{r['rows_with_it']}rows_over_none": r["ms_per_step"] / plain[r["mode"]]
                   for r in results if r["case"] != "none"},
    }
    print(f"{'case':>20}{'mode':>9}{'rows':>6}{'ms/step':>10}{'x none':>8}")
    for r in results:
        print(f"{r['case']:>20}{r['mode']:>9}{r['rows_with_it']:>6}{r['ms_per_step']:>10.2f}"
              f"{r['ms_per_step'] / plain[r['mode']]:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
