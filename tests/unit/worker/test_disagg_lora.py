"""LoRA adapters in disaggregated serving, in one process: LoRA-enabled engines on a tiny
checkpoint, the real KvTransfer gRPC service, the fake transport. A prompt under an adapter
both workers hold is prefilled remotely with the adapter's tokens; one under an adapter the
prefill worker lacks is prefilled locally (`lora_mismatch`), never with another model's KV; an
adapter both load after the handshake is prefilled remotely once the decode worker re-handshakes."""
import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.disagg import PrefillOrder
from pdserve.common.errors import IncompatiblePeerError
from pdserve.common.ids import BlockId, RequestId, WorkerId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.model.lora import LoraSettings
from pdserve.engine.model.runner import ModelRunner
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from pdserve.rpc.kv_transfer_service import add_kv_transfer_service
from pdserve.transfer.fake import FakeFabric, FakeTransport
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.disagg import DecodeEngine, DisaggConfig
from pdserve.worker.kv.peers import PrefillPeers
from pdserve.worker.kv.write_grants import new_nonce
from pdserve.worker.lora_registry import LoraRegistry
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.prefill_service import PrefillService
from tests.lora_builders import greedy, make_adapter
from tests.unit.engine.token_store_runner import CharTokenizer

TPB = 4
INFO = ModelInfo("tiny", 128, TPB, "sha256-v1", WorkerRole.BOTH, 300, (0,), lora_enabled=True, max_loras=2)
PROMPT = tuple((i * 37) % 290 + 5 for i in range(23))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         initializer_range=0.1)).eval()
    model.save_pretrained(path)
    adapters = {name: make_adapter(model, path / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    expected = {name: greedy(peft, list(PROMPT), 6) for name, peft in adapters.items()}
    assert expected["a"] != expected["b"]
    return str(path), expected


def _threaded(checkpoint: str) -> ThreadedEngine:
    runner = ModelRunner.load(checkpoint, "float32", "cpu", num_blocks=64, tokens_per_block=TPB,
                              lora=LoraSettings(max_loras=2, max_lora_rank=8))
    engine = LLMEngine(runner, KvCacheManager(KvCacheConfig(tokens_per_block=TPB), 64), CharTokenizer(),
                       SchedulerConfig(8, 256, 128))
    threaded = ThreadedEngine(engine, INFO, idle_wait_s=0.005)
    threaded.start()
    return threaded


def _request(rid: str, lora_id: int) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                             lora_id=lora_id)


def _run(family, body):
    checkpoint, expected = family

    async def main():
        p, d = _threaded(checkpoint), _threaded(checkpoint)
        p_loras, d_loras = LoraRegistry(p, (str(checkpoint),)), LoraRegistry(d, (str(checkpoint),))
        fabric = FakeFabric()
        tp = FakeTransport(WorkerId("p"), p.engine.runner.kv_tensor,
                           KvLayoutSpec.for_tensor("tiny", p.engine.runner.kv_tensor), fabric)
        td = FakeTransport(WorkerId("d"), d.engine.runner.kv_tensor,
                           KvLayoutSpec.for_tensor("tiny", d.engine.runner.kv_tensor), fabric)
        metrics, peers = TransferMetrics(), PrefillPeers(td, lora_ids=d_loras.lora_ids)
        decode = DecodeEngine(d, peers, DisaggConfig(WorkerId("d"), 1, 5.0, 0.5, True), metrics)
        server = grpc.aio.server()
        add_kv_transfer_service(server, PrefillService(p, tp, TransferMetrics(), lora_ids=p_loras.lora_ids))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            await body(SimpleNamespace(decode=decode, peers=peers, address=address, p_loras=p_loras, d_loras=d_loras,
                                       metrics=metrics, expected=expected, folder=checkpoint))
        finally:
            await server.stop(0)
            p.stop()
            d.stop()
            p.engine.kv.check_integrity()
            d.engine.kv.check_integrity()

    asyncio.run(main())


async def _tokens(decode: DecodeEngine, request: GenerationRequest, address: str) -> tuple[list[int], str]:
    outputs = [o async for o in decode.generate(request, address)]
    return [t for o in outputs for t in o.token_ids], outputs[0].prefilled_by


def test_an_adapter_both_workers_hold_is_prefilled_remotely_with_its_tokens(family):
    async def body(w):
        a = await w.p_loras.load("a", f"{w.folder}/a")
        await w.d_loras.load("a", f"{w.folder}/a")
        tokens, prefilled_by = await _tokens(w.decode, _request("r", a.lora_id), w.address)
        assert tokens == w.expected["a"] and prefilled_by == w.address

    _run(family, body)


def test_an_adapter_the_prefill_worker_lacks_is_prefilled_locally(family):
    async def body(w):
        await w.p_loras.load("a", f"{w.folder}/a")
        b = await w.d_loras.load("b", f"{w.folder}/b")
        tokens, prefilled_by = await _tokens(w.decode, _request("r", b.lora_id), w.address)
        assert tokens == w.expected["b"] and prefilled_by == "local"
        assert w.metrics.local_prefills.labels("lora_mismatch")._value.get() == 1

    _run(family, body)


def test_an_adapter_loaded_after_the_handshake_is_prefilled_remotely(family):
    async def body(w):
        a = await w.p_loras.load("a", f"{w.folder}/a")
        await w.d_loras.load("a", f"{w.folder}/a")
        assert (await _tokens(w.decode, _request("first", a.lora_id), w.address))[1] == w.address  # handshake
        b = await w.p_loras.load("b", f"{w.folder}/b")
        await w.d_loras.load("b", f"{w.folder}/b")
        tokens, prefilled_by = await _tokens(w.decode, _request("r", b.lora_id), w.address)
        assert tokens == w.expected["b"] and prefilled_by == w.address
        assert w.metrics.local_prefills.labels("lora_mismatch")._value.get() == 0

    _run(family, body)


def test_a_prefill_order_under_an_adapter_the_worker_lacks_is_refused(family):
    async def body(w):
        b = await w.d_loras.load("b", f"{w.folder}/b")
        order = PrefillOrder(_request("r", b.lora_id), WorkerId("d"), 0, tuple(BlockId(i) for i in range(6)),
                             time.time() + 5.0, nonce=new_nonce())
        peer = await w.peers.get(w.address)  # a handshake, so the order is not refused as from a stranger
        with pytest.raises(IncompatiblePeerError, match="not loaded on this prefill worker"):
            await peer.prefill(order, 5.0)

    _run(family, body)
