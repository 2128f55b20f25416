"""`pdserve worker`: resolve the settings, build the engine, serve it over gRPC until
SIGINT or SIGTERM, then drain (new requests refused saying why, grpc.health.v1 NOT_SERVING,
running ones finish within `--drain-timeout` seconds, `server.py`) and exit 0. `--health-port`
serves grpc.health.v1 alone in plain text, for probes without a client certificate.

Internal gRPC is mutual TLS from `--tls-dir` (the worker's id is the identity in its
certificate, whose role must be the worker's `--role`), or plain text with
`--insecure-internal`, said loudly at start.

The Worker service serves the role's engine behind `BoundedEngine` (at most
`--max-waiting-requests` waiting; refused while the watchdog finds the engine thread wedged);
the LoraAdapters service, next to it, loads and unloads adapters (`--enable-lora`; refused
without it)."""
import asyncio
import dataclasses
import logging
import signal
import sys

from pdserve.common.errors import ConfigError
from pdserve.common.ids import DeploymentId, WorkerId
from pdserve.common.pki import Role
from pdserve.common.api_keys import load_api_keys
from pdserve.common.ports import check_port_free
from pdserve.common.settings import WorkerSettings, pod_name, resolve_worker_settings
from pdserve.common.tls import INSECURE_WARNING, TlsConfig, resolve_tls, speaks_for
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.loading.weights import load_model_config, resolve_device
from pdserve.engine.model.lora import LoraSettings
from pdserve.common.speculative import parse_speculative_config
from pdserve.kvcache import KvCacheConfig
from pdserve.rpc.lora_service import add_lora_service
from pdserve.worker.admission import BoundedEngine, entry_of
from pdserve.worker.drain import DrainGate
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.bootstrap import EngineSpec, build_threaded_engine
from pdserve.worker.kv.events import kv_events_service
from pdserve.worker.engine_metrics import export_engine
from pdserve.worker.lora_registry import LoraRegistry
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.roles import build_role, close_role, run_background
from pdserve.worker.server import serve_until_stopped
from pdserve.worker.watchdog import EngineWatchdog

log = logging.getLogger("pdserve.worker")

# On CPU, a fraction of the machine's RAM would take most of it; without an explicit KV size
# (--kv-cache-memory / --max-kv-tokens) a CPU worker's KV cache is capped at this.
CPU_DEFAULT_KV_BYTES = 512 << 20


# Tokens per KV block unless --block-size sets it. On a CPU, decode attention reads each
# block's keys and values as one run of memory, and longer runs read faster: a decode step of
# 8 sequences of 1,100 tokens took 51 ms with 64-token blocks against 61 ms with 16
# (benchmarks/README.md, "KV block size"); vLLM's CPU back end defaults to 128.
CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 64, 16


def default_block_size(device) -> int:
    return CPU_BLOCK_SIZE if device.type == "cpu" else GPU_BLOCK_SIZE


def engine_spec(settings: WorkerSettings) -> EngineSpec:
    """What `bootstrap` builds the engine from; `max_model_len` None → the model's context length."""
    device = None if settings.device == "auto" else settings.device
    resolved = resolve_device(device)
    is_sized = settings.kv_cache_memory is not None or settings.max_kv_tokens is not None
    on_cpu_unsized = not is_sized and resolved.type == "cpu"
    kv = KvCacheConfig(
        max_tokens=settings.max_kv_tokens,
        max_total_bytes=CPU_DEFAULT_KV_BYTES if on_cpu_unsized else settings.kv_cache_memory,
        free_memory_fraction=1.0,  # of the budget bootstrap.kv_memory_budget computes
        tokens_per_block=settings.block_size or default_block_size(resolved),
        enable_block_reuse=settings.enable_prefix_caching,
        host_cache_size=settings.host_cache_size,
        secondary_offload_min_priority=settings.secondary_offload_min_priority,
    )
    max_model_len = settings.max_model_len or load_model_config(settings.model).max_position_embeddings
    scheduler = SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens, max_model_len)
    return EngineSpec(
        model=settings.model, served_model_name=settings.model_name, role=settings.role,
        dtype=settings.dtype, device=device, kv_cache_dtype=settings.kv_cache_dtype, kv=kv,
        scheduler=scheduler, num_threads=settings.num_threads, core_share_file=settings.core_share_file,
        kernels=settings.kernels,
        cache_dir=settings.cache_dir, disk_cache_dir=settings.disk_cache_dir, disk_cache_size=settings.disk_cache_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        lora=LoraSettings(settings.max_loras, settings.max_lora_rank) if settings.enable_lora else None,
        speculative=None if settings.speculative_config is None else parse_speculative_config(
            settings.speculative_config, settings.model),
    )


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def with_identity(settings: WorkerSettings, pod: str | None = None) -> tuple[WorkerSettings, TlsConfig | None]:
    """The settings with the worker id bound to the certificate's identity, and the credentials.
    In a pod (`pod`, its name) the id is `<identity>/<pod>`, so the replicas of a Deployment,
    which share one certificate, keep distinct ids. ConfigError when `--worker-id` names
    another identity than the certificate, or when the certificate's role is not `--role`."""
    tls = resolve_tls(settings.tls_dir, settings.insecure_internal, Role(settings.role))
    if tls is None:
        return settings, None
    worker_id = settings.worker_id or (f"{tls.identity}/{pod}" if pod else tls.identity)
    if not speaks_for(tls.identity, worker_id):
        raise ConfigError("--worker-id", settings.worker_id,
                          f"the certificate in {settings.tls_dir} names {tls.identity!r}; a worker's id is its "
                          "identity, or <identity>/<instance>")
    return dataclasses.replace(settings, worker_id=worker_id), tls


async def run_worker(settings: WorkerSettings, tls: TlsConfig | None = None) -> None:
    """Build and start the engine and its role's parts, serve until a signal, then stop all."""
    if tls is None:
        log.warning(INSECURE_WARNING)
    metrics_keys = load_api_keys(settings.api_key, settings.api_keys_file) if settings.protect_metrics else None
    engine = build_threaded_engine(engine_spec(settings))
    loras = LoraRegistry(engine, settings.lora_dir)
    if settings.enable_lora:
        log.info("LoRA enabled (up to %d adapters of rank <= %d)", settings.max_loras, settings.max_lora_rank)
        loras.load_at_start(settings.lora_module_pairs)
    metrics = TransferMetrics()
    export_engine(metrics.registry, engine, settings.model_name)
    parts = build_role(settings, engine, metrics, tls, loras)
    if settings.metrics_port is not None:
        port = metrics.serve(settings.host, settings.metrics_port, metrics_keys)
        log.info("metrics on http://%s:%d/metrics", settings.host, port)
    watchdog = EngineWatchdog(engine, settings.engine_step_timeout_s)
    served = BoundedEngine(parts.engine, settings.max_waiting_requests, watchdog)
    gate = DrainGate(served)
    if parts.prefill is not None:  # prefill orders pass the Worker service's policies too
        parts.prefill.entry = entry_of(gate, served)
    loras.entry = entry_of(gate, served, is_request=False)  # so do adapter loads and unloads
    engine.start()
    background = asyncio.create_task(run_background(parts, engine, metrics))
    watching = asyncio.create_task(watchdog.run())
    stop = _stop_on_signals()
    services = [*parts.services, kv_events_service(engine, stop), lambda server: add_lora_service(server, loras)]
    try:
        log.info("serving %s (role %s, deployment %s) on %s:%d", settings.model_name, settings.role,
                 settings.deployment_id or "none", settings.host, settings.port)
        await serve_until_stopped(gate, settings.host, settings.port, stop, settings.drain_timeout_s,
                                  services, DeploymentId(settings.deployment_id) if settings.deployment_id else None,
                                  tls, settings.health_port, WorkerId(settings.peer_name))
    finally:
        background.cancel()
        watching.cancel()
        await close_role(parts)
        await spill_host_tier(engine, settings.drain_timeout_s)
        engine.stop()


async def spill_host_tier(engine: ThreadedEngine, timeout_s: float) -> None:
    """At a graceful stop, write the host tier's keepable blocks to the disk tier (bounded)."""
    if engine.engine.kv.disk is None:
        return
    try:
        written = await engine.spill_host_tier(timeout_s)
        log.info("disk KV tier: wrote %d host-tier blocks before stopping", written)
    except (TimeoutError, asyncio.TimeoutError):
        log.warning("disk KV tier: the host tier was not written within %g s", timeout_s)


def check_ports(settings: WorkerSettings) -> None:
    """A port in use is an error now, not after the model has loaded (minutes for a large one)."""
    for flag, port in (("--port", settings.port), ("--metrics-port", settings.metrics_port),
                       ("--health-port", settings.health_port)):
        if port:
            check_port_free(flag, settings.host, port)


def main(argv: list[str] | None = None) -> int:
    try:
        settings, tls = with_identity(resolve_worker_settings(argv), pod_name())
        check_ports(settings)
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        asyncio.run(run_worker(settings, tls))
    except ConfigError as exc:
        print(f"pdserve worker: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
