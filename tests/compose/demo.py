"""The shipped docker-compose.yml brought up under a project name of its own, with an override
file holding only what this machine lacks (where the images come from) and free host ports."""
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.compose.docker_host import DockerHost
from tests.integration.stack import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PREFILL_SERVICES = ("prefill-a", "prefill-b")  # both behind the DNS name `prefill` the router resolves
PDSERVE_SERVICES = ("certs", "router", *PREFILL_SERVICES, "decode")  # all run the pdserve image
PROJECT_PREFIX = "pdservetest"
READY_TIMEOUT_S = 300.0
METRICS_SNIPPET = ("import urllib.request; "
                   "print(urllib.request.urlopen('http://127.0.0.1:9100/metrics', timeout=10).read().decode())")


@dataclass
class Demo:
    host: DockerHost
    override: Path
    services: tuple[str, ...]
    project: str = field(default_factory=lambda: f"{PROJECT_PREFIX}{uuid.uuid4().hex[:8]}")
    ports: dict[str, int] = field(default_factory=lambda: {name: free_port() for name in
                                                           ("PDSERVE_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT")})
    is_up: bool = False
    volumes_before: set[str] = field(default_factory=set)  # the engine's volumes before `up`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['PDSERVE_PORT']}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}"

    @property
    def grafana_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['GRAFANA_PORT']}"

    def compose(self, *args: str, timeout: float = READY_TIMEOUT_S):
        files = ["-f", str(COMPOSE_FILE), "-f", str(self.override)]
        env = {name: str(port) for name, port in self.ports.items()}
        return self.host.compose("-p", self.project, *files, *args, env=env, timeout=timeout)

    def up(self) -> None:
        self.is_up = True
        self.compose("up", "-d", *self.services)
        wait_until(lambda: httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200, READY_TIMEOUT_S,
                   "the router answers /v1/models")

    def down(self) -> None:
        """Containers, network and the certificates' volume (`down -v`, as the README says)."""
        self.is_up = False
        self.compose("down", "-v")

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.decode().strip()

    def worker_metrics(self, service: str) -> str:
        """The worker's Prometheus exposition, read inside its container (the port is not published)."""
        return self.host.docker("exec", self.container(service), "python", "-c", METRICS_SNIPPET,
                                timeout=60).stdout.decode()

    def logs(self, service: str) -> str:
        result = self.host.docker("logs", self.container(service), timeout=60)
        return (result.stdout + result.stderr).decode(errors="replace")

    def prometheus(self, query: str) -> list[dict]:
        body = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": query}, timeout=10).json()
        assert body["status"] == "success", f"Prometheus refused {query!r}: {body}"
        return body["data"]["result"]


def remove_stale_demos(host: DockerHost) -> None:
    """Containers and networks of earlier runs that were killed before their `down` (the test's
    own daemon only: on a shared one another run may still be using them)."""
    for listing, removal in ((["ps", "-a"], ["rm", "-f"]), (["network", "ls"], ["network", "rm"])):
        rows = host.docker(*listing, "--filter", "label=com.docker.compose.project",
                           "--format", '{{.ID}} {{.Label "com.docker.compose.project"}}').stdout.decode().splitlines()
        stale = [row.split()[0] for row in rows if len(row.split()) == 2 and row.split()[1].startswith(PROJECT_PREFIX)]
        if stale:
            host.docker(*removal, *stale, check=False)


def write_override(directory: Path, images: dict[str, str]) -> Path:
    """Image sources only: the services' commands, ports and health checks stay the shipped ones."""
    services = {name: {"image": images["pdserve"]} for name in PDSERVE_SERVICES}
    services["prometheus"] = {"image": images["prometheus"]}
    if "grafana" in images:
        services["grafana"] = {"image": images["grafana"]}
    path = directory / "docker-compose.override.yml"
    path.write_text(json.dumps({"services": services}, indent=2))  # JSON is YAML
    return path


def sample(exposition: str, name: str, labels: str = "") -> float:
    key = f"{name}{{{labels}}}" if labels else name
    for line in exposition.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last_error = exc
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what} (last error: {last_error!r})")
