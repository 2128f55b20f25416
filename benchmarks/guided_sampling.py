"""Cost of structured output in the batched sampler: one step's `Sampler.sample` over a batch of
logits rows with 0, 1, a quarter, and all of its rows guided by a JSON schema (the bundled
model's 49k-token vocabulary), as a ratio to the unguided step.

Each guided row is a matcher part-way into a JSON object (the mask is computed for a real
grammar state, not the trivial first byte). Prints a table; `--json PATH` writes it.
A benchmark, not a test: nothing here is asserted.

    python benchmarks/guided_sampling.py --batch 32 --json guided_sampling.json
"""
import argparse
import json
import platform
import time

import torch

from pdserve.common.guides import json_schema_guide
from pdserve.common.request import SamplingParams
from pdserve.engine.model.guided import GuideCompiler
from pdserve.engine.model.sampler import Sampler, SamplingRow
from pdserve.models.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PREFIX = '{"name":"Ada Lo'


def best_ms(sampler: Sampler, logits: torch.Tensor, batches: dict[int, list[SamplingRow]],
            repeats: int) -> dict[int, float]:
    """Best step time per case, the cases taken in turn within each repeat (a busy machine
    slows them alike)."""
    times: dict[int, list[float]] = {case: [] for case in batches}
    for _ in range(repeats):
        for case, rows in batches.items():
            start = time.perf_counter()
            sampler.sample(logits, rows)
            times[case].append(time.perf_counter() - start)
    return {case: 1e3 * min(values) for case, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20, help="best of this many steps per case")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(None)
    compiler = GuideCompiler(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    guide = json_schema_guide(SCHEMA)
    params = SamplingParams(temperature=args.temperature)
    logits = torch.randn(args.batch, tokenizer.vocab_size)  # (B, V)
    sampler = Sampler(seed=0)
    batches = {}
    for num_guided in sorted({0, 1, max(1, args.batch // 4), args.batch}):
        matchers = [compiler.matcher(guide) for _ in range(num_guided)]
        for matcher in matchers:
            for token_id in tokenizer.encode(PREFIX, add_special_tokens=False):
                matcher.accept(token_id)
        batches[num_guided] = [SamplingRow(params, None, matchers[i] if i < num_guided else None)
                               for i in range(args.batch)]
    best = best_ms(sampler, logits, batches, args.repeats)
    rows = [{"num_guided_rows": case, "ms_per_step": ms} for case, ms in best.items()]
    base = rows[0]["ms_per_step"]
    for row in rows:
        row["ratio_to_unguided"] = row["ms_per_step"] / base
    report = {
        "benchmark": "guided_sampling",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch_threads": torch.get_num_threads()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "results": rows,
        "ratios": {f"{row['num_guided_rows']}_guided_over_unguided": row["ratio_to_unguided"] for row in rows},
    }
    print(f"{'guided':>8}{'ms/step':>10}{'ratio':>8}")
    for row in rows:
        print(f"{row['num_guided_rows']:>8}{row['ms_per_step']:>10.2f}{row['ratio_to_unguided']:>8.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
