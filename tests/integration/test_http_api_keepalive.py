"""SSE keep-alives: off by default, as in vLLM's server, so a client that strips each network
chunk (as `vllm bench serve` 0.32 does) reads every event of a slow stream. Turned on, a stream
whose first token is slow to come (a queued request, a long prefill) starts anyway and gets
`: keep-alive` comments, so idle-timeout proxies keep it open; a refusal within the keep-alive
interval is still a plain error status."""
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from http_fakes import MODEL_NAME, WordBackend, load_test_tokenizer, model_info, serve, word_server
from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.settings import RouterSettings
from pdserve.router.openai.app import create_app
from pdserve.router.openai.serving import ApiLimits
from pdserve.router.openai.streaming import KEEPALIVE_FRAME

pytestmark = pytest.mark.integration
KEEPALIVE_S = 0.1
LIMITS = ApiLimits(first_output_timeout_s=1.5, output_timeout_s=30.0, keepalive_interval_s=KEEPALIVE_S)
BODY = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    tokenizer = load_test_tokenizer(tmp_path_factory.getbasetemp())
    backend = WordBackend(tokenizer)
    with serve(create_app(backend, tokenizer, model_info(tokenizer), limits=LIMITS)) as url:
        yield url, backend


@pytest.fixture
def backend(server: tuple[str, WordBackend]) -> WordBackend:
    server[1].reset()
    return server[1]


def stream_frames(url: str, body: dict[str, object]) -> tuple[int, list[bytes]]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        return response.status_code, [frame + b"\n\n" for frame in response.read().split(b"\n\n") if frame]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    """A server with the keep-alive interval left at its default."""
    limits = ApiLimits(first_output_timeout_s=10.0, output_timeout_s=30.0)
    with word_server(tmp_path_factory.getbasetemp(), limits=limits) as served:
        yield served


class ChunkStrippingParser:
    """An SSE reader that works as `vllm bench serve` (0.32) does: each network chunk is stripped
    of its surrounding whitespace before it joins the buffer, a message ends at a blank line, a
    trailing `data:` line counts once its JSON is whole, and a message starting with `:` is a
    comment and skipped. A comment that arrives alone so loses its blank line and takes the event
    after it down with it."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        chunk = chunk.strip()
        if not chunk:
            return []
        self.buffer += chunk.decode()
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        tail = self.buffer.removeprefix("data: ").strip()
        if self.buffer.startswith("data: ") and (tail == "[DONE]" or _is_json(tail)):
            messages.append(self.buffer.strip())
            self.buffer = ""
        return [message for message in messages if not message.startswith(":")]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_keepalives_are_off_by_default() -> None:
    assert RouterSettings().sse_keepalive_interval_s == 0
    assert ApiLimits().keepalive_interval_s is None


def test_a_client_that_strips_each_chunk_reads_every_event_of_a_slow_stream(
        default_server: tuple[str, WordBackend]) -> None:
    url, backend = default_server
    backend.reset()
    expected = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).json()["choices"][0]["text"]
    backend.first_output_delay_s = 1.0  # a queued request
    parser, messages = ChunkStrippingParser(), []
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            messages += parser.feed(chunk)
    assert messages[-1] == "data: [DONE]" and all(m.startswith("data: ") for m in messages)
    text = "".join(choice["text"] for m in messages[:-1] for choice in json.loads(m.removeprefix("data: "))["choices"])
    assert text == expected != ""


def test_a_slow_first_token_gets_keepalives_then_the_whole_answer(server: tuple[str, WordBackend],
                                                                    backend: WordBackend) -> None:
    status, prompt_frames = stream_frames(server[0], BODY)
    assert status == 200 and KEEPALIVE_FRAME not in prompt_frames  # answered within the interval
    backend.first_output_delay_s = 8 * KEEPALIVE_S
    status, slow_frames = stream_frames(server[0], BODY)
    assert status == 200
    num_keepalives = slow_frames.count(KEEPALIVE_FRAME)
    assert num_keepalives >= 2 and slow_frames[:num_keepalives] == [KEEPALIVE_FRAME] * num_keepalives
    assert text_of(slow_frames[num_keepalives:]) == text_of(prompt_frames) != ""
    assert slow_frames[-1] == prompt_frames[-1] == b"data: [DONE]\n\n"


def test_the_openai_client_reads_through_keepalives(server: tuple[str, WordBackend], backend: WordBackend) -> None:
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)
    expected = client.completions.create(**BODY).choices[0].text
    backend.first_output_delay_s = 5 * KEEPALIVE_S
    chunks = client.completions.create(**BODY, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected


def test_a_refusal_within_the_interval_is_still_a_plain_status(server: tuple[str, WordBackend],
                                                                backend: WordBackend) -> None:
    backend.fail_on_start = WorkerUnavailableError("fake:1", "shutting down")
    status, frames = stream_frames(server[0], BODY)
    assert status == 503 and KEEPALIVE_FRAME not in frames


def test_no_first_token_within_its_timeout_ends_the_started_stream_with_an_error_frame(
        server: tuple[str, WordBackend], backend: WordBackend) -> None:
    backend.hang_after = 0
    status, frames = stream_frames(server[0], BODY)
    assert status == 200 and frames[0] == KEEPALIVE_FRAME
    assert b'"code":504' in frames[-2].replace(b" ", b"") and frames[-1] == b"data: [DONE]\n\n"
    assert backend.closed_early.wait(10)


def text_of(frames: list[bytes]) -> str:
    """The streamed completion text; every frame must be a data frame."""
    chunks = [frame.removeprefix(b"data: ").strip() for frame in frames]
    assert all(frame.startswith(b"data: ") for frame in frames)
    return "".join(choice["text"] for chunk in chunks if chunk != b"[DONE]" for choice in json.loads(chunk)["choices"])
