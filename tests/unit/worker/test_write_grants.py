"""Write grants: a prefill order writes only where the decode worker that reserved the blocks
says, and a worker of another deployment is no peer. Real engines and the real KvTransfer
service over gRPC (the fake transport between them), as in test_disagg_failures.py."""
import asyncio
import dataclasses
import time

import grpc
import pytest

from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.errors import PermissionDeniedError
from pdserve.common.ids import BlockId, RequestId, WorkerId
from pdserve.common.request import GenerationRequest, MultimodalSpan, SamplingParams
from pdserve.rpc.kv_transfer_client import KvTransferClient
from pdserve.rpc.kv_transfer_service import add_kv_transfer_service
from pdserve.worker.kv.peers import PrefillPeers
from pdserve.worker.kv.write_grants import grant_of, granted, is_granted, new_nonce, new_order_key
from tests.unit.worker.test_disagg_failures import _collect, _request, _run, _until, checkpoint  # noqa: F401

KEY = new_order_key()
ORDER = PrefillOrder(GenerationRequest(RequestId("r"), (1, 2, 3), SamplingParams(max_tokens=1)),
                     WorkerId("decode-0"), 1, (BlockId(7), BlockId(9)), 2e9, 1.9e9, b"n" * 16)


@pytest.mark.parametrize("change", [
    {"decode_worker_id": WorkerId("decode-1")}, {"first_block": 0}, {"dest_block_ids": (BlockId(7), BlockId(8))},
    {"deadline": 2e9 + 1}, {"start_by": 1.9e9 + 1}, {"nonce": b"m" * 16}, {"request": dataclasses.replace(ORDER.request, request_id=RequestId("s"))},
    {"request": dataclasses.replace(ORDER.request, prompt_token_ids=(1, 2, 4))},
    {"request": dataclasses.replace(ORDER.request, cache_salt="another tenant")},
    {"request": dataclasses.replace(ORDER.request, lora_id=7)},
    {"request": dataclasses.replace(ORDER.request, multimodal=(MultimodalSpan(b"\x01" * 32, 0, 2),))},
])
def test_a_grant_covers_the_request_the_worker_the_blocks_the_times_and_the_nonce(change: dict) -> None:
    order = granted(KEY, ORDER)
    assert is_granted(KEY, order)
    assert not is_granted(KEY, dataclasses.replace(order, **change))
    assert not is_granted(new_order_key(), order) and not is_granted(None, order)
    assert grant_of(KEY, ORDER) == order.grant and len(order.grant) == 32


def test_an_order_without_a_valid_grant_computes_and_writes_nothing(checkpoint):
    async def body(pair, address):
        await _collect(pair.decode.generate(_request("a"), address))  # the decode worker's handshake
        assert await _until(lambda: pair.used() == (0, 0))
        cached, writes = len(pair.p.engine.kv.pool.cached), len(pair.tp.posted)
        prompt = tuple(range(7, 40))
        forged = PrefillOrder(GenerationRequest(RequestId("forged"), prompt, SamplingParams(max_tokens=1)),
                              WorkerId("d"), 0, tuple(BlockId(b) for b in range(9)), time.time() + 5.0,
                              nonce=new_nonce())
        client = KvTransferClient(address)
        try:
            for order in (forged, granted(new_order_key(), forged)):  # no grant; a grant under another key
                with pytest.raises(PermissionDeniedError, match="carries no valid write grant of 'd'"):
                    await client.prefill(order, 5.0)
        finally:
            await client.close()
        assert (len(pair.p.engine.kv.pool.cached), len(pair.tp.posted)) == (cached, writes)
        assert pair.used() == (0, 0)
        assert pair.metrics.failures.labels("received")._value.get() == 0

    _run(checkpoint, body)


def test_a_decode_worker_of_another_deployment_is_refused_at_the_handshake(checkpoint):
    async def body(pair, address):
        peers = PrefillPeers(pair.td, deployment_id="shop-b")
        with pytest.raises(PermissionDeniedError, match="belongs to deployment 'shop-b', not ''"):
            await peers.get(address)
        assert not pair.tp.has_peer(WorkerId("d"))
        await peers.close()

    _run(checkpoint, body)


class OtherDeployment:
    """A prefill worker that accepts anyone but belongs to deployment shop-b."""

    async def handshake(self, hello: Hello) -> Hello:
        return Hello(WorkerId("p"), b"meta", "shop-b")

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        raise AssertionError("never ordered")


def test_a_decode_worker_does_not_handshake_with_a_prefill_worker_of_another_deployment(checkpoint):
    async def body(pair, address):
        server = grpc.aio.server()
        add_kv_transfer_service(server, OtherDeployment())
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        peers = PrefillPeers(pair.td, deployment_id="shop-a")
        try:
            with pytest.raises(PermissionDeniedError, match="belongs to deployment 'shop-b', not 'shop-a'"):
                await peers.get(f"127.0.0.1:{port}")
            assert not pair.td.has_peer(WorkerId("p"))
        finally:
            await peers.close()
            await server.stop(0)

    _run(checkpoint, body)


def test_a_replayed_order_is_refused_and_writes_nothing(checkpoint):
    async def body(pair, address):
        await _collect(pair.decode.generate(_request("a"), address))  # the decode worker's handshake
        assert await _until(lambda: pair.used() == (0, 0))
        peer = await pair.decode._peers.get(address)
        order = PrefillOrder(GenerationRequest(RequestId("once"), tuple(range(7, 40)), SamplingParams(max_tokens=1)),
                             WorkerId("d"), 0, tuple(BlockId(b) for b in range(9)), time.time() + 5.0,
                             nonce=new_nonce())
        await peer.prefill(order, 5.0)
        assert await _until(lambda: pair.used() == (0, 0))
        writes = len(pair.tp.posted)
        with pytest.raises(PermissionDeniedError, match="was sent before"):
            await peer.prefill(order, 5.0)  # the same order again, grant and all
        assert len(pair.tp.posted) == writes

    _run(checkpoint, body)


def test_an_order_resent_after_a_slow_handshake_keeps_its_deadline_and_lands_nothing_after_the_lease(checkpoint):
    """The prefill worker forgets us (as after its restart); our handshake again takes longer
    than the lease. The resent order carries the deadline it was granted first, so it is
    refused: no byte lands in blocks the lease has already given back. The next request is
    answered right."""
    async def body(pair, address):
        await _collect(pair.decode.generate(_request("a"), address))
        pair.tp.remove_peer(WorkerId("d"))
        connect = pair.decode._peers._connect
        config = pair.decode._config
        lease_s = config.prefill_queue_timeout_s + config.transfer_timeout_s + config.lease_grace_s

        async def slow_connect(at: str, identity: str | None):
            await asyncio.sleep(lease_s + 0.5)
            return await connect(at, identity)

        pair.decode._peers._connect = slow_connect
        writes = len(pair.tp.posted)
        outputs = await _collect(pair.decode.generate(_request("r"), address))
        assert [o.finish_reason for o in outputs] == ["error"]
        assert len(pair.tp.posted) == writes  # nothing written after the lease
        assert await _until(lambda: pair.used() == (0, 0))
        pair.decode._peers._connect = connect
        answer = await _collect(pair.decode.generate(_request("next"), address))
        local = await _collect(pair.d.generate(_request("local")))
        assert [o.token_ids for o in answer] == [o.token_ids for o in local] and answer[0].prefilled_by == address

    _run(checkpoint, body, transfer_timeout_s=0.5)
