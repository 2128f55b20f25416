"""`pdserve serve`'s settings: one router and its workers, each a process of its own.

Serve takes the router's flags (`--host`/`--port` are HTTP), the worker flags (their gRPC
address is `--worker-host`/`--worker-port`), the topology flags (`--prefill N --decode M`, or
`--aggregated` / `--workers K`) and the launcher's own (timeouts, the restart backoff of a
worker that exits, the port of its restart metrics). Flags router and worker share
(`--model`, `--served-model-name`, `--cache-dir`, `--log-level`, `--deployment-id`) set both.
Workers take free ports unless `--worker-port` is given (then worker i listens on
`--worker-port` + i); metrics on `--metrics-port` + i when given; prefill workers come first.
Each launch is a deployment of its own: a fresh id unless `--deployment-id` is given, so its
router admits only its own workers, never those of another `pdserve serve` on the host. Its
internal plane is mutual TLS under a throwaway authority of its own (`certs.py`), unless
`--insecure-internal`.
"""
import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.common import config_options as cv
from pdserve.common.errors import ConfigError
from pdserve.common.ports import free_ports
from pdserve.common.setting_sources import Target, build_section, resolve_sources
from pdserve.common.settings import (
    RouterSettings,
    WorkerSettings,
    check,
    check_positive,
    opt,
)
from pdserve.common.stats import WorkerRole
from pdserve.serve.supervisor import RestartPolicy

# Torch threads per worker when serve starts several workers and --num-threads is unset: each
# worker would otherwise take every core, and the workers would contend for them.
SHARED_MACHINE_NUM_THREADS = 1

_WORKER_FLAGS = {"host": "worker-host", "port": "worker-port"}
_SERVE_HELP = {  # where serve's meaning differs from the router's or the worker's
    "worker-port": "first worker's gRPC port; worker i takes this + i (default or 0: free ports)",
    "deployment-id": "names this launch to its router and workers; the router admits only workers of "
                     "the same id (default: a fresh id per launch)",
}


@dataclass(frozen=True, slots=True)
class ServeTopology:
    """How many workers serve starts, and in which roles: by default one prefill and one decode
    worker; aggregated, role=both workers (the baseline disaggregation is measured against)."""

    num_prefill: int | None = opt(None, parse=cv.optional(cv.parse_int), flag="prefill",
                                  help="prefill workers (default 1; 0: decode workers prefill themselves)")
    num_decode: int | None = opt(None, parse=cv.optional(cv.parse_int), flag="decode",
                                 help="decode workers (default 1)")
    num_aggregated: int | None = opt(None, parse=cv.optional(cv.parse_int), flag="workers",
                                     help="serve aggregated with this many role=both workers")
    aggregated: bool = opt(False, parse=cv.parse_bool,
                           help="serve aggregated: role=both workers (see --workers, default 1)")

    def __post_init__(self) -> None:
        check(self.num_prefill is None or self.num_prefill >= 0, "num_prefill", self.num_prefill, "must be >= 0")
        check_positive(self, "num_decode", "num_aggregated")
        if self.is_aggregated:
            for name in ("num_prefill", "num_decode"):
                value = getattr(self, name)
                check(value is None, name, value, "cannot be combined with --aggregated or --workers")

    @property
    def is_aggregated(self) -> bool:
        return self.aggregated or self.num_aggregated is not None

    def roles(self) -> tuple[WorkerRole, ...]:
        """Each worker's role, in start order: prefill workers, then decode workers."""
        if self.is_aggregated:
            return (WorkerRole.BOTH,) * (self.num_aggregated or 1)
        num_prefill = 1 if self.num_prefill is None else self.num_prefill
        return (WorkerRole.PREFILL,) * num_prefill + (WorkerRole.DECODE,) * (self.num_decode or 1)


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """A router and the workers it calls: role=both workers, or prefill and decode workers
    (at least one decode worker, which prefills itself when no prefill worker answers)."""

    router: RouterSettings
    workers: tuple[WorkerSettings, ...]  # in start order
    startup_timeout_s: float = opt(300.0, parse=cv.parse_float, flag="startup-timeout",
                                   help="how long each process may take to become ready (seconds)")
    shutdown_timeout_s: float = opt(15.0, parse=cv.parse_float, flag="shutdown-timeout",
                                    help="how long each process may take to stop before it is killed")
    restart_backoff_s: float = opt(1.0, parse=cv.parse_float, flag="restart-backoff",
                                   help="wait before restarting a worker that exited (seconds); doubled for each "
                                        "death in a row, up to --max-restart-backoff")
    max_restart_backoff_s: float = opt(30.0, parse=cv.parse_float, flag="max-restart-backoff",
                                       help="longest wait before restarting a worker (seconds)")
    max_worker_deaths: int = opt(5, parse=cv.parse_int, flag="max-worker-deaths",
                                 help="a worker that exits this many times in a row (none up a minute in between) "
                                      "is not restarted: serve stops and says why")
    serve_metrics_port: int | None = opt(0, parse=cv.optional(cv.parse_int),
                                         help="serve's own Prometheus metrics (pdserve_worker_restarts_total) on "
                                              "this port (0: a free port, in the banner; '': none)")
    share_cores: bool = opt(True, parse=cv.parse_bool,
                            help="several workers: one with work also runs on the cores of those idle at the "
                                 "moment (each keeps --num-threads of its own)")

    def __post_init__(self) -> None:
        check_positive(self, "startup_timeout_s", "shutdown_timeout_s", "restart_backoff_s",
                       "max_restart_backoff_s", "max_worker_deaths")
        check(self.max_restart_backoff_s >= self.restart_backoff_s, "max_restart_backoff_s",
              self.max_restart_backoff_s, f"must be >= --restart-backoff ({self.restart_backoff_s:g})")
        check(self.serve_metrics_port is None or 0 <= self.serve_metrics_port < 65536, "serve_metrics_port",
              self.serve_metrics_port, "must be in 0..65535")
        roles = {w.role for w in self.workers}
        is_valid = roles == {WorkerRole.BOTH} or (WorkerRole.DECODE in roles and WorkerRole.BOTH not in roles)
        check(is_valid, "role", sorted(roles), "serve runs role=both workers, or decode (and prefill) workers")
        addresses = tuple(w.address for w in self.workers)
        check(len(set(addresses)) == len(addresses), "worker", addresses, "each worker needs its own port")
        check(self.router.workers == addresses, "worker", self.router.workers,
              f"serve's router calls its own workers at {','.join(addresses)}")
        deployments = {w.deployment_id for w in self.workers}
        check(deployments == {self.router.deployment_id}, "deployment_id", sorted(map(str, deployments)),
              f"serve's workers belong to its router's deployment {self.router.deployment_id!r}")

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.restart_backoff_s, self.max_restart_backoff_s,
                             max_deaths_in_a_row=self.max_worker_deaths)


def worker_ports(base: WorkerSettings, num_workers: int) -> tuple[int, ...]:
    """`base.port` + i for worker i; `base.port` 0: a free port each (serve's default)."""
    if not base.port:
        return free_ports(base.host, num_workers)
    check(base.port + num_workers <= 65536, "port", base.port, f"{num_workers} workers need ports up to 65535")
    return tuple(base.port + i for i in range(num_workers))


def worker_fleet(base: WorkerSettings, roles: Sequence[WorkerRole],
                 ports: Sequence[int]) -> tuple[WorkerSettings, ...]:
    """Worker i: `roles[i]` on `ports[i]`, metrics on `base.metrics_port` + i (0 stays 0: any
    free port). Several workers get SHARED_MACHINE_NUM_THREADS unless `base` sets it."""
    threads = base.num_threads or (SHARED_MACHINE_NUM_THREADS if len(roles) > 1 else None)
    metrics = base.metrics_port
    check(not metrics or metrics + len(roles) <= 65536, "metrics_port", metrics,
          f"{len(roles)} workers need ports up to 65535")
    return tuple(
        dataclasses.replace(base, role=role, port=port, num_threads=threads,
                            metrics_port=metrics + i if metrics else metrics)
        for i, (role, port) in enumerate(zip(roles, ports, strict=True))
    )


def new_deployment_id() -> str:
    return f"serve-{secrets.token_hex(6)}"


def _serve_options() -> list[cv.Option]:
    options = cv.merged(
        cv.options_of(RouterSettings, "router", skip=("workers", "worker_dns", "worker_dns_interval_s", "tls_dir"))
        + cv.options_of(WorkerSettings, "worker", rename=_WORKER_FLAGS,
                        skip=("role", "worker_id", "tls_dir", "health_port", "core_share_file"))  # probed over HTTP
        + cv.options_of(ServeTopology, "topology")
        + cv.options_of(ServeSettings, "serve")
    )
    return [dataclasses.replace(o, help=_SERVE_HELP.get(o.flag, o.help)) for o in options]


def _named(error: ConfigError, options: list[cv.Option], labels: dict[Target, str]) -> ConfigError:
    """`error` (raised about a worker field) naming the flag or source the user set."""
    flags = {t: f"--{o.flag}" for o in options for t in o.targets}
    target = ("worker", error.field)
    return ConfigError(labels.get(target) or flags.get(target, error.field), error.value, error.reason)


def resolve_serve_settings(argv: Sequence[str] | None = None,
                           environ: Mapping[str, str] | None = None) -> ServeSettings:
    """`pdserve serve`'s settings; as `resolve_worker_settings`. Picks the free worker ports and
    the fresh deployment id where the user gave none."""
    options = _serve_options()
    values, labels = resolve_sources("pdserve serve", options, argv, environ)
    values.setdefault(("worker", "port"), 0)  # free ports, where a lone worker's default is 50051
    deployment_id = values.get(("router", "deployment_id")) or new_deployment_id()
    values.update({("router", "deployment_id"): deployment_id, ("worker", "deployment_id"): deployment_id})
    topology = build_section(ServeTopology, "topology", options, values, labels)
    base = build_section(WorkerSettings, "worker", options, values, labels)
    if not base.protect_metrics:  # a worker holds API keys only to guard its /metrics
        base = dataclasses.replace(base, api_key=(), api_keys_file=None)
    try:
        roles = topology.roles()
        workers = worker_fleet(base, roles, worker_ports(base, len(roles)))
    except ConfigError as exc:
        raise _named(exc, options, labels) from None
    router = build_section(RouterSettings, "router", options, values, labels,
                           workers=tuple(w.address for w in workers))
    return build_section(ServeSettings, "serve", options, values, labels, router=router, workers=workers)
