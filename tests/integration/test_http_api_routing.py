"""The HTTP API over a routed backend (scripted workers): the route header, one entry per
prompt; session affinity by header; routing series on /metrics."""
import asyncio
from collections.abc import Iterator

import httpx
import pytest

from http_fakes import load_test_tokenizer, serve
from pdserve.common.stats import WorkerRole
from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.app import create_app
from pdserve.router.routing.cluster import Cluster, ClusterConfig
from pdserve.router.routing.planner import Planner, RoutingConfig
from pdserve.router.routing.routed_backend import RoutedBackend
from pdserve.router.routing.worker_pool import PoolConfig
from tests.unit.router.routing.cluster_fakes import TPB, FakeWorker, info
from tests.unit.router.routing.test_routed_backend import NoEvents

pytestmark = pytest.mark.integration
WORKERS = ("a:1", "b:2")


def routed_backend(session_header: str | None) -> RoutedBackend:
    """Round robin over two scripted workers, so consecutive requests alternate."""
    workers = {a: FakeWorker(a, info(WorkerRole.BOTH, max_len=256)) for a in WORKERS}

    async def start() -> RoutedBackend:
        config = ClusterConfig(WORKERS, PoolConfig(poll_interval_s=3600.0, wait_timeout_s=0.0))
        cluster = Cluster(config, workers.__getitem__, lambda address: NoEvents())
        model = await cluster.start()
        planner = Planner(cluster.pool, cluster.index, RoutingConfig(policy="round_robin"), TPB)
        return RoutedBackend(cluster, planner, model, session_header)

    return asyncio.run(start())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_test_tokenizer(tmp_path_factory.getbasetemp())


@pytest.fixture
def url(tokenizer: Tokenizer) -> Iterator[str]:
    backend = routed_backend("X-Session-Id")
    with serve(create_app(backend, tokenizer, asyncio.run(backend.info()), routing=backend)) as base_url:
        yield base_url


def complete(url: str, prompt: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers or {},
                      timeout=10.0)


def test_each_prompts_route_is_in_the_response_header(url: str) -> None:
    response = complete(url, [[5] * 9, [6] * 20])
    assert response.status_code == 200
    assert response.headers["x-pdserve-route"] == (
        "decode=a:1;decode_overlap=0;prompt_blocks=3, decode=b:2;decode_overlap=0;prompt_blocks=5")


def test_a_streamed_response_carries_its_route_too(url: str) -> None:
    body = {"prompt": [5] * 9, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10.0) as response:
        assert response.headers["x-pdserve-route"] == "decode=a:1;decode_overlap=0;prompt_blocks=3"


def test_a_session_keeps_its_worker(url: str) -> None:
    def worker(session: str) -> str:
        route = complete(url, [5] * 9, {"X-Session-Id": session}).headers["x-pdserve-route"]
        return route.split(";")[0]

    assert [worker("s1"), worker("s2"), worker("s1"), worker("s2"), worker("s1")] == [
        "decode=a:1", "decode=b:2", "decode=a:1", "decode=b:2", "decode=a:1"]


def test_an_overlong_session_id_is_refused_by_name(url: str) -> None:
    response = complete(url, [5] * 9, {"X-Session-Id": "x" * 300})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-Session-Id"


def test_metrics_count_routed_requests_per_worker(url: str) -> None:
    complete(url, [5] * 9)
    complete(url, [5] * 9)
    body = httpx.get(f"{url}/metrics", timeout=10.0).text
    assert 'pdserve_router_routed_requests_total{role="decode",worker="a:1"} 1.0' in body
    assert 'pdserve_router_routed_requests_total{role="decode",worker="b:2"} 1.0' in body
    assert 'pdserve_router_worker_up{role="both",worker="a:1"} 1.0' in body
