"""Bookkeeping every KV transport shares: peers, handshake checks, block-id validation,
transfer records and deadlines. A concrete transport supplies only the byte-moving hooks.

All state is guarded by one lock, and every hook is called with it held, so a backend that
is not thread-safe itself (a NIXL agent without a listener thread) is safe behind it.
"""
from __future__ import annotations

import math
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from pdserve.common.errors import ConfigError, IncompatiblePeerError, InvalidRequestError, TransferError
from pdserve.common.ids import BlockId, WorkerId
from pdserve.transfer.blocks import BlockPairs, pair_block_ids
from pdserve.transfer.handshake import PeerMetadata
from pdserve.transfer.interface import KvTransport, Notification, TransferHandle, TransferState
from pdserve.transfer.layout import KvLayoutSpec, check_compatible, dtype_name

if TYPE_CHECKING:
    import torch

Op = Literal["WRITE", "READ"]
Token = TypeVar("Token")
"""What a backend returns for a posted transfer (a NIXL transfer handle, a fake record)."""

_SPIN_S = 2e-3
_MAX_POLL_SLEEP_S = 2e-4


@dataclass(slots=True)
class _Transfer(Generic[Token]):
    handle: TransferHandle
    token: Token | None
    state: TransferState = TransferState.PENDING
    reason: str = ""


class KvTransportBase(KvTransport, Generic[Token]):
    """Shared half of a transport over one block-major KV tensor `(N, L, 2, tpb, kvh, hd)`.

    `kv` is the engine's tensor, registered as is: the transport reads and writes it in place.
    """

    def __init__(self, worker_id: WorkerId, kv: torch.Tensor, spec: KvLayoutSpec,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_kv_tensor(kv, spec)
        self.worker_id = worker_id
        self.spec = spec
        self.num_blocks = kv.shape[0]
        self.kv = kv
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[WorkerId, PeerMetadata] = {}
        self._transfers: dict[int, _Transfer[Token]] = {}
        self._next_transfer_id = 0
        self._is_closed = False

    # ---- hooks a backend implements (called with the lock held) -----------------------------

    @abstractmethod
    def _transport_blob(self) -> bytes:
        """Backend connection info for peers (e.g. NIXL agent metadata)."""

    @abstractmethod
    def _connect(self, peer: PeerMetadata) -> None:
        """Make `peer` reachable; raise TransferError or IncompatiblePeerError if it is not."""

    @abstractmethod
    def _disconnect(self, peer_id: WorkerId) -> None:
        """Undo `_connect`."""

    @abstractmethod
    def _post(self, op: Op, peer_id: WorkerId, pairs: BlockPairs, notify: bytes) -> Token:
        """Start moving `pairs.local[i]` <-> `pairs.remote[i]` (only `pairs.layers[i]` of them
        when set); raise TransferError if it cannot."""

    @abstractmethod
    def _status(self, token: Token) -> TransferState:
        """Where a posted transfer stands; raise TransferError (saying why) when it failed."""

    @abstractmethod
    def _release(self, token: Token) -> None:
        """Free a transfer, cancelling it if in flight; raise TransferError if it cannot."""

    @abstractmethod
    def _drain(self) -> list[Notification]:
        """Notifications that arrived since the last call."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release what the backend holds for the local tensor."""

    # ---- KvTransport ------------------------------------------------------------------------

    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            blob = self._transport_blob()
        return PeerMetadata(self.worker_id, self.spec, self.num_blocks, self.kv.data_ptr(),
                            PeerMetadata.mem_type_of(self.kv), self.kv.device.index or 0, blob).encode()

    def add_peer(self, peer_id: WorkerId, metadata: bytes) -> None:
        peer = PeerMetadata.decode(metadata)
        if peer.worker_id != peer_id:
            raise IncompatiblePeerError(f"metadata for peer {peer_id!r} names worker {peer.worker_id!r}")
        if peer_id == self.worker_id:
            raise IncompatiblePeerError(f"peer {peer_id!r} is this worker itself")
        check_compatible(self.spec, peer.spec, peer=f"peer {peer_id!r}")
        with self._lock:
            self._check_open()
            if self._peers.get(peer_id) == peer:
                return
            if peer_id in self._peers:
                self._forget_peer(peer_id, reason=f"peer {peer_id!r} re-registered")
            self._connect(peer)
            self._peers[peer_id] = peer

    def has_peer(self, peer_id: WorkerId) -> bool:
        with self._lock:
            return peer_id in self._peers

    def remove_peer(self, peer_id: WorkerId) -> None:
        with self._lock:
            if peer_id in self._peers:
                self._forget_peer(peer_id, reason=f"peer {peer_id!r} was removed")

    def write_blocks(self, peer_id: WorkerId, local_block_ids: Sequence[BlockId],
                     remote_block_ids: Sequence[BlockId], notify: bytes, timeout_s: float,
                     layers: Sequence[Sequence[int]] | None = None) -> TransferHandle:
        return self._start("WRITE", peer_id, local_block_ids, remote_block_ids, notify, timeout_s, layers)

    def read_blocks(self, peer_id: WorkerId, remote_block_ids: Sequence[BlockId],
                    local_block_ids: Sequence[BlockId], notify: bytes, timeout_s: float,
                    layers: Sequence[Sequence[int]] | None = None) -> TransferHandle:
        return self._start("READ", peer_id, local_block_ids, remote_block_ids, notify, timeout_s, layers)

    def poll(self, handle: TransferHandle) -> TransferState:
        with self._lock:
            return self._refresh(self._record(handle)).state

    def wait(self, handle: TransferHandle) -> None:
        """Polls back to back for `_SPIN_S` (polling is what makes progress), then sleeps
        between polls, backing off to `_MAX_POLL_SLEEP_S`."""
        spin_until, sleep_s = time.perf_counter() + _SPIN_S, 0.0
        while (state := self.poll(handle)) is TransferState.PENDING:
            if time.perf_counter() < spin_until:
                continue
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s + 1e-6, _MAX_POLL_SLEEP_S)
        if state is TransferState.FAILED:
            with self._lock:
                reason = self._record(handle).reason
            raise TransferError(f"transfer {handle.transfer_id} to {handle.peer_id!r} failed: {reason}")

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            record = self._record(handle)
            if record.token is not None:
                self._release(record.token)
                record.token = None
            del self._transfers[handle.transfer_id]

    def drain_notifications(self) -> list[Notification]:
        with self._lock:
            self._check_open()
            return self._drain()

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            for peer_id in list(self._peers):
                self._forget_peer(peer_id, reason="transport closed")
            for record in self._transfers.values():
                if record.token is not None:
                    self._cancel(record)
            self._transfers.clear()
            self._shutdown()
            self._is_closed = True

    # ---- internals --------------------------------------------------------------------------

    def _start(self, op: Op, peer_id: WorkerId, local_block_ids: Sequence[BlockId],
               remote_block_ids: Sequence[BlockId], notify: bytes, timeout_s: float,
               layers: Sequence[Sequence[int]] | None) -> TransferHandle:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s < math.inf:
            raise InvalidRequestError(f"timeout_s={timeout_s!r}: must be a positive, finite number of "
                                      "seconds", param="timeout_s")
        if not isinstance(notify, bytes):
            raise InvalidRequestError(f"notify={notify!r}: must be bytes", param="notify")
        deadline = self._clock() + timeout_s  # counted from the call, not from taking the lock
        with self._lock:
            self._check_open()
            if self._clock() >= deadline:
                raise TransferError(f"{op} to {peer_id!r} not posted: its {timeout_s:g} s passed waiting for the "
                                    "transport")
            peer = self._peers.get(peer_id)
            if peer is None:
                raise TransferError(f"unknown peer {peer_id!r}: add_peer first")
            pairs = pair_block_ids(op, local_block_ids, remote_block_ids, self.num_blocks, peer.num_blocks,
                                   layers, self.spec.num_layers)
            token = self._post(op, peer_id, pairs, notify)
            handle = TransferHandle(self._next_transfer_id, peer_id, len(pairs.local), deadline)
            self._transfers[handle.transfer_id] = _Transfer(handle, token)
            self._next_transfer_id += 1
            return handle

    def _refresh(self, record: _Transfer[Token]) -> _Transfer[Token]:
        """Bring a PENDING record up to date, failing it once its deadline has passed."""
        if record.state is not TransferState.PENDING or record.token is None:
            return record
        try:
            record.state = self._status(record.token)
        except TransferError as error:
            record.state, record.reason = TransferState.FAILED, str(error)
            return record
        if record.state is TransferState.PENDING and self._clock() >= record.handle.deadline:
            record.state, record.reason = TransferState.FAILED, "timed out"
            self._cancel(record)
        return record

    def _cancel(self, record: _Transfer[Token]) -> None:
        """Best effort now; a token that cannot be released yet is retried by `release`."""
        try:
            self._release(record.token)
            record.token = None
        except TransferError as error:
            record.reason += f" (cancel failed: {error})"

    def _forget_peer(self, peer_id: WorkerId, reason: str) -> None:
        for record in self._transfers.values():
            if record.handle.peer_id == peer_id and record.state is TransferState.PENDING:
                record.state, record.reason = TransferState.FAILED, reason
                self._cancel(record)
        del self._peers[peer_id]
        self._disconnect(peer_id)

    def _record(self, handle: TransferHandle) -> _Transfer[Token]:
        record = self._transfers.get(handle.transfer_id)
        if record is None or record.handle != handle:
            raise TransferError(f"transfer {handle.transfer_id} is not held (released already?)")
        return record

    def _check_open(self) -> None:
        if self._is_closed:
            raise TransferError(f"transport of worker {self.worker_id!r} is closed")


def check_kv_tensor(kv: torch.Tensor, spec: KvLayoutSpec) -> None:
    """The tensor must be contiguous `(N, *spec.block_shape)` with N >= 1 of `spec.dtype`."""
    if kv.dim() != 6 or tuple(kv.shape[1:]) != spec.block_shape or kv.shape[0] < 1:
        raise ConfigError("kv_tensor.shape", tuple(kv.shape), f"expected (N, *{spec.block_shape})")
    if dtype_name(kv) != spec.dtype:
        raise ConfigError("kv_tensor.dtype", dtype_name(kv), f"spec says {spec.dtype}")
    if not kv.is_contiguous():
        raise ConfigError("kv_tensor", "non-contiguous", "must be contiguous (one region per block)")
