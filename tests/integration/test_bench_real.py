"""`pdserve bench` against a real pdserve stack on loopback: a `pdserve worker` (role both,
real engine on a tiny random-weight checkpoint) behind a `pdserve router`, as two processes.

What the server reports is read back from its own `/metrics` (requests by status) and from
the `usage` it streams; prompts built by bench must encode to the counts the server charges.
"""
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.bench.cli import main
from pdserve.bench.datasets import DatasetSpec, build_dataset
from pdserve.models.tokenizer import load_tokenizer
from tests.integration.stack import PDSERVE, free_port, make_tiny_checkpoint, stop, wait_for_http

pytestmark = pytest.mark.integration
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(router base URL, checkpoint path) of a running aggregated stack."""
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), MAX_MODEL_LEN))
    worker_port, router_port = free_port(), free_port()
    worker = subprocess.Popen(
        [PDSERVE, "worker", "--model", checkpoint, "--port", str(worker_port), "--device", "cpu",
         "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-kv-tokens", "8192",
         "--num-threads", "1", "--log-level", "warning", "--insecure-internal"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = subprocess.Popen(
        [PDSERVE, "router", "--model", checkpoint, "--port", str(router_port),
         "--worker", f"127.0.0.1:{worker_port}", "--log-level", "warning", "--insecure-internal"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{router_port}"
    try:
        wait_for_http(url, [worker, router])
        yield url, checkpoint
    finally:
        stop(router)
        stop(worker)


def answered(url: str, route: str) -> dict[str, float]:
    """The router's own count of answered requests on `route`, by HTTP status."""
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("pdserve_http_requests_total{") and f'route="{route}"' in line:
            status = line.split('status="')[1].split('"')[0]
            counts[status] = float(line.rsplit(" ", 1)[1])
    return counts


def bench(url: str, checkpoint: str, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    # No --tokenizer: the stack serves the checkpoint under its path, so bench tokenizes with it.
    code = main(["--base-url", url, "--disable-tqdm", "--json", str(out), *args])
    return code, json.loads(out.read_text())


RANDOM = ["--num-prompts", "8", "--random-input-len", "40", "--random-output-len", "6",
          "--random-range-ratio", "0.5", "--ignore-eos", "--request-rate", "40", "--seed", "1"]


def test_counts_and_token_totals_match_what_the_server_reports(stack, tmp_path):
    url, checkpoint = stack
    before = answered(url, "/v1/completions")
    code, result = bench(url, checkpoint, tmp_path, *RANDOM)
    after = answered(url, "/v1/completions")
    spec = DatasetSpec(num_prompts=8, random_input_len=40, random_output_len=6, random_range_ratio=0.5)
    turns = [c.turns[0] for c in build_dataset(spec, load_tokenizer(checkpoint), seed=1)]
    assert code == 0
    assert result["model_id"] == result["tokenizer_id"] == checkpoint
    assert (result["completed"], result["failed"]) == (8, 0)
    assert after.get("200", 0) - before.get("200", 0) == 8
    assert result["total_input_tokens"] == sum(t.num_tokens for t in turns)
    assert sorted(result["input_lens"]) == sorted(t.num_tokens for t in turns)
    assert result["total_output_tokens"] == sum(t.max_tokens for t in turns)


def test_the_seed_makes_two_runs_send_identical_requests(stack, tmp_path):
    url, checkpoint = stack
    serial = [*RANDOM, "--max-concurrency", "1", "--request-rate", "inf"]
    _, first = bench(url, checkpoint, tmp_path, *serial)
    _, second = bench(url, checkpoint, tmp_path, *serial)
    _, other = bench(url, checkpoint, tmp_path, *serial, "--seed", "2")
    assert (first["input_lens"], first["generated_texts"]) == (second["input_lens"], second["generated_texts"])
    assert first["input_lens"] != other["input_lens"]


def test_requests_the_server_refuses_are_counted_as_failed(stack, tmp_path):
    url, checkpoint = stack
    args = ["--num-prompts", "10", "--random-input-len", "230", "--random-output-len", "20",
            "--random-range-ratio", "0.1", "--seed", "3"]
    spec = DatasetSpec(num_prompts=10, random_input_len=230, random_output_len=20, random_range_ratio=0.1)
    turns = [c.turns[0] for c in build_dataset(spec, load_tokenizer(checkpoint), seed=3)]
    too_long = sum(t.num_tokens + t.max_tokens > MAX_MODEL_LEN for t in turns)
    before = answered(url, "/v1/completions")
    code, result = bench(url, checkpoint, tmp_path, *args)
    after = answered(url, "/v1/completions")
    assert 0 < too_long < 10
    assert code == 0
    assert (result["completed"], result["failed"]) == (10 - too_long, too_long)
    assert after.get("400", 0) - before.get("400", 0) == too_long
    assert sum(error.startswith("HTTP 400: ") for error in result["errors"]) == too_long


def test_multi_turn_chat_resends_a_growing_history(stack, tmp_path):
    url, checkpoint = stack
    code, result = bench(url, checkpoint, tmp_path, "--endpoint", "/v1/chat/completions",
                         "--dataset-name", "multi-turn", "--num-prompts", "2", "--multi-turn-num-turns", "3",
                         "--multi-turn-input-len", "12", "--multi-turn-output-len", "4", "--ignore-eos",
                         "--max-concurrency", "1")
    assert code == 0
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 24)
    first, second, third = sorted(result["input_lens"])[::2]  # both conversations have equal shapes
    assert sorted(result["input_lens"]) == [first, first, second, second, third, third]
    assert first < second < third
