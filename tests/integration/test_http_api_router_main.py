"""`pdserve router` as a real process, talking gRPC to a real worker server (whose engine is
`WordBackend`): start, serve completions, abort on disconnect across gRPC, stop on SIGINT."""
import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from http_fakes import STATS, WORDS, WordBackend, greedy_word, load_test_tokenizer, model_info
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, ModelInfo
from pdserve.models.tokenizer import Tokenizer
from pdserve.worker.server import WorkerServer
from tests.integration.stack import free_port

pytestmark = pytest.mark.integration
START_TIMEOUT_S = 60.0
WAIT_S = 10.0


class WordEngine:
    """`WordBackend` behind the worker's `AsyncEngine` protocol."""

    def __init__(self, backend: WordBackend) -> None:
        self.backend = backend

    def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                 prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        return self.backend.generate(request)

    async def abort(self, request_id: RequestId) -> None:
        await self.backend.abort(request_id)

    def stats(self) -> EngineStats:
        return STATS

    def info(self) -> ModelInfo:
        return model_info(self.backend.tokenizer)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_test_tokenizer(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def worker(tokenizer: Tokenizer) -> Iterator[tuple[int, WordBackend]]:
    """A gRPC worker server on loopback, in a thread with its own event loop."""
    backend = WordBackend(tokenizer)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> WorkerServer:  # grpc.aio binds a server to the loop that creates it
        server = WorkerServer(WordEngine(backend), "127.0.0.1", 0)  # type: ignore[arg-type]
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=WAIT_S)
    port = server.port
    try:
        yield port, backend
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(timeout=WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=WAIT_S)


@pytest.fixture(scope="module")
def router(worker: tuple[int, WordBackend]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "router", "--worker", f"127.0.0.1:{worker[0]}",
         "--port", str(port), "--served-model-name", "words", "/models/words", "--log-level", "warning", "--insecure-internal"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)


def wait_until_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"router not healthy within {START_TIMEOUT_S} s")


def test_completion_through_grpc(router: tuple[str, subprocess.Popen[bytes]], tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Over gRPC", add_special_tokens=True)
    with openai.OpenAI(base_url=f"{router[0]}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        out = client.completions.create(model="words", prompt="Over gRPC", max_tokens=4, temperature=0, seed=1)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="words", prompt="Over gRPC", max_tokens=4, temperature=0, stream=True))
    expected = "".join(WORDS[greedy_word(tuple(prompt_ids), step)] for step in range(4))
    assert (out.choices[0].text, streamed) == (expected, expected)
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_every_served_name_is_listed_and_accepted_and_the_first_reported(
        router: tuple[str, subprocess.Popen[bytes]]) -> None:
    with openai.OpenAI(base_url=f"{router[0]}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        assert [m.id for m in client.models.list().data] == ["words", "/models/words"]
        out = client.completions.create(model="/models/words", prompt="Over gRPC", max_tokens=2, temperature=0)
        assert out.model == "words"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="/models/other", prompt="Over gRPC", max_tokens=2)


def test_disconnect_reaches_the_worker(router: tuple[str, subprocess.Popen[bytes]],
                                       worker: tuple[int, WordBackend]) -> None:
    backend = worker[1]
    backend.reset()
    backend.hang_after = 2
    with httpx.Client(base_url=router[0], timeout=30.0) as http:
        body = {"model": "words", "prompt": "x", "max_tokens": 8, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert next(response.iter_lines()).startswith("data: ")
    assert backend.closed_early.wait(WAIT_S)


def test_a_loopback_router_answers_only_requests_naming_a_loopback_host(
        router: tuple[str, subprocess.Popen[bytes]]) -> None:
    """A web page whose name was re-pointed at 127.0.0.1 (DNS rebinding) names its own host."""
    body = {"model": "words", "prompt": "Hi", "max_tokens": 1}
    rebound = httpx.post(f"{router[0]}/v1/completions", json=body, headers={"Host": "attacker.example:8000"},
                         timeout=30)
    assert rebound.status_code == 400 and "is not served here" in rebound.json()["error"]["message"]
    port = router[0].rsplit(":", 1)[1]
    assert httpx.post(f"{router[0]}/v1/completions", json=body, headers={"Host": f"localhost:{port}"},
                      timeout=30).status_code == 200


def test_sigterm_stops_the_router_cleanly(router: tuple[str, subprocess.Popen[bytes]]) -> None:
    process = router[1]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=WAIT_S * 2) == 0
