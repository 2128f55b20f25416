"""Failure paths of disaggregated serving, in one process: real engines on a tiny checkpoint,
the real KvTransfer gRPC service, and the fake transport with injected faults."""
import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import replace

import grpc
import pytest
import torch

from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from pdserve.rpc.kv_transfer_service import add_kv_transfer_service
from pdserve.transfer.fake import FakeFabric, FakeTransport, Fault
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.disagg import DecodeEngine, DisaggConfig
from pdserve.worker.engine_inbox import Op
from pdserve.worker.kv.peers import PrefillPeers
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.prefill_service import PrefillService
from tests.unit.engine.token_store_runner import CharTokenizer

TPB = 4
INFO = ModelInfo("tiny", 128, TPB, "sha256-v1", WorkerRole.BOTH, 300, (0,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128)).save_pretrained(path)
    return str(path)


def _threaded(checkpoint: str, num_blocks: int = 64) -> ThreadedEngine:
    runner = ModelRunner.load(checkpoint, "float32", "cpu", num_blocks=num_blocks, tokens_per_block=TPB)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TPB), num_blocks)
    engine = LLMEngine(runner, kv, CharTokenizer(), SchedulerConfig(8, 256, 128))
    threaded = ThreadedEngine(engine, INFO, idle_wait_s=0.005)
    threaded.start()
    return threaded


class Pair:
    """A prefill engine behind a real gRPC KvTransfer server, and a decode engine dialling it."""

    def __init__(self, checkpoint: str, fabric: FakeFabric, transfer_timeout_s: float, recompute: bool,
                 decode_blocks: int = 64) -> None:
        self.fabric = fabric
        self.p, self.d = _threaded(checkpoint), _threaded(checkpoint, decode_blocks)
        self.tp = FakeTransport(WorkerId("p"), self.p.engine.runner.kv_tensor,
                                KvLayoutSpec.for_tensor("tiny", self.p.engine.runner.kv_tensor), fabric)
        self.td = FakeTransport(WorkerId("d"), self.d.engine.runner.kv_tensor,
                                KvLayoutSpec.for_tensor("tiny", self.d.engine.runner.kv_tensor), fabric)
        self.metrics = TransferMetrics()
        self.decode = DecodeEngine(self.d, PrefillPeers(self.td),
                                   DisaggConfig(WorkerId("d"), 1, transfer_timeout_s, 0.5, recompute,
                                                prefill_queue_timeout_s=1.0), self.metrics)

    async def start(self) -> str:
        self.server = grpc.aio.server()
        self.service = PrefillService(self.p, self.tp, TransferMetrics())
        add_kv_transfer_service(self.server, self.service)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def close(self) -> None:
        await self.server.stop(0)
        self.p.stop()
        self.d.stop()

    def used(self) -> tuple[int, int]:
        return self.p.stats().num_used_blocks, self.d.stats().num_used_blocks


def _request(rid: str, max_tokens: int = 6) -> GenerationRequest:
    prompt = tuple((i * 37) % 290 + 5 for i in range(23))
    return GenerationRequest(RequestId(rid), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))


async def _collect(stream) -> list:
    return [out async for out in stream]


async def _until(predicate, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return False


def _run(checkpoint, body, fault=None, transfer_timeout_s=2.0, recompute=False, decode_blocks=64):
    async def main():
        fabric = FakeFabric()
        pair = Pair(checkpoint, fabric, transfer_timeout_s, recompute, decode_blocks)
        address = await pair.start()
        if fault is not None:
            fabric.inject(WorkerId("d"), fault)
        try:
            return await body(pair, address)
        finally:
            await pair.close()
            pair.p.engine.kv.check_integrity()
            pair.d.engine.kv.check_integrity()

    return asyncio.run(main())



async def _on_engine_thread(threaded, look):
    """`look()` on the engine thread between steps (a test's look at its state), run in place of
    the ping query's no-op: the inbox takes no callable."""
    threaded._operations[Op.PING] = look
    try:
        return await threaded._query(Op.PING, timeout_s=10)
    finally:
        threaded._operations[Op.PING] = lambda: None


def test_remote_prefill_equals_local_prefill(checkpoint):
    async def body(pair, address):
        remote = await _collect(pair.decode.generate(_request("r"), address))
        local = await _collect(pair.d.generate(_request("l")))
        assert [o.token_ids for o in remote] == [o.token_ids for o in local]
        assert pair.metrics.blocks.labels("received")._sum.get() == 6  # 23 tokens: 6 blocks moved
        assert await _until(lambda: pair.used() == (0, 0))

    _run(checkpoint, body)


def test_a_prefill_answers_while_the_prefill_engine_runs_its_next_step(checkpoint):
    """The prompt's blocks come with its first token: the write and the answer do not wait for
    the prefill engine's next step to end (on a busy prefill worker, a whole prefill step). Here
    the first token reaches the prefill service only once that next step has begun."""
    async def body(pair, address):
        runner, threaded = pair.p.engine.runner, pair.p
        forward, deliver = runner.forward, threaded._deliver
        prefilled, blocked, release = threading.Event(), threading.Event(), threading.Event()

        def slow_forward(batch):
            if any(c.request_id == "r" for c in batch.chunks):
                prefilled.set()
            elif prefilled.is_set() and not blocked.is_set():
                blocked.set()
                release.wait(timeout=20.0)
            else:
                time.sleep(0.01)  # "busy" decodes until r's order arrives
            return forward(batch)

        def late_deliver(outputs):
            deliver([o for o in outputs if o.request_id != "r"])
            held = [o for o in outputs if o.request_id == "r"]
            if held:
                threading.Thread(target=lambda: blocked.wait(timeout=20.0) and deliver(held)).start()

        runner.forward, threaded._deliver = slow_forward, late_deliver
        try:
            busy = asyncio.create_task(_collect(pair.p.generate(_request("busy", max_tokens=60))))
            assert await _until(lambda: len(pair.p.engine.scheduler.running) == 1)
            stream = pair.decode.generate(_request("r"), address)
            first = await asyncio.wait_for(anext(stream), timeout=5.0)
            assert first.token_ids and blocked.is_set() and not release.is_set()
        finally:
            release.set()
        assert len(first.token_ids) + sum(len(o.token_ids) for o in await _collect(stream)) == 6
        assert sum(len(o.token_ids) for o in await busy) == 60
        assert await _until(lambda: pair.used() == (0, 0))

    _run(checkpoint, body)


def test_transfer_error_fails_the_request_cleanly_and_publishes_nothing(checkpoint):
    async def body(pair, address):
        cached_before = len(pair.d.engine.kv.pool.cached)
        outputs = await _collect(pair.decode.generate(_request("r"), address))
        assert [o.finish_reason for o in outputs] == ["error"]
        assert "KV transfer" in outputs[0].error
        assert await _until(lambda: pair.used() == (0, 0))
        assert len(pair.d.engine.kv.pool.cached) == cached_before  # the failed blocks never became reusable
        assert pair.metrics.failures.labels("received")._value.get() == 1
        assert all(t.is_released for t in pair.tp.posted)

    _run(checkpoint, body, fault=Fault.FAIL)


def test_transfer_error_can_recompute_locally(checkpoint):
    async def body(pair, address):
        outputs = await _collect(pair.decode.generate(_request("r"), address))
        local = await _collect(pair.d.generate(_request("l")))
        assert [o.token_ids for o in outputs] == [o.token_ids for o in local]

    _run(checkpoint, body, fault=Fault.FAIL, recompute=True)


def test_stalled_transfer_times_out_and_both_sides_free(checkpoint):
    async def body(pair, address):
        outputs = await _collect(pair.decode.generate(_request("r"), address))
        assert [o.finish_reason for o in outputs] == ["error"]
        assert await _until(lambda: pair.used() == (0, 0))

    _run(checkpoint, body, fault=Fault.STALL, transfer_timeout_s=0.5)


def test_client_abort_while_waiting_for_kv_frees_both_sides(checkpoint):
    async def body(pair, address):
        task = asyncio.create_task(_collect(pair.decode.generate(_request("r"), address)))
        assert await _until(lambda: len(pair.d.engine.handoffs) == 1 and len(pair.p.engine.handoffs) == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The call ran to its end (the stalled write timed out) and its blocks waited out the lease.
        assert await _until(lambda: pair.used() == (0, 0))
        assert len(pair.d.engine.handoffs) == 0 and len(pair.p.engine.handoffs) == 0
        assert pair.d.engine.handoffs.num_quarantined == 0
        assert pair.metrics.failures.labels("received")._value.get() == 1

    _run(checkpoint, body, fault=Fault.STALL, transfer_timeout_s=1.0)


def test_client_abort_during_a_remote_prefill_frees_the_blocks_when_the_write_lands_not_at_the_lease(checkpoint):
    async def body(pair, address):
        task = asyncio.create_task(_collect(pair.decode.generate(_request("r", max_tokens=50), address)))
        assert await _until(lambda: len(pair.d.engine.handoffs) == 1 and pair.tp.posted)  # the write is out
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for transfer in pair.tp.posted:
            transfer.fault = None  # the stalled write now completes
        # The lease is 30.5 s: freed well before it, because the write completed and said so.
        assert await _until(lambda: pair.used() == (0, 0), timeout_s=10.0)
        assert pair.d.engine.handoffs.num_lease_expiries == 0 and pair.d.engine.handoffs.num_quarantined == 0
        assert pair.metrics.blocks.labels("received")._sum.get() == 6

    _run(checkpoint, body, fault=Fault.STALL, transfer_timeout_s=30.0)


def test_a_late_write_after_a_failed_prefill_lands_only_in_quarantined_blocks(checkpoint):
    """The failed transfer's bytes arrive after the failure was reported, while another request
    runs: every block they reach is still held by the failed request's quarantine, none is free,
    cached or another request's; the quarantine ends with the lease."""
    async def body(pair, address):
        engine = pair.d.engine
        failed = await _collect(pair.decode.generate(_request("r"), address))
        assert [o.finish_reason for o in failed] == ["error"]
        assert engine.handoffs.num_quarantined == 1
        other = GenerationRequest(RequestId("other"), tuple(range(5, 41)),
                                  SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        stream = pair.d.generate(other)
        first = await stream.__anext__()  # its prompt is computed, its blocks live

        def owners() -> dict[int, list[str]]:
            found: dict[int, list[str]] = {}
            for seq_id, seq in engine.kv._seqs.items():
                for block in seq.blocks:
                    found.setdefault(block.block_id, []).append(seq_id)
            return found

        (peer, targets), = pair.fabric.late_write_targets()
        held_by = await _on_engine_thread(pair.d, owners)
        assert peer == "d" and all(held_by.get(b) == ["r"] for b in targets), held_by
        # Its 9 prompt blocks are settled (decoding writes only into the blocks after them).
        prompt_blocks = (await _on_engine_thread(pair.d, lambda: list(engine.kv.block_ids(RequestId("other")))))[:9]
        before = engine.runner.kv_tensor[prompt_blocks].clone()
        assert pair.fabric.land_late_writes() == 1
        assert torch.equal(engine.runner.kv_tensor[prompt_blocks], before)
        rest = [o async for o in stream]
        assert len(first.token_ids + sum((o.token_ids for o in rest), ())) == 8
        assert await _until(lambda: pair.used() == (0, 0), timeout_s=30.0)  # the lease ends
        assert engine.handoffs.num_quarantined == 0

    _run(checkpoint, body, fault=Fault.LATE, transfer_timeout_s=9.5)


def test_a_restarted_prefill_worker_refuses_before_computing_and_the_decode_worker_handshakes_again(checkpoint):
    async def body(pair, address):
        await _collect(pair.decode.generate(_request("a"), address))
        moved = pair.metrics.blocks.labels("received")._sum.get()
        pair.tp.remove_peer(WorkerId("d"))  # the prefill worker forgot us, as after a restart
        prompt = tuple(range(7, 40))  # nothing of it cached on either side
        request = GenerationRequest(RequestId("b"), prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))
        remote = await _collect(pair.decode.generate(request, address))
        local = await _collect(pair.d.generate(GenerationRequest(RequestId("l"), prompt, request.sampling)))
        assert [o.token_ids for o in remote] == [o.token_ids for o in local]
        assert pair.metrics.failures.labels("received")._value.get() == 0
        assert pair.metrics.blocks.labels("received")._sum.get() == moved + 9  # 33 tokens, 9 blocks over the peer
        assert await _until(lambda: pair.used() == (0, 0))

    _run(checkpoint, body)


def test_retiring_a_peer_leaves_the_calls_in_flight_on_its_channel_running(checkpoint):
    async def body(pair, address):
        task = asyncio.create_task(_collect(pair.decode.generate(_request("r"), address)))
        assert await _until(lambda: len(pair.d.engine.handoffs) == 1 and pair.tp.posted)  # the write is out
        peers = pair.decode._peers
        await peers.forget(await peers.get(address))
        for transfer in pair.tp.posted:
            transfer.fault = None  # the stalled write now completes
        outputs = await task
        assert outputs[-1].finish_reason == "length"  # the write landed through the old channel
        assert pair.metrics.failures.labels("received")._value.get() == 0

    _run(checkpoint, body, fault=Fault.STALL, transfer_timeout_s=30.0)


def test_a_handshake_that_hangs_delays_only_the_requests_for_that_address(checkpoint):
    async def body(pair, address):
        silent = socket.socket()  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        peers = PrefillPeers(pair.td, rpc_timeout_s=5.0)
        hanging = asyncio.create_task(peers.get(f"127.0.0.1:{silent.getsockname()[1]}"))
        await asyncio.sleep(0.2)
        peer = await peers.get(address)
        assert peer.address == address and not hanging.done()
        hanging.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await hanging
        silent.close()
        await peers.close()

    _run(checkpoint, body)


def test_orders_beyond_the_prefill_queue_bound_are_prefilled_here(checkpoint):
    async def body(pair, address):
        pair.decode._config = replace(pair.decode._config, max_prefill_queue=1)
        answers = await asyncio.gather(*(_collect(pair.decode.generate(_request(f"r{i}"), address))
                                         for i in range(2)))
        assert sorted(a[0].prefilled_by for a in answers) == sorted([address, "local"])
        assert pair.metrics.local_prefills.labels("prefill_queue_full")._value.get() == 1
        assert answers[0][0].token_ids == answers[1][0].token_ids
        assert pair.decode._queued == {}  # every order counted is uncounted again
        assert await _until(lambda: pair.used() == (0, 0))

    _run(checkpoint, body)
