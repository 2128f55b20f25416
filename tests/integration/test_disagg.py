"""Disaggregated serving with real processes: a prefill worker pushes prompt KV over NIXL (UCX)
into a decode worker; an aggregated worker (role both) on the same checkpoint is the reference.

Requests go to the decode worker's gRPC service with `prefill_worker` set, as the router sends them.
"""
import asyncio
from collections.abc import Iterator

import pytest

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.rpc.worker_client import GrpcBackend
from tests.integration.stack import free_port, make_tiny_checkpoint, metric, start, stop, wait_for_worker

pytestmark = pytest.mark.integration
BLOCK = 16


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[dict]:
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
              "--max-kv-tokens", "8192", "--block-size", str(BLOCK), "--num-threads", "1", "--log-level", "info"]
    ports = {role: free_port() for role in ("prefill", "decode", "both")}
    metrics_port = free_port()
    procs = {
        "prefill": start(["worker", "--role", "prefill", "--port", str(ports["prefill"]), *common], logs / "p.log"),
        "decode": start(["worker", "--role", "decode", "--port", str(ports["decode"]),
                         "--metrics-port", str(metrics_port), "--disagg-min-prefill-tokens", "1", *common],
                        logs / "d.log"),
        "both": start(["worker", "--role", "both", "--port", str(ports["both"]), *common], logs / "b.log"),
    }
    try:
        for role, proc in procs.items():
            wait_for_worker(f"127.0.0.1:{ports[role]}", proc)
        yield {"addr": {r: f"127.0.0.1:{p}" for r, p in ports.items()},
               "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        for proc in procs.values():
            stop(proc)


def _request(rid: str, prompt: list[int], max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))


async def _generate(address: str, request: GenerationRequest, prefill_worker: str | None = None) -> list[int]:
    backend = GrpcBackend(address)
    try:
        tokens: list[int] = []
        async for out in backend.generate(request, prefill_worker):
            assert out.finish_reason in (None, "length"), out
            tokens += out.token_ids
        return tokens
    finally:
        await backend.close()


async def _integrity(address: str):
    backend = GrpcBackend(address)
    try:
        return await backend.check_integrity()
    finally:
        await backend.close()


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(length)]


def test_disaggregated_outputs_equal_aggregated_for_mixed_lengths(workers):
    addr = workers["addr"]
    prompts = [_prompt(s, n) for s, n in enumerate((5, 17, 40, 75, 130, 257))]

    async def run():
        disagg = asyncio.gather(*(_generate(addr["decode"], _request(f"d{i}", p), addr["prefill"])
                                  for i, p in enumerate(prompts)))
        agg = asyncio.gather(*(_generate(addr["both"], _request(f"a{i}", p)) for i, p in enumerate(prompts)))
        return await disagg, await agg

    disagg, agg = asyncio.run(run())
    assert disagg == agg
    assert all(len(t) == 8 for t in disagg)


def test_shared_prefix_moves_only_the_blocks_the_decode_worker_lacks(workers):
    addr, url = workers["addr"], workers["metrics"]
    first = _prompt(100, 10 * BLOCK + 3)  # 11 blocks
    second = first[:9 * BLOCK] + _prompt(200, 2 * BLOCK + 5)  # shares 9 full blocks, 12 blocks in all
    label = 'direction="received"'
    before = metric(url, "pdserve_kv_transfer_blocks_sum", label)
    asyncio.run(_generate(addr["decode"], _request("s1", first), addr["prefill"]))
    after_first = metric(url, "pdserve_kv_transfer_blocks_sum", label)
    asyncio.run(_generate(addr["decode"], _request("s2", second), addr["prefill"]))
    after_second = metric(url, "pdserve_kv_transfer_blocks_sum", label)
    assert after_first - before == 11
    assert after_second - after_first == 12 - 9
    assert metric(url, "pdserve_kv_transfer_bytes_total", label) > 0


def test_no_prefill_worker_prefills_locally_and_counts_it(workers):
    addr, url = workers["addr"], workers["metrics"]
    prompt = _prompt(300, 50)
    before = metric(url, "pdserve_local_prefills_total", 'reason="no_prefill_worker"')
    local = asyncio.run(_generate(addr["decode"], _request("l1", prompt)))
    assert local == asyncio.run(_generate(addr["both"], _request("l2", prompt)))
    assert metric(url, "pdserve_local_prefills_total", 'reason="no_prefill_worker"') == before + 1


def test_unreachable_prefill_worker_falls_back_to_local_prefill(workers):
    addr = workers["addr"]
    prompt = _prompt(400, 60)
    dead = f"127.0.0.1:{free_port()}"
    assert asyncio.run(_generate(addr["decode"], _request("u1", prompt), dead)) == \
        asyncio.run(_generate(addr["both"], _request("u2", prompt)))


def test_integrity_holds_and_nothing_is_held_for_a_peer_afterwards(workers):
    for role in ("prefill", "decode", "both"):
        report = asyncio.run(_integrity(workers["addr"][role]))
        assert (report.ok, report.error, report.num_held_for_peer, report.num_used_blocks) == (True, "", 0, 0)
