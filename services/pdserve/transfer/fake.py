"""An in-process KvTransport for tests of failure paths, with faults a test can inject.

Fake transports of several workers share one `FakeFabric`, which stands for the network:
it finds a peer's tensor by worker id and carries faults. Bytes really move (a transfer
copies whole blocks between the two tensors) on the second `poll` after posting, so a
caller sees PENDING at least once, as with a real backend.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.common.errors import TransferError
from pdserve.common.ids import WorkerId
from pdserve.transfer.base import KvTransportBase, Op
from pdserve.transfer.blocks import BlockPairs
from pdserve.transfer.handshake import PeerMetadata
from pdserve.transfer.interface import Notification, TransferState
from pdserve.transfer.layout import KvLayoutSpec


class Fault(enum.Enum):
    FAIL = "fail"
    """Transfers to the peer are posted, then report failure; no byte moves."""
    STALL = "stall"
    """Transfers to the peer never complete (they fail only by deadline)."""
    LATE = "late"
    """Transfers to the peer report failure, yet their bytes land later, when the test calls
    `FakeFabric.land_late_writes()`: a failed or cancelled transfer is no proof that no byte
    arrives."""


class FakeFabric:
    """The fake network: which workers are reachable, and injected faults per worker."""

    def __init__(self) -> None:
        self._workers: dict[WorkerId, FakeTransport] = {}
        self._faults: dict[WorkerId, Fault] = {}
        self._late: list[tuple[FakeTransport, FakeTransfer]] = []

    def inject(self, worker_id: WorkerId, fault: Fault) -> None:
        """Transfers with `worker_id` misbehave as `fault` says from now on."""
        self._faults[worker_id] = fault

    def late_write_targets(self) -> list[tuple[WorkerId, list[int]]]:
        """(peer, its block ids) of each LATE write still to land."""
        return [(token.peer_id, token.pairs.remote.tolist()) for _, token in self._late if token.op == "WRITE"]

    def land_late_writes(self) -> int:
        """Let every LATE transfer's bytes arrive now; how many transfers landed."""
        late, self._late = self._late, []
        for transport, token in late:
            peer = self.find(token.peer_id)
            if peer is not None:
                transport._complete(token, peer)
        return len(late)

    def heal(self, worker_id: WorkerId) -> None:
        self._faults.pop(worker_id, None)

    def vanish(self, worker_id: WorkerId) -> None:
        """The worker is gone: posting to it raises, transfers in flight with it fail."""
        self._workers.pop(worker_id, None)

    def fault(self, worker_id: WorkerId) -> Fault | None:
        return self._faults.get(worker_id)

    def find(self, worker_id: WorkerId) -> FakeTransport | None:
        return self._workers.get(worker_id)

    def attach(self, transport: FakeTransport) -> None:
        self._workers[transport.worker_id] = transport


@dataclass(slots=True)
class FakeTransfer:
    """A posted fake transfer; `is_released` lets a test see that nothing leaked."""

    op: Op
    peer_id: WorkerId
    pairs: BlockPairs
    notify: bytes
    fault: Fault | None
    is_done: bool = False
    is_released: bool = False
    polls: int = 0


class FakeTransport(KvTransportBase[FakeTransfer]):
    """A worker's transport on a FakeFabric; same contract as NixlTransport."""

    def __init__(self, worker_id: WorkerId, kv: torch.Tensor, spec: KvLayoutSpec, fabric: FakeFabric,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(worker_id, kv, spec, clock)
        self.fabric = fabric
        self.posted: list[FakeTransfer] = []
        self._inbox: list[Notification] = []
        self._rows = kv.view(self.num_blocks, -1).view(torch.uint8)  # (N, bytes_per_block)
        fabric.attach(self)

    def _transport_blob(self) -> bytes:
        return b"fake:" + self.worker_id.encode()

    def _connect(self, peer: PeerMetadata) -> None:
        if self.fabric.find(peer.worker_id) is None:
            raise TransferError(f"peer {peer.worker_id!r} is unreachable")

    def _disconnect(self, peer_id: WorkerId) -> None:
        """Nothing is held per peer."""

    def _post(self, op: Op, peer_id: WorkerId, pairs: BlockPairs, notify: bytes) -> FakeTransfer:
        if self.fabric.find(peer_id) is None:
            raise TransferError(f"peer {peer_id!r} disconnected")
        transfer = FakeTransfer(op, peer_id, pairs, notify, self.fabric.fault(peer_id))
        self.posted.append(transfer)
        return transfer

    def _status(self, token: FakeTransfer) -> TransferState:
        token.polls += 1
        if token.is_done:
            return TransferState.DONE
        peer = self.fabric.find(token.peer_id)
        if peer is None:
            raise TransferError(f"peer {token.peer_id!r} vanished mid-transfer")
        if token.fault is Fault.LATE and token.polls == 1:
            self.fabric._late.append((self, token))
        if token.fault in (Fault.FAIL, Fault.LATE):
            raise TransferError(f"injected failure on transfer with {token.peer_id!r}")
        if token.fault is Fault.STALL or token.polls == 1:
            return TransferState.PENDING
        self._complete(token, peer)
        return TransferState.DONE

    def _complete(self, token: FakeTransfer, peer: FakeTransport) -> None:
        local, remote = token.pairs.local.tolist(), token.pairs.remote.tolist()
        if token.pairs.layers is not None:
            self._copy_layers(token, peer)
        elif token.op == "WRITE":
            peer._rows[remote] = self._rows[local]
        else:
            self._rows[local] = peer._rows[remote]
        if token.notify:
            peer._inbox.append(Notification(self.worker_id, token.notify))
        token.is_done = True

    def _copy_layers(self, token: FakeTransfer, peer: FakeTransport) -> None:
        per_layer = self.spec.bytes_per_layer
        for local, remote, first, count in token.pairs.layer_runs().tolist():
            span = slice(first * per_layer, (first + count) * per_layer)
            if token.op == "WRITE":
                peer._rows[remote, span] = self._rows[local, span]
            else:
                self._rows[local, span] = peer._rows[remote, span]

    def _release(self, token: FakeTransfer) -> None:
        token.is_released = True

    def _drain(self) -> list[Notification]:
        inbox, self._inbox = self._inbox, []
        return inbox

    def _shutdown(self) -> None:
        self.fabric.vanish(self.worker_id)
