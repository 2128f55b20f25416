"""`pdserve serve`: the router and its workers (prefill + decode, or role both), as processes.

A port it was told to use (`--port`, `--worker-port`, `--metrics-port`, `--serve-metrics-port`)
that another process holds is a one-line error before anything starts. Starts every worker at
once and waits (bounded) for each one's gRPC health, starts the router with one `--worker` per
worker and waits for its HTTP `/health`, prints the URL, the topology and a curl line, then
watches them all. A worker that exits is restarted on the same port with the same flags (so the
same deployment id) after a backoff (`--restart-backoff`, doubled per death in a row up to
`--max-restart-backoff`); the router takes it back once its health check passes. Each restart
is a line on stderr and counts in `pdserve_worker_restarts_total` on serve's own `/metrics`.
Ctrl-C or SIGTERM stops every process: the workers drain together (the router still relays
their streams and answers new requests 503), then the router; a router that dies stops the
others and makes `serve` exit 1 with one line. Each child is tethered to this process
(`tether.py`): killed with SIGKILL, serve takes its children with it.
"""
import dataclasses
import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.ids import DeploymentId
from pdserve.common.api_keys import load_api_keys
from pdserve.common.ports import check_port_free
from pdserve.serve.settings import ServeSettings, resolve_serve_settings
from pdserve.common.settings import WorkerSettings, child_environ, to_argv
from pdserve.common.stats import WorkerRole
from pdserve.common.tls import INSECURE_WARNING, TlsConfig
from pdserve.rpc.probe import is_worker_serving
from pdserve.serve.certs import with_serve_certs
from pdserve.serve.restarts import WorkerRestarts
from pdserve.serve.scratch import scratch_folder
from pdserve.serve.supervisor import ChildFailedError, ChildSpec, RestartPolicy, StopRequested, Supervisor

PROBE_TIMEOUT_S = 1.0
EXAMPLE_PROMPT = "The capital of France is"


def base_url(settings: ServeSettings) -> str:
    host = settings.router.host
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{settings.router.port}"


def is_http_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=PROBE_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def worker_name(worker: WorkerSettings) -> str:
    """e.g. "decode worker at 127.0.0.1:50052"; a role=both worker is just "worker"."""
    role = "" if worker.role == WorkerRole.BOTH else f"{worker.role} "
    return f"{role}worker at {worker.address}"


def child_command(settings: ServeSettings) -> tuple[str, ...]:
    """`pdserve` in a child that dies with this process (after `--shutdown-timeout` at most)."""
    return (sys.executable, "-m", "pdserve.serve.tether", str(os.getpid()), f"{settings.shutdown_timeout_s:g}")


def worker_spec(command: tuple[str, ...], worker: WorkerSettings, restart: RestartPolicy,
                tls: TlsConfig | None = None) -> ChildSpec:
    """Ready once serving, as serve's own: another deployment's worker on the port is not it.
    `tls`: the credentials serve probes with (the router's)."""
    address, deployment = worker.address, DeploymentId(worker.deployment_id) if worker.deployment_id else None
    return ChildSpec(worker_name(worker), (*command, "worker", *to_argv(worker)),
                     lambda: is_worker_serving(address, PROBE_TIMEOUT_S, deployment, tls),
                     child_environ(worker), restart)  # the worker sets its own CPU runtime defaults


def child_stages(settings: ServeSettings) -> list[list[ChildSpec]]:
    """The workers (started together), then the router: each run as `<child_command> <kind>
    <flags>` with every setting as a flag, so the child resolves what this process did; the
    router's API keys go in its environment, never on a command line anyone on the host can read."""
    url = base_url(settings)
    command = child_command(settings)
    router = ChildSpec("router", (*command, "router", *to_argv(settings.router)),
                       lambda: is_http_healthy(url), child_environ(settings.router))
    tls = TlsConfig.from_dir(settings.router.tls_dir) if settings.router.tls_dir else None
    workers = [worker_spec(command, worker, settings.restart_policy, tls) for worker in settings.workers]
    return [workers, [router]]


def worker_restarts(settings: ServeSettings) -> WorkerRestarts:
    """The listener that logs and counts serve's worker restarts, labelled by address and role."""
    return WorkerRestarts({worker_name(w): {"worker": w.address, "role": str(w.role)} for w in settings.workers})


def check_ports(settings: ServeSettings) -> None:
    """Raise ConfigError naming the flag of the first port to be used that is taken."""
    check_port_free("--port", settings.router.host, settings.router.port)
    for worker in settings.workers:
        check_port_free("--worker-port", worker.host, worker.port)
        if worker.metrics_port:
            check_port_free("--metrics-port", worker.host, worker.metrics_port)
    if settings.serve_metrics_port:
        check_port_free("--serve-metrics-port", settings.router.host, settings.serve_metrics_port)


def topology_lines(settings: ServeSettings, serve_metrics_port: int | None) -> list[str]:
    lines = [f"  router   {base_url(settings)}  deployment {settings.router.deployment_id}"]
    for worker in settings.workers:
        port = worker.metrics_port
        metrics = "" if port is None else f"  metrics port {port}" if port else "  metrics on a free port"
        lines.append(f"  {worker.role:<8} {worker.address}{metrics}")
    threads = {worker.num_threads for worker in settings.workers}.pop()
    shown = "torch's default" if threads is None else str(threads)
    shared = ", and idle peers' cores (--share-cores)" if settings.workers[0].core_share_file else ""
    lines.append(f"  torch threads per worker: {shown} (--num-threads sets it){shared}")
    lines.append("  internal gRPC: " + ("PLAIN TEXT (--insecure-internal)" if settings.router.insecure_internal
                                      else "mutual TLS, a throwaway authority for this launch"))
    if serve_metrics_port is not None:
        host = base_url(settings).rsplit(":", 1)[0]
        lines.append(f"  worker restarts: {host}:{serve_metrics_port}/metrics (pdserve_worker_restarts_total)")
    return lines


def ready_banner(settings: ServeSettings, serve_metrics_port: int | None) -> str:
    url = base_url(settings)
    model = settings.workers[0].model_name
    body = json.dumps({"model": model, "prompt": EXAMPLE_PROMPT, "max_tokens": 16})
    curl = (f"curl -s {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")
    return "\n".join([f"pdserve is ready at {url} (model {model}); Ctrl-C stops it.",
                      "Topology:", *topology_lines(settings, serve_metrics_port), "Try:", f"  {curl}"])


def run(stages: list[list[ChildSpec]], banner: str, supervisor: Supervisor) -> int:
    """Start each stage's children together, stage after stage, print `banner`, watch, and
    always stop every child. Returns the exit status: 0 after a stop signal, 1 after a child failed."""
    try:
        for stage in stages:
            supervisor.start_group(stage)
        print(banner, flush=True)
        supervisor.watch()
    except StopRequested:
        return 0
    except ChildFailedError as exc:
        print(f"pdserve serve: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        supervisor.stop_all()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = resolve_serve_settings(argv)
        check_ports(settings)
        router = settings.router  # --protect-metrics covers serve's own metrics port too
        keys = load_api_keys(router.api_key, router.api_keys_file) if router.protect_metrics else None
    except ConfigError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    restarts = worker_restarts(settings)
    metrics_port = (None if settings.serve_metrics_port is None
                    else restarts.serve(settings.router.host, settings.serve_metrics_port, keys))
    supervisor = Supervisor(settings.startup_timeout_s, settings.shutdown_timeout_s, listener=restarts)
    supervisor.install_signal_handlers()
    roles = ", ".join(str(worker.role) for worker in settings.workers)
    print(f"pdserve serve: starting workers ({roles}), then the router; model loading takes a while",
          flush=True)
    with scratch_folder() as folder:  # owner-only; removed at exit, or by the next start after a SIGKILL
        settings = with_core_share(settings, folder)
        if settings.router.insecure_internal:
            print(f"pdserve serve: {INSECURE_WARNING}", file=sys.stderr, flush=True)
        else:
            settings = with_serve_certs(settings, folder)
        return run(child_stages(settings), ready_banner(settings, metrics_port), supervisor)


def with_core_share(settings: ServeSettings, folder: Path) -> ServeSettings:
    """Several workers share the machine's cores through one table in `folder` (`--share-cores`)."""
    if not settings.share_cores or len(settings.workers) < 2:
        return settings
    path = str(folder / "cores")
    return dataclasses.replace(settings, workers=tuple(dataclasses.replace(w, core_share_file=path)
                                                       for w in settings.workers))


if __name__ == "__main__":
    sys.exit(main())
