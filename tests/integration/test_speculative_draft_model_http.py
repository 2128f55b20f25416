"""Draft-model speculative decoding over HTTP: greedy outputs equal a server's without it.

Three `pdserve serve`s over one tiny random target (SmolLM2's tokenizer): one aggregated worker
without speculation (the reference); one aggregated worker drafting on torch ops with a smaller
draft of the same tokenizer (`model` without `method`); one prefill and one decode worker, the
decode worker drafting on the native kernels (`method: draft_model`), every prompt crossing over
NIXL, so the draft computes its own K/V for each prompt there.
"""
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.draft_builders import make_draft_checkpoint
from tests.integration.stack import free_port, free_port_pair, make_tiny_checkpoint, start_serve, stop

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TEXT = "the cat sat on the mat and the dog sat on the log; "
PROMPTS = [TEXT * 3, "one two three four " * 6, "Hello, my name is"]


def _serve(directory: Path, model: Path, *args: str) -> tuple:
    port, metrics = free_port(), free_port_pair()
    process, _ = start_serve(directory, [
        "--model", str(model), "--served-model-name", "tiny", "--port", str(port), "--metrics-port", str(metrics),
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--max-kv-tokens", "4096",
        "--num-threads", "1", "--cache-dir", "", "--startup-timeout", "150", *args])
    return process, f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{metrics + i}/metrics" for i in range(2)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("draft_model")
    target = make_tiny_checkpoint(root / "target", hidden_size=128)
    draft = make_draft_checkpoint(root / "draft", target, num_layers=1)
    topologies = {
        "plain": ("--aggregated", "--kernels", "auto"),
        "aggregated": ("--aggregated", "--kernels", "torch", "--speculative-config",
                       json.dumps({"model": str(draft), "num_speculative_tokens": 3})),
        "disaggregated": ("--prefill", "1", "--decode", "1", "--kernels", "auto", "--disagg-min-prefill-tokens", "1",
                          "--speculative-config",
                          json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4})),
    }
    started = {}
    try:
        for name, args in topologies.items():
            started[name] = _serve(root / name, target, *args)
        yield {name: {"url": url, "metrics": metrics} for name, (_, url, metrics) in started.items()}
    finally:
        for process, _, _ in reversed(list(started.values())):
            stop(process)


def complete(url: str, prompt: str) -> tuple[list[str], dict[str, str]]:
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert response.status_code == 200, response.text
    route = dict(part.split("=", 1) for part in response.headers["x-pdserve-route"].split(";"))
    return response.json()["choices"][0]["logprobs"]["tokens"], route


def spec_counter(metrics_urls: list[str], name: str) -> float:
    """The sum of vllm:spec_decode_<name>_total over a serve's workers (one may have none)."""
    total = 0.0
    for url in metrics_urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        except OSError:
            continue  # an aggregated serve has one worker
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(f"vllm:spec_decode_{name}_total{{"))
    return total


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_outputs_equal_those_without_speculation(servers, prompt):
    expected, _ = complete(servers["plain"]["url"], prompt)
    assert complete(servers["aggregated"]["url"], prompt)[0] == expected
    tokens, route = complete(servers["disaggregated"]["url"], prompt)
    assert tokens == expected
    assert route["prefilled_by"] != "local", route


def test_both_topologies_accept_drafts(servers):
    for prompt in PROMPTS:
        complete(servers["aggregated"]["url"], prompt)
        complete(servers["disaggregated"]["url"], prompt)
    time.sleep(1.0)  # a worker's metrics follow its engine loop
    for name in ("aggregated", "disaggregated"):
        accepted = spec_counter(servers[name]["metrics"], "num_accepted_tokens")
        assert 0 < accepted <= spec_counter(servers[name]["metrics"], "num_draft_tokens"), name
