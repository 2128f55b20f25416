"""Fixtures of the compose test: a Docker engine, the demo's images, the demo itself, and the
same prompts answered by `pdserve serve --aggregated` on the host."""
import contextlib
import re
import tempfile
from pathlib import Path

import httpx
import pytest

from pdserve.common.settings import default_cache_dir
from tests.compose.demo import Demo, remove_stale_demos, write_override
from tests.compose.docker_host import DockerHost, DockerUnavailable, open_docker_host
from tests.compose.images import base_image, pdserve_image, prometheus_image, try_pull, wheels
from tests.integration.stack import free_port, start, stop, wait_for_http

CACHE = Path(default_cache_dir()) / "compose"
PROMETHEUS_PUBLIC = "prom/prometheus:v2.53.0"  # the compose file's image
GRAFANA_PUBLIC = "grafana/grafana:11.1.0"
DEMO_SERVICES = ("router", "prefill-a", "prefill-b", "decode", "prometheus")
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    # Long enough (about 300 tokens) that the prefill container computes it and ships its KV.
    " ".join(f"Step {i}: put {i} red apples and {2 * i} green pears into basket number {i}." for i in range(1, 24))
    + " How many apples are there in all?",
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def docker_host():
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        host = open_docker_host(CACHE / "docker")
    except DockerUnavailable as exc:
        pytest.skip(f"Docker cannot run here: {exc}")
    yield host
    host.stop()


@pytest.fixture(scope="module")
def demo_images(docker_host: DockerHost) -> dict[str, str]:
    try:
        base = base_image(docker_host, CACHE)
        images = {"pdserve": pdserve_image(docker_host, base, wheels(CACHE), CACHE),
                  "prometheus": prometheus_image(docker_host, base, PROMETHEUS_PUBLIC, CACHE)}
    except DockerUnavailable as exc:
        pytest.skip(f"the demo's images cannot be made here: {exc}")
    if docker_host.has_image(GRAFANA_PUBLIC) or try_pull(docker_host, GRAFANA_PUBLIC):
        images["grafana"] = GRAFANA_PUBLIC
    return images


@pytest.fixture(scope="module")
def demo(docker_host: DockerHost, demo_images: dict[str, str]):
    with tempfile.TemporaryDirectory() as directory:
        services = DEMO_SERVICES + (("grafana",) if "grafana" in demo_images else ())
        if docker_host.daemon is not None:
            remove_stale_demos(docker_host)
        demo = Demo(docker_host, write_override(Path(directory), demo_images), services)
        demo.volumes_before = set(docker_host.docker("volume", "ls", "-q").stdout.decode().split())
        try:
            demo.up()
            yield demo
        finally:
            if demo.is_up:
                with contextlib.suppress(RuntimeError):  # no decode container when `up` failed early
                    print(demo.logs("decode")[-3000:])
                demo.down()


def complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def kernels_of(log: str) -> str:
    """The kernels a worker logged at start: a native level's name, or torch."""
    found = re.search(r"CPU: native CPU kernels \((\w+)\)", log)
    return found[1] if found else "torch"


@pytest.fixture(scope="module")
def host_server(demo: Demo, tmp_path_factory):
    """`pdserve serve --aggregated` on the host, on the native kernels of the level the containers
    chose (the same CPU): the URL, up until the module's tests are done."""
    port = free_port()
    log = tmp_path_factory.mktemp("reference") / "serve.log"
    server = start(["serve", "--aggregated", "--port", str(port), "--kernels", kernels_of(demo.logs("decode")),
                    "--max-model-len", "2048"], log)
    try:
        wait_for_http(f"http://127.0.0.1:{port}", [server])
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server)


@pytest.fixture(scope="module")
def reference(host_server: str) -> dict[str, dict]:
    """Each prompt's greedy completion from the host's server."""
    return {prompt: complete(host_server, prompt) for prompt in PROMPTS}
