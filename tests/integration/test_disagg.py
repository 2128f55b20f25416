"""Disaggregated serving with real processes: a prefill worker pushes prompt KV over NIXL (UCX)
into a decode worker; an aggregated worker (role both) on the same checkpoint is the reference.

Requests go to the decode worker's gRPC service with `prefill_worker` set, as the router sends them.
"""
import asyncio
from collections.abc import Iterator

import grpc
import pytest

from pdserve.common.errors import DuplicateRequestError, InvalidRequestError
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


@pytest.mark.parametrize("seed", [7, 1234])
def test_seeded_sampling_gives_the_same_tokens_disaggregated_and_aggregated(workers, seed):
    addr = workers["addr"]
    prompts = [_prompt(s, n) for s, n in zip((500, 501, 502), (17, 75, 130))]
    sampling = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)

    def seeded(rid: str, prompt: list[int]) -> GenerationRequest:
        return GenerationRequest(RequestId(rid), tuple(prompt), sampling)

    async def run():
        disagg = asyncio.gather(*(_generate(addr["decode"], seeded(f"sd{seed}-{i}", p), addr["prefill"])
                                  for i, p in enumerate(prompts)))
        agg = asyncio.gather(*(_generate(addr["both"], seeded(f"sa{seed}-{i}", p)) for i, p in enumerate(prompts)))
        greedy = asyncio.gather(*(_generate(addr["both"], _request(f"sg{seed}-{i}", p, 12))
                                  for i, p in enumerate(prompts)))
        return await disagg, await agg, await greedy

    disagg, agg, greedy = asyncio.run(run())
    assert disagg == agg
    assert agg != greedy  # the seed drives real sampling, not a greedy pick
    assert all(len(t) == 12 for t in disagg)


def test_a_duplicate_id_is_refused_alone_and_the_other_streams_finish(workers):
    """Over the wire: ALREADY_EXISTS for an id in use, INVALID_ARGUMENT for one that would alias a
    sibling's sequence; the streams already running on the decode worker are untouched."""
    addr = workers["addr"]
    max_tokens = 400  # long enough to be running when the duplicates arrive

    def long(rid: str, seed: int, n: int = 1) -> GenerationRequest:
        return GenerationRequest(RequestId(rid), tuple(_prompt(seed, 40)),
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n))

    async def refused(backend: GrpcBackend, request: GenerationRequest, prefill_worker: str | None):
        with pytest.raises((DuplicateRequestError, InvalidRequestError)) as info:
            async for _ in backend.generate(request, prefill_worker):
                pass
        return info.value

    async def run():
        backend = GrpcBackend(addr["decode"])
        try:
            remote = backend.generate(long("dup-a", 600), addr["prefill"])  # prefilled on the prefill worker
            local = backend.generate(long("dup-x", 601, n=2))  # n > 1: prefilled here, "dup-x#1" forked
            outputs = [await remote.__anext__(), await local.__anext__()]
            duplicate = await refused(backend, long("dup-a", 602), addr["prefill"])
            alias = await refused(backend, long("dup-x#1", 603), None)
            outputs += [out async for out in remote] + [out async for out in local]
            return duplicate, alias, outputs
        finally:
            await backend.close()

    duplicate, alias, outputs = asyncio.run(run())
    assert isinstance(duplicate, DuplicateRequestError) and "'dup-a' is in use" in str(duplicate)
    assert duplicate.__cause__.code() == grpc.StatusCode.ALREADY_EXISTS
    assert isinstance(alias, InvalidRequestError) and alias.param == "request_id"
    assert alias.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
    counts: dict[tuple, int] = {}
    for out in outputs:
        assert out.finish_reason in (None, "length"), out
        counts[(out.request_id, out.index)] = counts.get((out.request_id, out.index), 0) + len(out.token_ids)
    assert counts == {("dup-a", 0): max_tokens, ("dup-x", 0): max_tokens, ("dup-x", 1): max_tokens}
    for role in ("prefill", "decode"):
        report = asyncio.run(_integrity(addr[role]))
        assert (report.ok, report.error, report.num_held_for_peer, report.num_used_blocks) == (True, "", 0, 0)


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


WINDOW_BLOCK = 4  # tiny blocks: a prompt of 3 windows of 8 spans 6, the first 4 out of the window's reach


def _tiny_with_tokenizer(directory, kind: str) -> str:
    """model_builders' tiny `kind` checkpoint (vocabulary 300, a window of 8) with SmolLM2's
    tokenizer beside it, which a worker needs; prompts keep to ids below 300."""
    import os

    from transformers import AutoTokenizer

    from pdserve.common.model_source import default_model_path
    from tests.unit.engine.model_builders import make_checkpoint

    make_checkpoint(directory, kind)
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def window_workers(request, tmp_path_factory) -> Iterator[dict]:
    """Prefill, decode and aggregated workers on a sliding-window checkpoint: Mistral (every layer
    has the window) or Gemma 3 (a window layer, then a global one)."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = _tiny_with_tokenizer(root / "model", request.param)
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
              "--max-kv-tokens", "4096", "--block-size", str(WINDOW_BLOCK), "--num-threads", "1"]
    ports = {role: free_port() for role in ("prefill", "decode", "both", "prefill_metrics", "decode_metrics")}
    procs = {
        "prefill": start(["worker", "--role", "prefill", "--port", str(ports["prefill"]),
                          "--metrics-port", str(ports["prefill_metrics"]), *common], root / "p.log"),
        "decode": start(["worker", "--role", "decode", "--port", str(ports["decode"]),
                         "--metrics-port", str(ports["decode_metrics"]), "--disagg-min-prefill-tokens", "1",
                         *common], root / "d.log"),
        "both": start(["worker", "--role", "both", "--port", str(ports["both"]), *common], root / "b.log"),
    }
    try:
        for role, proc in procs.items():
            wait_for_worker(f"127.0.0.1:{ports[role]}", proc)
        yield {"kind": request.param, "addr": {r: f"127.0.0.1:{ports[r]}" for r in procs},
               "metrics": {r: f"http://127.0.0.1:{ports[f'{r}_metrics']}/metrics" for r in ("prefill", "decode")}}
    finally:
        for proc in procs.values():
            stop(proc)


def _window_prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + i * 17) % 280 + 10 for i in range(length)]


def test_a_prompt_three_windows_long_leaves_the_out_of_reach_slices_behind_and_decodes_as_aggregated(
        window_workers):
    addr, urls = window_workers["addr"], window_workers["metrics"]
    prompt = _window_prompt(1, 3 * 8)  # the decode worker's first query is at 24: blocks 0..3 are out of reach

    def skipped(role: str, direction: str) -> tuple[float, float]:
        return tuple(metric(urls[role], f"pdserve_kv_window_skipped_{what}_total", f'direction="{direction}"')
                     for what in ("blocks", "bytes"))

    before = skipped("prefill", "sent"), skipped("decode", "received")
    disagg = asyncio.run(_generate(addr["decode"], _request(f"w-{window_workers['kind']}", prompt, 12),
                                   addr["prefill"]))
    agg = asyncio.run(_generate(addr["both"], _request(f"wa-{window_workers['kind']}", prompt, 12)))
    assert disagg == agg and len(disagg) == 12
    after = skipped("prefill", "sent"), skipped("decode", "received")
    # (L=2, K and V, 4 tokens, 2 KV heads, head_dim 32, float32): 2048 bytes per layer of a block
    layers_left = 2 if window_workers["kind"] == "mistral" else 1
    for (blocks_before, bytes_before), (blocks_after, bytes_after) in zip(before, after):
        assert (blocks_after - blocks_before, bytes_after - bytes_before) == (4, 4 * layers_left * 2048)
    for role in ("prefill", "decode"):
        report = asyncio.run(_integrity(addr[role]))
        assert (report.ok, report.num_held_for_peer, report.num_used_blocks) == (True, 0, 0)


def test_integrity_holds_and_nothing_is_held_for_a_peer_afterwards(workers):
    for role in ("prefill", "decode", "both"):
        report = asyncio.run(_integrity(workers["addr"][role]))
        assert (report.ok, report.error, report.num_held_for_peer, report.num_used_blocks) == (True, "", 0, 0)
