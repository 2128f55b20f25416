"""The far side of test_nixl_transfer: a process holding NixlTransports, driven over a Pipe.

It hosts two transports: `decode`, whose layout matches the test's, and `odd`, whose layout
does not. Both KV tensors start as `peer_kv(...)` so the test knows every original byte.
The loop drains notifications every few milliseconds (without NIXL's progress thread that is
what lets a peer's connection and writes complete) and forwards them to the test.
"""
from __future__ import annotations

import os
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from pdserve.common.ids import WorkerId
from pdserve.transfer.layout import KvLayoutSpec

SPEC = KvLayoutSpec("test-model", "bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4)
ODD_SPEC = replace(SPEC, dtype="float16", tokens_per_block=8)
NUM_BLOCKS = 16
DECODE, ODD = WorkerId("decode"), WorkerId("odd")


def peer_kv(spec: KvLayoutSpec, seed: int) -> torch.Tensor:
    """A (NUM_BLOCKS, L, 2, tpb, kvh, hd) tensor of seeded random values."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(NUM_BLOCKS, *spec.block_shape, generator=generator)
    return values.to(getattr(torch, spec.dtype))


def serve(conn: Connection) -> None:
    """Commands: ("add_peer", id, metadata), ("snapshot",), ("die",), ("exit",)."""
    from pdserve.transfer.nixl_transport import NixlTransport

    kv = peer_kv(SPEC, seed=1)
    decode = NixlTransport(DECODE, kv, SPEC)
    odd = NixlTransport(ODD, peer_kv(ODD_SPEC, seed=2), ODD_SPEC)
    conn.send((decode.local_metadata(), odd.local_metadata()))
    while True:
        for note in decode.drain_notifications():
            conn.send(("notification", note.peer_id, note.payload))
        if not conn.poll(0.005):
            continue
        command, *args = conn.recv()
        if command == "add_peer":
            decode.add_peer(*args)
            conn.send(("added",))
        elif command == "snapshot":
            conn.send(("snapshot", kv.clone()))
        elif command == "die":
            os._exit(0)
        elif command == "exit":
            break
    decode.close()
    odd.close()
