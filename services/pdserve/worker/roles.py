"""What a worker's role adds around its engine.

- both: nothing; the engine serves prefill and decode (aggregated).
- prefill: a NIXL transport over the KV tensor and the KvTransfer service for decode workers.
- decode: a NIXL transport, connections to prefill workers, and `DecodeEngine` in front.
Transport progress (NIXL without its own thread) and the lease-expiry metric run in one
background task, every loop turn, idle or not.
"""
import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.common.engine_api import AsyncEngine
from pdserve.common.ids import WorkerId
from pdserve.common.settings import WorkerSettings
from pdserve.common.stats import WorkerRole
from pdserve.common.tls import TlsConfig
from pdserve.rpc.kv_transfer_service import add_kv_transfer_service
from pdserve.transfer.interface import KvTransport
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.disagg import DecodeEngine, DisaggConfig
from pdserve.worker.kv.peers import PrefillPeers
from pdserve.worker.lora_registry import LoraRegistry
from pdserve.worker.metrics import LOCAL_PREFILL_REASONS, TransferMetrics
from pdserve.worker.prefill_service import PrefillService

BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.02


@dataclass
class RoleParts:
    engine: AsyncEngine
    services: list[Callable[[grpc.aio.Server], None]] = field(default_factory=list)
    transport: KvTransport | None = None
    peers: PrefillPeers | None = None
    prefill: PrefillService | None = None  # a prefill worker's KvTransfer handler


def build_role(settings: WorkerSettings, threaded: ThreadedEngine, metrics: TransferMetrics,
               tls: TlsConfig | None = None, loras: LoraRegistry | None = None) -> RoleParts:
    """The role's parts; `tls` (our credentials, None: plain text) for calls to prefill workers;
    `loras`, the adapters we hold, told to KV peers at handshake."""
    lora_ids = loras.lora_ids if loras is not None else frozenset
    if settings.role == WorkerRole.BOTH:
        return RoleParts(threaded)
    transport = make_transport(settings, threaded)
    deployment = settings.deployment_id or ""
    if settings.role == WorkerRole.PREFILL:
        metrics.start_at_zero("sent")
        service = PrefillService(threaded, transport, metrics, deployment, lora_ids)
        return RoleParts(threaded, [lambda s: add_kv_transfer_service(s, service)], transport, prefill=service)
    metrics.start_at_zero("received", LOCAL_PREFILL_REASONS)
    peers = PrefillPeers(transport, deployment_id=deployment, tls=tls, lora_ids=lora_ids)
    config = DisaggConfig(WorkerId(settings.peer_name), settings.disagg_min_prefill_tokens,
                          settings.kv_transfer_timeout_s,
                          recompute_on_failure=settings.kv_transfer_failure == "recompute",
                          prefill_queue_timeout_s=settings.prefill_queue_timeout_s,
                          max_prefill_queue=settings.max_prefill_queue)
    return RoleParts(DecodeEngine(threaded, peers, config, metrics), [], transport, peers)


def make_transport(settings: WorkerSettings, threaded: ThreadedEngine) -> KvTransport:
    from pdserve.transfer.nixl_transport import NixlTransport  # only roles that move KV load NIXL

    kv = threaded.engine.runner.kv_tensor
    return NixlTransport(WorkerId(settings.peer_name), kv, kv_layout(settings.model_name, threaded.engine.runner))


def kv_layout(model_name: str, runner) -> KvLayoutSpec:
    """The layout of a `ModelRunner`'s KV blocks, its layers' sliding windows included."""
    config = runner.config
    windows = tuple(config.window_of(layer) for layer in range(config.num_layers))
    return KvLayoutSpec.for_tensor(model_name, runner.kv_tensor, layer_windows=windows)


async def run_background(parts: RoleParts, threaded: ThreadedEngine, metrics: TransferMetrics) -> None:
    """Drive transport progress and export lease expiries until cancelled."""
    reported = 0
    while True:
        if parts.transport is not None:
            parts.transport.drain_notifications()
        expiries = threaded.engine.handoffs.num_lease_expiries
        if expiries > reported:
            metrics.lease_expiries.inc(expiries - reported)
            reported = expiries
        await asyncio.sleep(BUSY_POLL_S if len(threaded.engine.handoffs) else IDLE_POLL_S)


async def close_role(parts: RoleParts) -> None:
    if parts.peers is not None:
        await parts.peers.close()
    if parts.transport is not None:
        with contextlib.suppress(Exception):
            parts.transport.close()
