"""The compose test's bench step: `pdserve bench` one request at a time against the demo's router
and against the host's server, in turns, so that both see the same drift of a shared machine."""
import json
import subprocess
import sys
from pathlib import Path

from pdserve.common.model_source import default_model_path

ROUNDS = 2
PER_ROUND = dict(num_prompts=4, input_len=128, output_len=32)
BENCH_TIMEOUT_S = 600.0


def bench_tpot(url: str, seed: int, out: Path) -> float:
    """p50 TPOT (ms) of one round against `url`."""
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url, "--dataset-name", "random",
            "--num-prompts", str(PER_ROUND["num_prompts"]), "--random-input-len", str(PER_ROUND["input_len"]),
            "--random-output-len", str(PER_ROUND["output_len"]), "--ignore-eos", "--max-concurrency", "1",
            "--num-warmups", "1", "--seed", str(seed), "--tokenizer", default_model_path(), "--disable-tqdm",
            "--metric-percentiles", "50", "--json", str(out)]
    subprocess.run(argv, check=True, capture_output=True, timeout=BENCH_TIMEOUT_S)
    return float(json.loads(out.read_text())["p50_tpot_ms"])


def batch1_tpot(demo_url: str, host_url: str, scratch: Path) -> tuple[float, float]:
    """(demo, host) p50 TPOT in ms, each the mean of its rounds' p50s."""
    demo, host = [], []
    for r in range(ROUNDS):
        demo.append(bench_tpot(demo_url, 100 + r, scratch / f"demo-{r}.json"))
        host.append(bench_tpot(host_url, 200 + r, scratch / f"host-{r}.json"))
    return sum(demo) / len(demo), sum(host) / len(host)
