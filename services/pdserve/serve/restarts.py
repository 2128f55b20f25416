"""What `pdserve serve` tells an operator about restarted workers: one line on stderr per death,
restart and recovery, and `pdserve_worker_restarts_total{worker, role}` on the launcher's own
`/metrics` (`--serve-metrics-port`), as a process supervisor's restart count (Kubernetes'
`kube_pod_container_status_restarts_total`) sits beside, not inside, the servers it restarts.
"""
import sys
from collections.abc import Mapping
from typing import TextIO

from prometheus_client import CollectorRegistry, Counter

from pdserve.common.api_keys import ApiKeys
from pdserve.common.metrics_http import serve_metrics


class WorkerRestarts:
    """A `RestartListener` for serve's workers; `labels` maps a child's name to its metric labels."""

    def __init__(self, labels: Mapping[str, Mapping[str, str]], out: TextIO = sys.stderr) -> None:
        self.registry = CollectorRegistry()
        self._restarts = Counter("pdserve_worker_restarts", "Workers pdserve serve restarted after they exited",
                                 ["worker", "role"], registry=self.registry)
        self._labels = labels
        self._out = out
        for name in labels:
            self._restarts.labels(**labels[name])  # every worker shows 0 before its first restart

    def serve(self, host: str, port: int, keys: ApiKeys | None = None) -> int:
        """Serve /metrics on `host:port` (0: any free port), to callers with one of `keys` when
        given; returns the bound port."""
        return serve_metrics(self.registry, host, port, keys)

    def child_died(self, name: str, exit_code: int, backoff_s: float, num_deaths_in_a_row: int) -> None:
        self._say(f"{name} exited with code {exit_code}; restarting it in {backoff_s:g} s "
                  f"(death {num_deaths_in_a_row} in a row)")

    def child_restarted(self, name: str, pid: int) -> None:
        self._restarts.labels(**self._labels[name]).inc()
        self._say(f"{name} restarted (pid {pid})")

    def child_ready(self, name: str) -> None:
        self._say(f"{name} is ready again")

    def _say(self, line: str) -> None:
        print(f"pdserve serve: {line}", file=self._out, flush=True)
