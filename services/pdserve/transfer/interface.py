"""The KV transport a worker uses to move KV blocks to and from its peers.

Protocol (push; see docs/transfer.md for why):

1. At start each worker builds a transport over its one KV tensor and sends
   `local_metadata()` to its peers over gRPC; each side calls `add_peer` with what it received.
   A peer whose KV layout differs is refused there (IncompatiblePeerError), before any byte moves.
2. The decode worker reserves blocks for a prompt and names them in its gRPC call to the
   prefill worker.
3. The prefill worker computes the prompt, then `write_blocks(decode, its_blocks,
   reserved_blocks, notify, timeout_s)`, polls the handle from its loop until DONE or FAILED,
   `release`s it, and replies over gRPC. DONE means every byte is in the decode worker's memory.
4. The decode worker learns of completion from that reply, or earlier from
   `Notification(prefill, notify)` in `drain_notifications()` when `notify` is not empty (a
   notification is sent only after all of its transfer's bytes have landed).

Ownership: every block has one owner at all times. The initiator owns its source (write) or
destination (read) blocks until `release(handle)` returns; the target owns the other side
throughout and must not reuse those blocks before the notification, the gRPC reply, or its
own lease expiry.

Progress: both workers call `drain_notifications()` every loop iteration, idle or not; a
transport may make progress only inside its calls, and a peer's transfers towards us complete
only while we make progress.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.ids import BlockId, WorkerId


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """Names one posted transfer. `deadline` is on the transport's clock (time.monotonic)."""

    transfer_id: int
    peer_id: WorkerId
    num_blocks: int
    deadline: float


@dataclass(frozen=True, slots=True)
class Notification:
    """A message a peer attached to a transfer that has fully landed in our KV tensor."""

    peer_id: WorkerId
    payload: bytes


class KvTransport(ABC):
    """Moves whole KV blocks between this worker's KV tensor and its peers'.

    Thread-safe: every method may be called from any thread. Block ids index the first
    dimension of a worker's KV tensor. Bad arguments raise a typed error and change nothing.
    """

    @abstractmethod
    def local_metadata(self) -> bytes:
        """What peers need to reach us: our layout spec, block addresses, connection info."""

    @abstractmethod
    def add_peer(self, peer_id: WorkerId, metadata: bytes) -> None:
        """Accept a peer's `local_metadata()`. Idempotent for identical metadata; different
        metadata for a known peer (it restarted) replaces the old, failing its transfers.

        Raises IncompatiblePeerError, naming every mismatching field, when the peer's layout
        differs from ours or the metadata is malformed or names another worker; TransferError
        when the peer cannot be reached. Either way no peer is added.
        """

    @abstractmethod
    def has_peer(self, peer_id: WorkerId) -> bool:
        """Whether `peer_id` was added (and not removed since)."""

    @abstractmethod
    def remove_peer(self, peer_id: WorkerId) -> None:
        """Forget a peer (unknown ids are ignored). Its pending transfers become FAILED."""

    @abstractmethod
    def write_blocks(self, peer_id: WorkerId, local_block_ids: Sequence[BlockId],
                     remote_block_ids: Sequence[BlockId], notify: bytes, timeout_s: float,
                     layers: Sequence[Sequence[int]] | None = None) -> TransferHandle:
        """Copy local block `local_block_ids[i]` into the peer's block `remote_block_ids[i]`:
        only the K and V of layers `layers[i]` (ascending) when given, the whole block otherwise;
        the destination's other bytes are left as they are.

        `notify` (may be empty: none) reaches the peer once every byte has landed. The transfer
        FAILS if not done within `timeout_s` of this call (and is not posted at all once that
        has passed waiting for the transport). Raises InvalidRequestError for ids out of range,
        of unequal lengths or repeated destinations, or layers that are not; TransferError for
        an unknown or unreachable peer.
        """

    @abstractmethod
    def read_blocks(self, peer_id: WorkerId, remote_block_ids: Sequence[BlockId],
                    local_block_ids: Sequence[BlockId], notify: bytes, timeout_s: float,
                    layers: Sequence[Sequence[int]] | None = None) -> TransferHandle:
        """Copy the peer's block `remote_block_ids[i]` into local block `local_block_ids[i]`;
        otherwise as `write_blocks` (the peer gets `notify` once we have read everything)."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking. PENDING turns into FAILED once the handle's deadline has passed."""

    @abstractmethod
    def wait(self, handle: TransferHandle) -> None:
        """Block until the transfer is DONE; raise TransferError saying why when it FAILED.

        Bounded: returns or raises by the handle's deadline (plus one poll interval).
        """

    @abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Free the transfer's resources, cancelling it if still pending. Once this returns
        the transport no longer touches the handle's blocks. Raises TransferError when the
        cancel fails: the blocks may still be in use and the handle stays held."""

    @abstractmethod
    def drain_notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order per peer."""

    @abstractmethod
    def close(self) -> None:
        """Release every transfer and peer, then our registered memory. Idempotent."""

    def __enter__(self) -> KvTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
