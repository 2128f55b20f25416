"""Disaggregated serving of sliding-window models, in one process: real engines on tiny Mistral
(every layer windowed) and Gemma 3 (a window layer, then a global one) checkpoints, the real
KvTransfer gRPC service, the fake transport. A prompt three windows long hands off its early
blocks without their window layers' slices; the decode worker's tokens equal a local prefill's,
even with NaN where those slices would have been, and its cache never offers those blocks to a
query that would read a missing slice."""
import asyncio

import grpc
import pytest
import torch

from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.model.runner import ModelRunner
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from pdserve.rpc.kv_transfer_service import add_kv_transfer_service
from pdserve.transfer.fake import FakeFabric, FakeTransport
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.disagg import DecodeEngine, DisaggConfig
from pdserve.worker.engine_inbox import Op
from pdserve.worker.kv.peers import PrefillPeers
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.prefill_service import PrefillService
from pdserve.worker.roles import kv_layout
from tests.unit.engine.model_builders import make_checkpoint, prompt
from tests.unit.engine.token_store_runner import CharTokenizer

TPB, WINDOW = 4, 8  # the tiny checkpoints' window
INFO = ModelInfo("tiny", 256, TPB, "sha256-v1", WorkerRole.BOTH, 300, (0,))
PROMPT = prompt(3 * WINDOW, seed=5)  # 6 blocks; from query 24 on, blocks 0..3 are out of the window's reach
# kind -> (layers left behind in each of blocks 0..3, the layers posted of each block sent: None whole blocks)
KINDS = {"mistral": ((0, 1), None), "gemma3": ((0,), ((1,),) * 4 + ((0, 1),) * 2)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: str(make_checkpoint(tmp_path_factory.mktemp(kind), kind).path) for kind in KINDS}


def _threaded(checkpoint: str, kernels: str) -> ThreadedEngine:
    runner = ModelRunner.load(checkpoint, "float32", "cpu", num_blocks=64, tokens_per_block=TPB, kernels=kernels)
    engine = LLMEngine(runner, KvCacheManager(KvCacheConfig(tokens_per_block=TPB), 64), CharTokenizer(),
                       SchedulerConfig(8, 256, 256))
    threaded = ThreadedEngine(engine, INFO, idle_wait_s=0.005)
    threaded.start()
    return threaded


def _request(rid: str, tokens: list[int], max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                           ignore_eos=True))


async def _tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


def _poison_skipped_slices(decode: ThreadedEngine) -> list:
    """Before the engine takes a landed prompt, NaN into the slices the peer left out: stale bytes
    of anything (another request, a failed write) are what a reserved block holds there."""
    complete, seen = decode._operations[Op.COMPLETE_REMOTE], []

    def poisoned(request_id, first_token, logprob, skipped):
        block_ids = decode.engine.kv.block_ids(decode.engine.handoffs.get(request_id).seq_id)
        for skip in skipped:
            decode.engine.runner.kv_tensor[block_ids[skip.block_index], list(skip.layers)] = float("nan")
        seen.extend(skipped)
        return complete(request_id, first_token, logprob, skipped)

    decode._operations[Op.COMPLETE_REMOTE] = poisoned
    return seen


def _run(checkpoint: str, kernels: str, body):
    async def main():
        fabric = FakeFabric()
        p, d = _threaded(checkpoint, kernels), _threaded(checkpoint, kernels)
        tp = FakeTransport(WorkerId("p"), p.engine.runner.kv_tensor, kv_layout("tiny", p.engine.runner), fabric)
        td = FakeTransport(WorkerId("d"), d.engine.runner.kv_tensor, kv_layout("tiny", d.engine.runner), fabric)
        sent, received = TransferMetrics(), TransferMetrics()
        decode = DecodeEngine(d, PrefillPeers(td), DisaggConfig(WorkerId("d"), 1, 5.0, 0.5, False), received)
        server = grpc.aio.server()
        add_kv_transfer_service(server, PrefillService(p, tp, sent))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            return await body(p, d, decode, address, tp, sent, received)
        finally:
            await server.stop(0)
            p.stop()
            d.stop()
            p.engine.kv.check_integrity()
            d.engine.kv.check_integrity()

    return asyncio.run(main())


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_prompt_three_windows_long_leaves_early_window_slices_behind_and_decodes_the_same(
        checkpoints, kind, kernels):
    left, posted_layers = KINDS[kind]

    async def body(p, d, decode, address, tp, sent, received):
        poisoned = _poison_skipped_slices(d)
        remote = await _tokens(decode.generate(_request("r", PROMPT), address))
        local = await _tokens(p.generate(_request("l", PROMPT)))  # aggregated, on the prefill worker
        assert remote == local and len(remote) == 6
        assert [(s.block_index, s.layers) for s in poisoned] == [(b, left) for b in range(4)]
        (posted,) = tp.posted
        assert (len(posted.pairs.local), posted.pairs.layers) == (2 if posted_layers is None else 6, posted_layers)
        bytes_left = 4 * len(left) * tp.spec.bytes_per_layer
        for metrics, direction in ((sent, "sent"), (received, "received")):
            assert metrics.window_skipped_blocks.labels(direction)._value.get() == 4
            assert metrics.window_skipped_bytes.labels(direction)._value.get() == bytes_left
        assert received.bytes.labels("received")._value.get() == 6 * tp.spec.bytes_per_block - bytes_left

    _run(checkpoints[kind], kernels, body)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_decode_worker_never_reuses_a_block_lacking_slices_for_a_query_that_reads_them(checkpoints, kind):
    async def body(p, d, decode, address, tp, sent, received):
        await _tokens(decode.generate(_request("r", PROMPT), address))
        continuing = PROMPT + prompt(5, seed=11)  # computed from 24 on: the whole prompt is reused
        assert await _tokens(d.generate(_request("more", continuing))) == \
            await _tokens(p.generate(_request("ref", continuing)))
        assert d.engine.kv.num_hit_tokens == 24
        diverging = PROMPT[:20] + prompt(7, seed=9)  # shares 5 blocks; computed from 20 on, it would read block 3
        assert await _tokens(d.generate(_request("here", diverging))) == \
            await _tokens(p.generate(_request("ref2", diverging)))
        assert d.engine.kv.num_hit_tokens == 24  # no hit: it computed its prompt whole

    _run(checkpoints[kind], "torch", body)
