"""`pdserve serve`: the router and one worker (role both) as two processes.

Starts the worker and waits for its gRPC health, starts the router and waits for its HTTP
`/health`, prints the URL and a curl line, then watches both. Ctrl-C or SIGTERM stops both
(router first); a child that dies stops the other and makes `serve` exit 1 with one line.
"""
import json
import shlex
import sys
import urllib.error
import urllib.request

from pdserve.common.errors import ConfigError
from pdserve.common.settings import ServeSettings, child_environ, resolve_serve_settings, to_argv
from pdserve.rpc.probe import is_worker_serving
from pdserve.supervisor import ChildFailedError, ChildSpec, StopRequested, Supervisor

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


def child_specs(settings: ServeSettings) -> list[ChildSpec]:
    """The worker, then the router: each run as `python -m pdserve.cli <kind> <flags>` with
    every setting as a flag, so the child resolves exactly what this process resolved."""
    env = child_environ()
    command = (sys.executable, "-m", "pdserve.cli")
    address, url = settings.worker.address, base_url(settings)
    return [
        ChildSpec("worker", (*command, "worker", *to_argv(settings.worker)),
                  lambda: is_worker_serving(address, PROBE_TIMEOUT_S), env),
        ChildSpec("router", (*command, "router", *to_argv(settings.router)),
                  lambda: is_http_healthy(url), env),
    ]


def ready_banner(settings: ServeSettings) -> str:
    url = base_url(settings)
    body = json.dumps({"model": settings.worker.model_name, "prompt": EXAMPLE_PROMPT, "max_tokens": 16})
    curl = (f"curl -s {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")
    return (f"pdserve is ready at {url} (model {settings.worker.model_name}); Ctrl-C stops it.\n"
            f"Try:\n  {curl}")


def run(specs: list[ChildSpec], banner: str, supervisor: Supervisor) -> int:
    """Start each child in order, print `banner`, watch, and always stop every child.
    Returns the exit status: 0 after a stop signal, 1 after a child failed."""
    try:
        for spec in specs:
            supervisor.start(spec)
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
    except ConfigError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    supervisor = Supervisor(settings.startup_timeout_s, settings.shutdown_timeout_s)
    supervisor.install_signal_handlers()
    return run(child_specs(settings), ready_banner(settings), supervisor)


if __name__ == "__main__":
    sys.exit(main())
