"""Large inputs do not stall the router's event loop: a megabytes-long `/tokenize` (or prompt) is
tokenized on a worker thread with the interpreter lock released, while another client's stream
goes on; a batch with more choices than allowed is refused before any prompt is tokenized."""
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from http_fakes import MODEL_NAME, WordBackend, word_server

pytestmark = pytest.mark.integration
LARGE_TEXT = "The old lighthouse keeper climbed the stairs every night. " * (2 * 2**20 // 58)  # ~2 MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    with word_server(tmp_path_factory.getbasetemp()) as served:
        yield served


def stream_arrivals(url: str, arrivals: list[float], started: threading.Event) -> None:
    body = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 60, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for _ in response.iter_lines():
            arrivals.append(time.monotonic())
            started.set()


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"model": MODEL_NAME, "prompt": LARGE_TEXT}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": LARGE_TEXT, "max_tokens": 1}),  # too long: a 400
], ids=["tokenize", "completion"])
def test_a_stream_goes_on_while_megabytes_are_tokenized(server: tuple[str, WordBackend], route: str,
                                                       body: dict) -> None:
    url, backend = server
    backend.reset()
    backend.token_interval_s = 0.05  # a stream of ~3 s
    arrivals: list[float] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream_arrivals, args=(url, arrivals, started))
    streamer.start()
    assert started.wait(10)
    sent = time.monotonic()
    response = httpx.post(f"{url}{route}", json=body, timeout=60)
    answered = time.monotonic()
    streamer.join(30)
    if route == "/tokenize":
        assert response.status_code == 200 and response.json()["count"] > 100_000
    else:
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent and a < answered]
    assert during, "the stream ended before the large request was answered"
    assert max(during) < 1.0, f"the stream stalled {max(during):.2f} s while {route} was tokenized"


def test_too_many_choices_are_refused_before_any_prompt_is_tokenized(server: tuple[str, WordBackend]) -> None:
    url, backend = server
    backend.reset()
    batch = [[1, 2, 3]] * 299 + [[10**9]]  # the last prompt is out of the vocabulary: reading prompts first names it
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": batch, "max_tokens": 1},
                          timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n" and "exceeds 256 choices" in response.json()["error"]["message"]
    assert backend.requests == []
