"""Speculative decoding against none, served as users run it: `pdserve serve --aggregated` without
speculation, then with `--speculative-config` (n-gram prompt lookup by default), one after the
other, taking turns for `--rounds` rounds; each driven by `pdserve bench` (greedy, ignore_eos,
`/v1/completions`) on two workloads at each `--concurrency`: `copy` (an instruction to repeat a
passage of prose: the output repeats spans of the prompt, where prompt lookup drafts well) and
`random` (random tokens: nothing in the prompt to copy, though a small model's greedy answer
soon repeats itself, which prompt lookup drafts from too).

Per row: output tok/s, TPOT and TTFT percentiles (the batch-1 TPOT p50 is the figure speculation
is meant to cut), and from the worker's `vllm:spec_decode_*` counters, scraped before and after
each row: drafts, draft tokens, accepted tokens, the acceptance rate per draft position
(accepted at position i / drafts), and the mean accepted length (1 + accepted / drafts, as vLLM
reports it). One warm-up bench per server (another seed) comes first, so the counters of a row
are that row's requests only. The ratios spec / no-spec per workload and concurrency compare
each row's best round (a shared machine's noise only ever slows a round down); every round's
row is in `results`.

    python benchmarks/speculative.py --json results-speculative.json
    python benchmarks/speculative.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 2}'
    python benchmarks/speculative.py --concurrency 1 --num-prompts 2 --output-len 16 --workloads copy
"""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.model_source import default_model_path

from burst import start_serve  # sibling modules: this directory is on sys.path
from run_all import machine_info
from serving_load import PERCENTILES, ratio, result_row
from serving_stack import COMMAND, stop_process, work_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SYSTEMS = ("no_spec", "spec")
WORKLOADS = ("copy", "random")
SPEC_PREFIX = "vllm:spec_decode_"
SETTLE_S = 0.5  # the worker's counters follow its engine loop
COMPARED = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or checkpoint directory (default: the bundled model)")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM), help="vLLM's JSON, as serve takes it")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 64], help="comma-separated, e.g. 1,8,64")
    parser.add_argument("--num-prompts", type=int_list, default=[10, 16, 64], help="per concurrency, same order")
    parser.add_argument("--workloads", type=lambda text: text.split(","), default=list(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (instruction and passage on copy)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    parser.add_argument("--num-warmups", type=int, default=2, help="unmeasured requests per server, first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="the servers take turns this many times; the "
                        "ratios compare each row's best round")
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags, for both servers")
    parser.add_argument("--keep-dir", help="keep serve's logs and the bench JSON here")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if len(args.num_prompts) != len(args.concurrency):
        parser.error("--num-prompts needs one count per --concurrency")
    if not set(args.workloads) <= set(WORKLOADS):
        parser.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    json.loads(args.speculative_config)  # a typo fails here, not after the first server's rows
    return args


def bench_argv(workload: str, num_prompts: int, concurrency: int, seed: int, args: argparse.Namespace) -> list[str]:
    """The `pdserve bench` flags of one row, less the target and the result path."""
    if workload == "copy":
        dataset = ["--copy-input-len", str(args.input_len), "--copy-output-len", str(args.output_len)]
    else:
        dataset = ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    return ["--endpoint", args.endpoint, "--dataset-name", workload, *dataset, "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
            "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm"]


def run_bench(flags: list[str], url: str, tokenizer: str, json_path: Path) -> dict:
    """`pdserve bench` as a user runs it; its result JSON."""
    argv = [*COMMAND, "bench", "--base-url", url, "--tokenizer", tokenizer, *flags, "--json", str(json_path)]
    print("  " + " ".join(argv[2:]), flush=True)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return json.loads(json_path.read_text())


def spec_counters(metrics_ports: list[int]) -> dict[str, float]:
    """The `vllm:spec_decode_*` counters summed over the workers, by name (and position)."""
    time.sleep(SETTLE_S)
    found: dict[str, float] = {}
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(SPEC_PREFIX) and sample.name.endswith("_total"):
                    name = sample.name[len(SPEC_PREFIX):-len("_total")]
                    key = f"{name}[{sample.labels['position']}]" if "position" in sample.labels else name
                    found[key] = found.get(key, 0.0) + sample.value
    return found


def acceptance(before: dict[str, float], after: dict[str, float], num_positions: int) -> dict:
    """What the row's drafts did: counts, the acceptance rate at each draft position (at least
    `num_positions`: a position never accepted has no series yet), the mean accepted length."""
    moved = {key: after[key] - before.get(key, 0.0) for key in after}
    seen = [int(key.split("[")[1].rstrip("]")) for key in moved if key.startswith("num_accepted_tokens_per_pos[")]
    num_positions = max([num_positions, *(i + 1 for i in seen)])
    drafts, accepted = moved.get("num_drafts", 0.0), moved.get("num_accepted_tokens", 0.0)
    draft_tokens = moved.get("num_draft_tokens", 0.0)
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "acceptance_rate_per_position": [moved.get(f"num_accepted_tokens_per_pos[{i}]", 0.0) / drafts
                                             for i in range(num_positions)] if drafts else [],
            "mean_accepted_len": 1 + accepted / drafts if drafts else None}


def measure(system: str, args: argparse.Namespace, directory: Path, round_: int) -> list[dict]:
    flags = ("--aggregated",) + (("--speculative-config", args.speculative_config) if system == "spec" else ())
    tokenizer = args.model or str(default_model_path())
    num_positions = json.loads(args.speculative_config).get("num_speculative_tokens", 0)
    name = f"{system}-{round_}"
    serve, url, metrics_ports = start_serve(name, flags, args, directory)
    rows = []
    try:
        if args.num_warmups:
            warmup = bench_argv("copy", args.num_warmups, args.num_warmups, args.seed + 1, args)
            run_bench(warmup, url, tokenizer, directory / f"{name}-warmup.json")
        for workload in args.workloads:
            for concurrency, num_prompts in zip(args.concurrency, args.num_prompts):
                before = spec_counters(metrics_ports)
                bench = run_bench(bench_argv(workload, num_prompts, concurrency, args.seed, args), url, tokenizer,
                                  directory / f"{name}-{workload}-{concurrency}.json")
                rows.append({**result_row(system, workload, bench), "concurrency": concurrency, "round": round_,
                             "load_1m": os.getloadavg()[0],
                             **acceptance(before, spec_counters(metrics_ports), num_positions)})
    finally:
        stop_process(serve)
    return rows


def best_rounds(rows: list[dict]) -> dict[tuple, dict]:
    """Per (system, workload, concurrency) its round of the most output tok/s: a shared
    machine's noise only ever slows a round down."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["system"], row["workload"], row["concurrency"])
        if key not in best or row["output_tok_s"] > best[key]["output_tok_s"]:
            best[key] = row
    return best


def side_by_side(by_key: dict[tuple, dict]) -> tuple[dict, list[str]]:
    """Ratios spec / no-spec per workload and concurrency, and the printed table."""
    ratios, lines = {}, [f"{'workload':<8}{'conc':>5}  {'metric':<14}{'no_spec':>10}{'spec':>10}{'ratio':>8}"]
    for (system, workload, concurrency), spec in by_key.items():
        base = by_key.get(("no_spec", workload, concurrency))
        if system != "spec" or base is None:
            continue
        for metric in COMPARED:
            value = ratio(spec[metric], base[metric])
            ratios[f"{metric} ({workload} @{concurrency}): spec / no_spec"] = value
            lines.append(f"{workload:<8}{concurrency:>5}  {metric:<14}{base[metric] or 0:>10.2f}"
                         f"{spec[metric] or 0:>10.2f}{value or 0:>8.2f}")
        per_position = " ".join(f"{rate:.2f}" for rate in spec["acceptance_rate_per_position"])
        lines.append(f"{'':<13}  accepted per position [{per_position}], mean accepted length "
                     f"{spec['mean_accepted_len'] or 0:.2f}")
    return ratios, lines


def git_commit() -> str:
    here = Path(__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with work_dir(args.keep_dir, "pdserve-speculative-") as directory:
        rows = []
        for round_ in range(args.rounds):
            for system in SYSTEMS:
                print(f"speculative: round {round_}, {system}", flush=True)
                rows += measure(system, args, directory, round_)
    ratios, table = side_by_side(best_rounds(rows))
    config = {key: value for key, value in vars(args).items() if key not in ("json", "keep_dir")}
    config |= {"speculative_config": json.loads(args.speculative_config),
               "model": Path(args.model or default_model_path()).name, "commit": git_commit(),
               "machine": machine_info()}
    report = {"benchmark": "speculative", "config": config, "results": rows, "ratios": ratios}
    print(json.dumps(report, indent=1))
    print("\n".join(table))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
