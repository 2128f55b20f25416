"""The lower KV tiers through `pdserve serve` (tiny checkpoint, a device cache of 1024 tokens, 1 MiB
of host tier): a prompt pushed out of the device cache by others comes back from the host tier as
cached tokens, with the same greedy text; disaggregated, the decode worker's host hit means the
prefill worker sends nothing for it. With a disk tier, blocks survive a restart of serve: the
stopping worker writes its host tier to disk, and the new one finds them there."""
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.stack import free_port, free_port_pair, make_tiny_checkpoint, start_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "The keeper climbed the stairs of the old lighthouse to light the lamp. " * 5  # ~80 tokens
FLUSH = [f"Flush {i}: rivers, bridges and markets of a city nobody has written about before. " * 18
         for i in range(5)]  # ~300 tokens each: five together are more than the device cache holds


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def serve(checkpoint: Path, directory: Path, *topology: str,
          host_cache: str = "1MiB") -> tuple[subprocess.Popen, str, list[str]]:
    """serve, its URL, and its workers' metrics URLs (serve gives worker i the metrics base + i)."""
    port, metrics = free_port(), free_port_pair()
    process, _ = start_serve(directory, [
        "--model", str(checkpoint), "--port", str(port), "--metrics-port", str(metrics), "--device", "cpu",
        "--dtype", "float32", "--max-model-len", "512", "--max-kv-tokens", "1024", "--host-cache-size", host_cache,
        "--cache-dir", "", "--startup-timeout", "150", *topology])
    num_workers = 1 if "--aggregated" in topology else 2
    return process, f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{metrics + i}/metrics" for i in range(num_workers)]


def complete(url: str, prompt: str) -> tuple[str, int, dict[str, str]]:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0},
                          timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    route = dict(part.split("=", 1) for part in response.headers["x-pdserve-route"].split(";"))
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], route


def metric(urls: list[str], name: str, at_least: float, timeout_s: float = 10.0) -> float:
    """The sum of `name` over the workers' metrics, once it reaches `at_least` (a worker's
    snapshot follows its engine loop) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = []
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as response:
                lines += response.read().decode().splitlines()
        value = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                    if line.startswith(name + " ") or line.startswith(name + "{"))
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.parametrize("topology", [("--aggregated",), ()], ids=["aggregated", "disaggregated"])
def test_a_prompt_pushed_out_of_the_device_cache_comes_back_from_the_host_tier(checkpoint: Path, tmp_path: Path,
                                                                              topology: tuple[str, ...]) -> None:
    process, url, metrics = serve(checkpoint, tmp_path, *topology)
    try:
        first, cached, _ = complete(url, PROMPT)
        assert cached == 0
        for prompt in FLUSH:
            complete(url, prompt)
        assert metric(metrics, "pdserve_kv_offloaded_blocks_total", 5) >= 5
        again, cached, route = complete(url, PROMPT)
        assert again == first
        assert cached >= 64  # four or more of its five full blocks, from the host tier
        assert metric(metrics, "pdserve_kv_onboarded_blocks_total", 4) >= 4
        if not topology:  # the decode worker had it: nothing to prefill remotely, nothing to send
            assert route["prefilled_by"] == "local", route
    finally:
        process.terminate()
        process.wait(60)


def test_blocks_written_to_disk_at_a_graceful_stop_are_found_after_a_restart(checkpoint: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv-disk"
    flags = ("--aggregated", "--disk-cache-dir", str(disk), "--disk-cache-size", "8MiB")
    process, url, _ = serve(checkpoint, tmp_path / "first", *flags)
    try:
        first, _, _ = complete(url, PROMPT)
        for prompt in FLUSH:  # the prompt's blocks move down to the host tier
            complete(url, prompt)
    finally:
        process.terminate()  # a graceful stop: the worker writes its host tier to disk
        assert process.wait(60) == 0
    assert len(list(disk.rglob("*.kv"))) >= 5
    process, url, metrics = serve(checkpoint, tmp_path / "second", *flags)
    try:
        again, cached, _ = complete(url, PROMPT)
        assert (again, cached >= 64) == (first, True)
        assert metric(metrics, "pdserve_kv_loaded_blocks_total", 4) >= 4
    finally:
        process.terminate()
        process.wait(60)
