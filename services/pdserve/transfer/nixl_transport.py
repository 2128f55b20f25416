"""KvTransport over NIXL with its UCX backend. The only module that imports nixl.

Setup cost is paid once: the KV tensor is registered once, a descriptor list of one entry
per local block is prepared once, and one per peer in `add_peer`. A transfer of N blocks is
then N (local index, remote index) pairs handed to `make_prepped_xfer`, which merges pairs
that are contiguous on both sides into one descriptor. A transfer of some layers of its blocks
(the global layers of a block out of every window's reach) names its runs of layers as
descriptors of their own, made for that transfer (`initialize_xfer`). NIXL's UCX backend flushes the
endpoint before it reports a transfer DONE, so DONE means the bytes are in the peer's memory.

UCX picks its transport (cma, shm, tcp, ...) from the process environment when the agent is
created; this module reads no environment. Whoever starts the process sets it (see
benchmarks/transfer_bandwidth.py --env).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import nixl  # noqa: F401  (loads the backend package that nixl._api and nixl._bindings alias)
from nixl import _bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle, nixl_xfer_handle

from pdserve.common.errors import ConfigError, IncompatiblePeerError, TransferError
from pdserve.common.ids import WorkerId
from pdserve.transfer.base import KvTransportBase, Op
from pdserve.transfer.blocks import BlockPairs
from pdserve.transfer.handshake import PeerMetadata
from pdserve.transfer.interface import Notification, TransferState
from pdserve.transfer.layout import KvLayoutSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(_bindings, name) for name in dir(_bindings)
    if name.startswith("nixl") and name.endswith("Error"))
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """How the NIXL agent and its UCX backend are set up.

    `error_handling_mode`: "peer" makes UCX report a lost peer as an error; it also moves
    NIXL's notifications off shared memory, so a WRITE that carries one is DONE only after
    the target next makes progress (measured: its polling period, against ~45 us with
    "none"; see docs/transfer.md). Deadlines bound every wait in either mode.
    `num_threads`: passed to the UCX backend as its `num_threads` (0: not set); it made no
    difference on a 2-core machine.
    `use_progress_thread`: NIXL's progress thread polls without sleeping and costs a core even
    when idle; without it, progress happens in `poll`, `wait` and `drain_notifications`, so a
    worker must call `drain_notifications` every loop iteration, idle or not: a peer's
    connection and transfers towards us complete only while we make progress.
    """

    error_handling_mode: Literal["peer", "none"] = "peer"
    num_ucx_workers: int = 1
    num_threads: int = 0
    use_progress_thread: bool = False

    def __post_init__(self) -> None:
        if self.error_handling_mode not in ("peer", "none"):
            raise ConfigError("error_handling_mode", self.error_handling_mode, "must be 'peer' or 'none'")
        if self.num_ucx_workers < 1:
            raise ConfigError("num_ucx_workers", self.num_ucx_workers, "must be at least 1")
        if self.num_threads < 0:
            raise ConfigError("num_threads", self.num_threads, "must not be negative")


class NixlTransport(KvTransportBase[nixl_xfer_handle]):
    """One NIXL agent, named after the worker, over the worker's KV tensor."""

    def __init__(self, worker_id: WorkerId, kv: torch.Tensor, spec: KvLayoutSpec,
                 config: NixlConfig = NixlConfig()) -> None:
        super().__init__(worker_id, kv, spec)
        with _nixl_errors("create the NIXL agent"):
            self._agent = nixl_agent(worker_id, nixl_agent_config(
                enable_prog_thread=config.use_progress_thread, backends=[]))
            self._agent.create_backend("UCX", _ucx_params(config))
            self._registered = self._agent.register_memory(kv)
            self._local_dlist = self._prep_dlist("NIXL_INIT_AGENT", kv.data_ptr(), self.num_blocks,
                                                 kv.device.index or 0, PeerMetadata.mem_type_of(kv))
        self._remote_dlists: dict[WorkerId, nixl_prepped_dlist_handle] = {}

    def _transport_blob(self) -> bytes:
        with _nixl_errors("read local agent metadata"):
            return self._agent.get_agent_metadata()

    def _connect(self, peer: PeerMetadata) -> None:
        with _nixl_errors(f"add peer {peer.worker_id!r}"):
            name = self._agent.add_remote_agent(peer.transport_blob)
        name = _text(name)
        if name != peer.worker_id:
            if name not in self._remote_dlists:  # never drop another, established peer
                self._disconnect(WorkerId(name))
            raise IncompatiblePeerError(f"peer {peer.worker_id!r} sent NIXL metadata of agent {name!r}")
        try:
            with _nixl_errors(f"connect to peer {peer.worker_id!r}"):
                self._remote_dlists[peer.worker_id] = self._prep_dlist(
                    peer.worker_id, peer.base_addr, peer.num_blocks, peer.device_id, peer.mem_type)
                self._agent.make_connection(peer.worker_id)
        except TransferError:
            self._disconnect(peer.worker_id)
            raise

    def _disconnect(self, peer_id: WorkerId) -> None:
        dlist = self._remote_dlists.pop(peer_id, None)
        try:
            if dlist is not None:
                dlist.release()
            self._agent.remove_remote_agent(peer_id)
        except _NIXL_ERRORS as error:
            log.warning("forgetting NIXL agent %r failed: %r", peer_id, error)

    def _post(self, op: Op, peer_id: WorkerId, pairs: BlockPairs, notify: bytes) -> nixl_xfer_handle:
        with _nixl_errors(f"{op} {len(pairs.local)} blocks with peer {peer_id!r}"):
            if pairs.layers is None:
                xfer = self._agent.make_prepped_xfer(op, self._local_dlist, pairs.local,
                                                     self._remote_dlists[peer_id], pairs.remote, notify)
            else:
                local, remote = self._layer_descs(self._peers[peer_id], pairs)
                xfer = self._agent.initialize_xfer(op, local, remote, peer_id, notify)
            try:
                status = self._agent.transfer(xfer)
            except _NIXL_ERRORS:
                xfer.release()
                raise
        if status == "ERR":
            self._release(xfer)
            raise TransferError(f"NIXL refused to post {op} of {len(pairs.local)} blocks to {peer_id!r}")
        return xfer

    def _status(self, token: nixl_xfer_handle) -> TransferState:
        with _nixl_errors("check transfer state"):
            status = self._agent.check_xfer_state(token)
        if status not in _STATES:
            raise TransferError(f"NIXL reports the transfer failed (state {status})")
        return _STATES[status]

    def _release(self, token: nixl_xfer_handle) -> None:
        with _nixl_errors("release transfer"):
            self._agent.release_xfer_handle(token)

    def _drain(self) -> list[Notification]:
        with _nixl_errors("read notifications"):
            by_agent = self._agent.get_new_notifs()
        return [Notification(WorkerId(_text(name)), bytes(payload))
                for name, payloads in by_agent.items() for payload in payloads]

    def _shutdown(self) -> None:
        with _nixl_errors("release registered KV tensor"):
            self._local_dlist.release()
            self._agent.deregister_memory(self._registered)

    def _layer_descs(self, peer: PeerMetadata, pairs: BlockPairs) -> tuple[object, object]:
        """Local and remote descriptor lists of the pairs' runs of layers, one entry per run."""
        runs = pairs.layer_runs().astype(np.uint64)  # (R, 4): local block, remote block, first layer, layers
        per_block, per_layer = np.uint64(self.spec.bytes_per_block), np.uint64(self.spec.bytes_per_layer)
        lists = []
        for base, column, device, mem_type in (
                (self.kv.data_ptr(), 0, self.kv.device.index or 0, PeerMetadata.mem_type_of(self.kv)),
                (peer.base_addr, 1, peer.device_id, peer.mem_type)):
            descs = np.empty((len(runs), 3), dtype=np.uint64)  # (R, 3): address, length, device
            descs[:, 0] = np.uint64(base) + runs[:, column] * per_block + runs[:, 2] * per_layer
            descs[:, 1] = runs[:, 3] * per_layer
            descs[:, 2] = device
            lists.append(self._agent.get_xfer_descs(descs, mem_type))
        return lists[0], lists[1]

    def _prep_dlist(self, agent: str, base_addr: int, num_blocks: int, device_id: int,
                    mem_type: str) -> nixl_prepped_dlist_handle:
        """One descriptor per block: block i is `[base + i * bpb, base + (i + 1) * bpb)`."""
        descs = np.empty((num_blocks, 3), dtype=np.uint64)  # (N, 3): address, length, device
        descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * self.spec.bytes_per_block
        descs[:, 1] = self.spec.bytes_per_block
        descs[:, 2] = device_id
        return self._agent.prep_xfer_dlist(agent, descs, mem_type)


def _ucx_params(config: NixlConfig) -> dict[str, str]:
    params = {"ucx_error_handling_mode": config.error_handling_mode,
              "num_workers": str(config.num_ucx_workers)}
    if config.num_threads:
        params["num_threads"] = str(config.num_threads)
    return params


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


@contextlib.contextmanager
def _nixl_errors(action: str) -> Iterator[None]:
    """Re-raise NIXL's own exception types as TransferError saying what we were doing."""
    try:
        yield
    except _NIXL_ERRORS as error:
        raise TransferError(f"NIXL failed to {action}: {type(error).__name__}: {error}") from error
