"""Two real processes move KV blocks of real torch tensors over NIXL/UCX on loopback.

This process plays prefill; `nixl_peer.serve` in a spawned process plays decode (and hosts
a second transport with a mismatched layout). Every wait is bounded.
"""
from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection

import pytest
import torch

from nixl_peer import DECODE, ODD, SPEC, peer_kv, serve
from pdserve.common.errors import IncompatiblePeerError, TransferError
from pdserve.common.ids import BlockId, WorkerId
from pdserve.transfer.handshake import PeerMetadata
from pdserve.transfer.interface import TransferState
from pdserve.transfer.nixl_transport import NixlTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
PREFILL = WorkerId("prefill")
REPLY_TIMEOUT_S = 20.0
TRANSFER_TIMEOUT_S = 10.0


class Peer:
    """The decode process and its pipe; every receive is bounded."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.notifications: list[tuple[str, bytes]] = []
        if not conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer sent no metadata within {REPLY_TIMEOUT_S} s")
        self.decode_metadata, self.odd_metadata = conn.recv()

    def recv(self, kind: str) -> tuple:
        """The next message of `kind`, collecting notifications that arrive before it."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while self.conn.poll(max(0.0, deadline - time.monotonic())):
            message = self.conn.recv()
            if message[0] == "notification":
                self.notifications.append(message[1:])
            if message[0] == kind:
                return message
        raise TimeoutError(f"peer sent no {kind!r} within {REPLY_TIMEOUT_S} s")

    def snapshot(self) -> torch.Tensor:
        self.conn.send(("snapshot",))
        return self.recv("snapshot")[1]


def start_peer() -> Iterator[Peer]:
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(target=serve, args=(child_conn,), daemon=True)
    process.start()
    try:
        yield Peer(process, conn)
    finally:
        stop(process, conn)


@pytest.fixture(scope="module")
def shared_peer() -> Iterator[Peer]:
    """One decode process for the tests that leave it alive; each reads its state first."""
    yield from start_peer()


@pytest.fixture
def peer(shared_peer: Peer) -> Peer:
    shared_peer.notifications.clear()
    return shared_peer


@pytest.fixture
def doomed_peer() -> Iterator[Peer]:
    """A decode process of its own, for a test that kills it."""
    yield from start_peer()


def stop(process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
    if process.is_alive():
        conn.send(("exit",))
        process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join(timeout=10)


@pytest.fixture
def prefill_kv() -> torch.Tensor:
    return peer_kv(SPEC, seed=7)


@pytest.fixture
def prefill(prefill_kv: torch.Tensor) -> Iterator[NixlTransport]:
    with NixlTransport(PREFILL, prefill_kv, SPEC) as transport:
        yield transport


def blocks(ids: list[int]) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def test_written_blocks_land_byte_for_byte_and_others_stay(peer: Peer, prefill: NixlTransport) -> None:
    prefill.add_peer(DECODE, peer.decode_metadata)
    source, expected = peer_kv(SPEC, seed=7), peer.snapshot()

    first_local, first_remote = [3, 0, 7], [9, 2, 14]
    handle = prefill.write_blocks(DECODE, blocks(first_local), blocks(first_remote), b"", TRANSFER_TIMEOUT_S)
    prefill.wait(handle)
    assert prefill.poll(handle) is TransferState.DONE
    prefill.release(handle)
    expected[first_remote] = source[first_local]
    assert peer.snapshot().view(torch.uint8).equal(expected.view(torch.uint8))  # DONE means landed

    second_local, second_remote = [12, 13], [5, 6]
    handle = prefill.write_blocks(DECODE, blocks(second_local), blocks(second_remote), b"req-1",
                                  TRANSFER_TIMEOUT_S)
    prefill.wait(handle)
    prefill.release(handle)
    peer.recv("notification")
    expected[second_remote] = source[second_local]
    assert peer.snapshot().view(torch.uint8).equal(expected.view(torch.uint8))
    assert peer.notifications == [("prefill", b"req-1")]


def test_a_write_of_some_layers_lands_their_bytes_only(peer: Peer, prefill: NixlTransport) -> None:
    """A block out of every window layer's reach travels with its global layers' K and V only."""
    prefill.add_peer(DECODE, peer.decode_metadata)
    source, expected = peer_kv(SPEC, seed=7), peer.snapshot()
    handle = prefill.write_blocks(DECODE, blocks([4, 1, 2]), blocks([10, 11, 3]), b"", TRANSFER_TIMEOUT_S,
                                  layers=[[1], [0], [0, 1]])
    prefill.wait(handle)
    prefill.release(handle)
    expected[10, 1] = source[4, 1]  # (L, 2, tpb, kvh, hd) per block: one layer's K and V
    expected[11, 0] = source[1, 0]
    expected[3] = source[2]
    assert peer.snapshot().view(torch.uint8).equal(expected.view(torch.uint8))


def test_read_blocks_copies_the_peers_blocks(peer: Peer, prefill: NixlTransport,
                                             prefill_kv: torch.Tensor) -> None:
    prefill.add_peer(DECODE, peer.decode_metadata)
    original = peer.snapshot()
    handle = prefill.read_blocks(DECODE, blocks([15, 1]), blocks([4, 11]), b"", TRANSFER_TIMEOUT_S)
    prefill.wait(handle)
    prefill.release(handle)

    expected = peer_kv(SPEC, seed=7)
    expected[[4, 11]] = original[[15, 1]]
    assert prefill_kv.view(torch.uint8).equal(expected.view(torch.uint8))
    assert peer.snapshot().view(torch.uint8).equal(original.view(torch.uint8))


def test_mismatched_layout_is_refused_naming_every_field(peer: Peer, prefill: NixlTransport) -> None:
    with pytest.raises(IncompatiblePeerError) as raised:
        prefill.add_peer(ODD, peer.odd_metadata)
    assert str(raised.value) == (
        "peer 'odd' has an incompatible KV layout; "
        "dtype: local='bfloat16' remote='float16'; "
        "tokens_per_block: local=4 remote=8; "
        "bytes_per_block: local=512 remote=1024")
    with pytest.raises(TransferError, match="unknown peer 'odd'"):
        prefill.write_blocks(ODD, blocks([0]), blocks([0]), b"", TRANSFER_TIMEOUT_S)


def test_metadata_whose_nixl_agent_is_another_worker_is_refused(peer: Peer, prefill: NixlTransport) -> None:
    forged = replace(PeerMetadata.decode(peer.decode_metadata), worker_id=WorkerId("decode-2")).encode()
    with pytest.raises(IncompatiblePeerError) as raised:
        prefill.add_peer(WorkerId("decode-2"), forged)
    assert str(raised.value) == "peer 'decode-2' sent NIXL metadata of agent 'decode'"
    prefill.add_peer(DECODE, peer.decode_metadata)
    handle = prefill.write_blocks(DECODE, blocks([0]), blocks([0]), b"", TRANSFER_TIMEOUT_S)
    prefill.wait(handle)
    prefill.release(handle)


def test_a_vanished_peer_fails_transfers_within_their_timeout_and_cannot_be_re_added(
        doomed_peer: Peer, prefill: NixlTransport) -> None:
    peer = doomed_peer
    prefill.add_peer(DECODE, peer.decode_metadata)
    peer.conn.send(("die",))
    peer.process.join(timeout=REPLY_TIMEOUT_S)
    assert peer.process.exitcode == 0

    with pytest.raises(TransferError, match="'decode'"):
        handle = prefill.write_blocks(DECODE, blocks([1, 2]), blocks([1, 2]), b"req-2", timeout_s=2.0)
        prefill.wait(handle)
    prefill.remove_peer(DECODE)
    with pytest.raises(TransferError, match="^NIXL failed to add peer 'decode'"):
        prefill.add_peer(DECODE, peer.decode_metadata)  # stale metadata: nobody listens there
    with pytest.raises(TransferError, match="unknown peer 'decode'"):
        prefill.write_blocks(DECODE, blocks([1]), blocks([1]), b"", timeout_s=2.0)

