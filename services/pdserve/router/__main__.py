"""`pdserve router`: wire settings, tokenizer, the workers (pool, prefix index, KV event
subscribers, routing) and the HTTP app together.

Exit status: 0 after a clean stop (SIGINT/SIGTERM), 2 for a bad setting (an unusable
`--api-keys-file` included), a `--port` in use, or workers that
disagree (model, block size, block-key algorithm), 1 when no decode-capable worker can be
reached within `--worker-wait-timeout` (a worker of another `--deployment-id` is never admitted).
Every call to a worker is mutual TLS under `--tls-dir`'s certificate (of role router), or
plain text with `--insecure-internal` (logged as a warning).
"""
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from pdserve.common.errors import ConfigError, WorkerUnavailableError
from pdserve.common.ids import DeploymentId
from pdserve.common.pki import Role
from pdserve.common.ports import check_port_free
from pdserve.common.settings import RouterSettings, resolve_router_settings
from pdserve.common.tls import INSECURE_WARNING, TlsConfig, resolve_tls
from pdserve.models.tokenizer import Tokenizer, load_tokenizer
from pdserve.models.generation_config import generation_defaults
from pdserve.router.openai.app import create_app
from pdserve.router.openai.access.hosts import allowed_hosts
from pdserve.common.api_keys import ApiKeys, load_api_keys
from pdserve.router.routing.cluster import Cluster, ClusterConfig
from pdserve.router.routing.cost import CostWeights
from pdserve.router.routing.migration import MigrationPolicy
from pdserve.router.routing.planner import Planner, RoutingConfig
from pdserve.router.routing.routed_backend import RoutedBackend
from pdserve.router.openai.sampling import checked_defaults
from pdserve.router.openai.serving import ApiLimits
from pdserve.router.openai.structured.tools import ToolCallConfig
from pdserve.router.routing.worker_pool import PoolConfig

_log = logging.getLogger("pdserve.router")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = resolve_router_settings(argv)
        check_port_free("--port", settings.host, settings.port)  # now, not after waiting for the workers
        api_keys = load_api_keys(settings.api_key, settings.api_keys_file) if settings.has_api_keys else None
        tls = resolve_tls(settings.tls_dir, settings.insecure_internal, Role.ROUTER)
        tokenizer = load_tokenizer(settings.model, settings.cache_dir)
    except ConfigError as err:
        print(f"pdserve router: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if tls is None:
        _log.warning(INSECURE_WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        asyncio.run(_serve(settings, tokenizer, api_keys, tls))
    except ConfigError as err:  # workers that cannot serve together
        print(f"pdserve router: {err}", file=sys.stderr)
        return 2
    except (WorkerUnavailableError, TimeoutError) as err:
        print(f"pdserve router: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT or SIGTERM; uvicorn re-raises the signal after its graceful stop
        return 0
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops the router the way SIGINT does."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


async def _serve(settings: RouterSettings, tokenizer: Tokenizer, api_keys: ApiKeys | None,
                 tls: TlsConfig | None) -> None:
    """Serve HTTP until a signal stops uvicorn; the app's shutdown closes the cluster."""
    sampling_defaults = checked_defaults(generation_defaults(settings.generation_config, settings.model))
    cluster = Cluster(cluster_config(settings, tls))
    try:
        info = await cluster.start()
        planner = Planner(cluster.pool, cluster.index, routing_config(settings), info.tokens_per_block)
    except BaseException:
        await cluster.close()
        raise
    migration = MigrationPolicy(settings.migration_limit, tokenizer.decode)
    backend = RoutedBackend(cluster, planner, info, settings.session_header, migration)
    limits = ApiLimits(first_output_timeout_s=settings.first_output_timeout_s, output_timeout_s=settings.output_timeout_s,
                       max_pending_requests=settings.max_pending_requests,
                       keepalive_interval_s=settings.sse_keepalive_interval_s or None,
                       body_timeout_s=settings.body_read_timeout_s, send_timeout_s=settings.send_timeout_s)
    app = create_app(backend, tokenizer, info, settings.served_model_name, limits, routing=backend,
                     api_keys=api_keys, protect_metrics=settings.protect_metrics, sampling_defaults=sampling_defaults,
                     tool_calls=ToolCallConfig(settings.enable_auto_tool_choice, settings.tool_call_parser),
                     loras=backend, runtime_lora_updating=runtime_lora_updating(settings),
                     allowed_hosts=allowed_hosts(settings.host, settings.allowed_hosts))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            lifespan="on", timeout_graceful_shutdown=5)
    names = settings.served_model_name or (info.model_name,)
    _log.info("serving %s from %s, %s routing, on http://%s:%d", ", ".join(names), _describe_workers(settings, cluster),
              settings.routing_policy, settings.host, settings.port)
    _log.info("%s", _describe_access(api_keys, settings.protect_metrics))
    await uvicorn.Server(config).serve()


def _describe_workers(settings: RouterSettings, cluster: Cluster) -> str:
    """e.g. "2 worker(s)", or "3 worker(s), found behind prefill:50051 every 5 s"."""
    described = f"{len(cluster.pool.handles)} worker(s)"
    if settings.worker_dns:
        described += f", found behind {','.join(settings.worker_dns)} every {settings.worker_dns_interval_s:g} s"
    return described


def _describe_access(api_keys: ApiKeys | None, protect_metrics: bool) -> str:
    """How the API is protected, naming how many keys and tenants, never a key."""
    if api_keys is None:
        return "no API keys: /v1 is open to anyone who reaches this port"
    metrics = "/metrics needs a key too" if protect_metrics else "/health* and /metrics open"
    return f"/v1 needs one of {api_keys.num_keys} API key(s) of {len(api_keys.tenants)} tenant(s); {metrics}"


def cluster_config(settings: RouterSettings, tls: TlsConfig | None = None) -> ClusterConfig:
    deployment = DeploymentId(settings.deployment_id) if settings.deployment_id else None
    pool = PoolConfig(settings.worker_poll_interval_s, settings.worker_failure_threshold,
                      settings.worker_wait_timeout_s, deployment, drain_timeout_s=settings.generate_timeout_s)
    return ClusterConfig(settings.static_workers, pool, settings.rpc_timeout_s, settings.generate_timeout_s, tls,
                         settings.worker_dns, settings.worker_dns_interval_s)


def routing_config(settings: RouterSettings) -> RoutingConfig:
    weights = CostWeights(prefill_load_scale=settings.prefill_load_scale, host_credit=settings.host_cache_hit_weight,
                          disk_credit=settings.disk_cache_hit_weight)
    return RoutingConfig(settings.routing_policy, settings.router_temperature, weights, settings.session_ttl_s,
                         settings.local_prefill_queue_tokens)


if __name__ == "__main__":
    sys.exit(main())


def runtime_lora_updating(settings: RouterSettings) -> bool:
    """`--allow-runtime-lora-updating`, or vLLM's switch in the environment."""
    return settings.allow_runtime_lora_updating or os.environ.get(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")
