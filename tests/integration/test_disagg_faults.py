"""Faults in the KV hand-off between real prefill and decode processes (NIXL over UCX): a
prefill worker restarted on its address, and clients that drop their streams while their
prompts are being prefilled remotely. Each ends with the decode worker's integrity check true
and its blocks back at baseline."""
import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.rpc.worker_client import GrpcBackend
from tests.integration.stack import free_port, make_tiny_checkpoint, metric, start, stop, wait_for_worker

pytestmark = pytest.mark.integration
SETTLE_TIMEOUT_S = 20.0  # well inside the 40 s lease a reservation would otherwise wait out


class Stack:
    def __init__(self, directory: Path) -> None:
        checkpoint = str(make_tiny_checkpoint(directory / "tiny"))
        self.logs = directory
        self.common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                       "--max-kv-tokens", "8192", "--block-size", "16", "--num-threads", "1", "--log-level", "info"]
        self.prefill_port, self.decode_port, self.metrics_port = free_port(), free_port(), free_port()
        self.starts = 0
        self.prefill = self.start_prefill()
        self.decode = self.start_decode()

    @property
    def prefill_address(self) -> str:
        return f"127.0.0.1:{self.prefill_port}"

    @property
    def decode_address(self) -> str:
        return f"127.0.0.1:{self.decode_port}"

    def start_prefill(self):
        self.starts += 1
        process = start(["worker", "--role", "prefill", "--worker-id", "prefill-0", "--port", str(self.prefill_port),
                         *self.common], self.logs / f"prefill-{self.starts}.log")
        wait_for_worker(self.prefill_address, process)
        return process

    def start_decode(self):
        """The decode worker; its worker id (the NIXL agent name) is the same at every start."""
        self.starts += 1
        process = start(["worker", "--role", "decode", "--worker-id", "decode-0", "--port", str(self.decode_port),
                         "--metrics-port", str(self.metrics_port), "--disagg-min-prefill-tokens", "1", *self.common],
                        self.logs / f"decode-{self.starts}.log")
        wait_for_worker(self.decode_address, process)
        return process

    def metric(self, name: str, labels: str = "") -> float:
        return metric(f"http://127.0.0.1:{self.metrics_port}/metrics", name, labels)

    def close(self) -> None:
        stop(self.prefill)
        stop(self.decode)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("faults"))
    try:
        yield stack
    finally:
        stack.close()


def _request(rid: str, seed: int, length: int = 200, max_tokens: int = 8) -> GenerationRequest:
    prompt = tuple((seed * 7919 + i * 104729) % 40000 + 100 for i in range(length))
    return GenerationRequest(RequestId(rid), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))


async def _generate(stack: Stack, request: GenerationRequest, prefill: bool = True) -> list[int]:
    backend = GrpcBackend(stack.decode_address)
    try:
        tokens: list[int] = []
        async for out in backend.generate(request, stack.prefill_address if prefill else None):
            assert out.finish_reason in (None, "length"), out
            tokens += out.token_ids
        return tokens
    finally:
        await backend.close()


async def _settled(stack: Stack, baseline: int) -> tuple[bool, int]:
    """Waits (bounded) until the decode worker holds nothing for a peer and its used blocks are
    back at `baseline`; (integrity ok, blocks in use)."""
    backend = GrpcBackend(stack.decode_address)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT_S
        while True:
            report = await backend.check_integrity()
            if report.num_held_for_peer == 0 and report.num_used_blocks <= baseline or loop.time() > deadline:
                return report.ok, report.num_used_blocks
            await asyncio.sleep(0.2)
    finally:
        await backend.close()


def _used_blocks(stack: Stack) -> int:
    async def read() -> int:
        backend = GrpcBackend(stack.decode_address)
        try:
            return (await backend.check_integrity()).num_used_blocks
        finally:
            await backend.close()
    return asyncio.run(read())


def test_a_prefill_worker_restarted_on_its_address_serves_remote_prefills_again(stack):
    reference = asyncio.run(_generate(stack, _request("ref", 1), prefill=False))
    asyncio.run(_generate(stack, _request("warm", 2)))  # the decode worker now knows the peer
    received = stack.metric("pdserve_kv_transfer_bytes_total", 'direction="received"')
    failures = stack.metric("pdserve_kv_transfer_failures_total", 'direction="received"')
    local = stack.metric("pdserve_local_prefills_total", 'reason="peer_unavailable"')
    stop(stack.prefill)
    stack.prefill = stack.start_prefill()  # same address, same worker id, no handshake with us
    assert asyncio.run(_generate(stack, _request("after", 1))) == reference
    assert stack.metric("pdserve_kv_transfer_bytes_total", 'direction="received"') > received
    assert stack.metric("pdserve_kv_transfer_failures_total", 'direction="received"') == failures
    assert stack.metric("pdserve_local_prefills_total", 'reason="peer_unavailable"') == local


def test_clients_dropping_streams_during_remote_prefills_give_every_block_back(stack):
    asyncio.run(_generate(stack, _request("warm-2", 3)))
    baseline = _used_blocks(stack)

    async def drop_eight() -> None:
        tasks = [asyncio.create_task(_generate(stack, _request(f"drop-{i}", 10 + i, length=400, max_tokens=64)))
                 for i in range(8)]
        await asyncio.sleep(0.3)  # the calls are out; their prompts are being prefilled
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(drop_eight())
    ok, used = asyncio.run(_settled(stack, baseline))
    assert ok and used <= baseline
    assert asyncio.run(_generate(stack, _request("after-drops", 4))) == \
        asyncio.run(_generate(stack, _request("after-drops-ref", 4), prefill=False))


def test_the_first_output_names_the_worker_that_prefilled_the_prompt(stack):
    async def first_output(request: GenerationRequest, prefill: bool):
        backend = GrpcBackend(stack.decode_address)
        try:
            outputs = [out async for out in backend.generate(request, stack.prefill_address if prefill else None)]
        finally:
            await backend.close()
        return outputs[0], outputs[1:]

    remote, rest = asyncio.run(first_output(_request("path-remote", 20), prefill=True))
    assert remote.prefilled_by == stack.prefill_address and all(o.prefilled_by == "" for o in rest)
    local, _ = asyncio.run(first_output(_request("path-local", 21), prefill=False))
    assert local.prefilled_by == "local"


def test_a_decode_worker_restarted_under_its_worker_id_gets_remote_prefills_again(stack):
    """The prefill worker knows the old decode agent under the same id: the new one's handshake
    replaces it (NIXL metadata of a new process), and its KV then arrives over the new peer."""
    asyncio.run(_generate(stack, _request("before-restart", 30)))
    stop(stack.decode)
    stack.decode = stack.start_decode()
    reference = asyncio.run(_generate(stack, _request("restart-ref", 31), prefill=False))
    assert asyncio.run(_generate(stack, _request("after-restart", 31))) == reference
    assert stack.metric("pdserve_kv_transfer_bytes_total", 'direction="received"') > 0
    assert stack.metric("pdserve_local_prefills_total", 'reason="peer_unavailable"') == 0
