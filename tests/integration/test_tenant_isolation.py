"""Tenant isolation through the disaggregated topology (`pdserve serve` with a keys file: a prefill
worker, a decode worker, mutual TLS between them): the isolation audit of `pdserve.bench.isolation`
with cached-token counts standing in for timing (never asserted in a test). Two tenants sending
the same prompt share no block in either worker's cache, in what the prefill worker transfers,
or in the router's prefix index; the positive control (the victim's own repeat) hits in all three."""
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.bench.isolation import run_audit, verdict
from tests.integration.stack import banner_address, free_port, make_tiny_checkpoint, start_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VICTIM_KEY, ATTACKER_KEY = "sk-victim-0123456789", "sk-attacker-987654321"
NUM_PROMPTS = 8


@dataclass
class Serve:
    url: str
    prefill: str


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    directory = tmp_path_factory.mktemp("isolation")
    checkpoint = make_tiny_checkpoint(directory / "tiny")
    keys = directory / "api-keys"
    keys.write_text(f"{VICTIM_KEY} victim\n{ATTACKER_KEY} attacker\n")
    port = free_port()
    process, banner = start_serve(directory, [
        "--model", str(checkpoint), "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "512", "--max-kv-tokens", "8192", "--cache-dir", "", "--startup-timeout", "150",
        "--api-keys-file", str(keys)])
    try:
        yield Serve(f"http://127.0.0.1:{port}", banner_address(banner, "prefill"))
    finally:
        process.terminate()
        process.wait(60)


def route(sample) -> dict[str, str]:
    return dict(part.split("=", 1) for part in sample.route.split(";"))


def test_the_isolation_audit_sees_the_cache_within_a_tenant_and_nothing_across(serve: Serve) -> None:
    # ~80 tokens each, five full 16-token blocks; every prompt distinct from its first word on
    prompts = [f"Audit {i}: the keeper climbed the stairs every night to light the lamp. " * 5
               for i in range(NUM_PROMPTS)]
    fresh = [f"Fresh {i}: a prompt nobody has sent, about rivers and their many bridges. " * 5
             for i in range(NUM_PROMPTS)]
    with httpx.Client(base_url=serve.url, timeout=60.0) as client:
        samples = run_audit(client, VICTIM_KEY, ATTACKER_KEY, prompts, fresh)
    by_kind = {kind: [s for s in samples if s.kind == kind] for kind in ("hit", "cross", "miss")}
    assert [s.cached_tokens for s in by_kind["cross"]] == [0] * NUM_PROMPTS  # neither worker's cache
    assert [s.cached_tokens for s in by_kind["miss"]] == [0] * NUM_PROMPTS
    assert all(s.cached_tokens >= 64 for s in by_kind["hit"])  # the positive control
    crossing = [route(s) for s in by_kind["cross"]]
    assert {(r["decode_overlap"], r["prefill_overlap"]) for r in crossing} == {("0", "0")}  # the router's index
    assert {r["prefilled_by"] for r in crossing} == {serve.prefill}  # computed anew, then transferred
    assert all(int(route(s)["decode_overlap"]) >= 4 for s in by_kind["hit"])
    counts = verdict(samples, "cached_tokens")
    assert counts.is_isolated(), counts
    assert (counts.hit_statistic, counts.cross_statistic) == (1.0, 0.0)
    verdict(samples, "ttft_s")  # computed (the benchmark reports it), never asserted: timing
