"""Failures around streams: in-band error frames, bounded waits, and client disconnects that
must stop the router from consuming the worker's stream (so the worker aborts)."""
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from http_fakes import MODEL_NAME, WordBackend, load_test_tokenizer, model_info, serve
from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.app import create_app
from pdserve.router.openai.serving import ApiLimits

pytestmark = pytest.mark.integration
LIMITS = ApiLimits(first_output_timeout_s=0.5, output_timeout_s=0.5)
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "temperature": 0}
WAIT_S = 10.0  # bound on waiting for the server thread to notice something


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    tokenizer: Tokenizer = load_test_tokenizer(tmp_path_factory.getbasetemp())
    backend = WordBackend(tokenizer)
    with serve(create_app(backend, tokenizer, model_info(tokenizer), limits=LIMITS)) as url:
        yield url, backend


@pytest.fixture(scope="module")
def patient_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    """Waits a minute for the worker: only a disconnect can close its streams within `WAIT_S`."""
    tokenizer: Tokenizer = load_test_tokenizer(tmp_path_factory.getbasetemp())
    backend = WordBackend(tokenizer)
    limits = ApiLimits(first_output_timeout_s=60.0, output_timeout_s=60.0)
    with serve(create_app(backend, tokenizer, model_info(tokenizer), limits=limits)) as url:
        yield url, backend


@pytest.fixture
def patient(patient_server: tuple[str, WordBackend]) -> tuple[str, WordBackend]:
    patient_server[1].reset()
    return patient_server


@pytest.fixture
def backend(server: tuple[str, WordBackend]) -> WordBackend:
    server[1].reset()
    return server[1]


@pytest.fixture
def http(server: tuple[str, WordBackend], backend: WordBackend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=30.0) as client:
        yield client


def data_frames(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def test_failure_after_the_stream_started_sends_an_error_frame_then_done(http: httpx.Client,
                                                                          backend: WordBackend) -> None:
    backend.fail_after = 2
    response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    frames = data_frames(response)
    assert response.status_code == 200
    assert len(frames) == 5
    chunks = [json.loads(f)["choices"][0] for f in frames[:3]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert [(c["delta"]["content"] != "", c["finish_reason"]) for c in chunks[1:]] == [(True, None)] * 2
    assert json.loads(frames[3]) == {"error": {
        "message": "the fake worker failed on purpose", "type": "InternalServerError", "param": None, "code": 500}}
    assert frames[4] == "[DONE]"


def test_openai_client_raises_on_an_error_frame(server: tuple[str, WordBackend], backend: WordBackend) -> None:
    backend.fail_after = 1
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0) as client:
        stream = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, stream=True)
        with pytest.raises(openai.APIError, match="the fake worker failed on purpose"):
            list(stream)


def test_failure_before_the_first_output_is_a_plain_error_status(http: httpx.Client, backend: WordBackend) -> None:
    backend.fail_after = 0
    response = http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert (response.status_code, response.json()) == (500, {"error": {
        "message": "the fake worker failed on purpose", "type": "InternalServerError", "param": None, "code": 500}})


def test_silent_worker_is_504_and_its_stream_is_closed(http: httpx.Client, backend: WordBackend) -> None:
    backend.hang_after = 0
    response = http.post("/v1/completions", json={"prompt": "x"})
    assert (response.status_code, response.json()) == (504, {"error": {
        "message": "no output from the generation service within 0.5 s", "type": "GatewayTimeoutError",
        "param": None, "code": 504}})
    assert backend.closed_early.wait(WAIT_S)


def test_worker_stalling_mid_stream_is_a_504_frame(http: httpx.Client, backend: WordBackend) -> None:
    backend.hang_after = 2
    frames = data_frames(http.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 5}))
    assert len(frames) == 4
    assert json.loads(frames[2])["error"]["code"] == 504
    assert frames[3] == "[DONE]"


def test_client_disconnect_mid_stream_closes_the_worker_stream(patient: tuple[str, WordBackend]) -> None:
    url, backend = patient
    backend.hang_after = 3
    with httpx.Client(base_url=url, timeout=30.0) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
            assert next(response.iter_lines()).startswith("data: ")
    assert backend.closed_early.wait(WAIT_S)
    assert backend.closed_ids == [backend.requests[0].request_id]


def test_client_disconnect_while_waiting_closes_the_worker_stream(patient: tuple[str, WordBackend]) -> None:
    url, backend = patient
    backend.hang_after = 1
    with httpx.Client(base_url=url, timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert backend.closed_early.wait(WAIT_S)
    assert backend.closed_ids == [backend.requests[0].request_id]


def test_health_and_metrics_when_the_worker_does_not_answer(http: httpx.Client, backend: WordBackend) -> None:
    backend.stats_error = ConnectionError("gone")
    health = http.get("/health")
    ready = http.get("/health/ready")
    metrics = http.get("/metrics")
    assert (health.status_code, health.json()) == (503, {"error": {
        "message": "not ready: the generation service is not answering (ConnectionError)",
        "type": "ServiceUnavailableError",
        "param": None, "code": 503}})
    assert (ready.status_code, ready.json()) == (503, health.json())
    assert http.get("/health/live").status_code == 200
    assert metrics.status_code == 200  # the router's own figures need no worker
    assert "pdserve_http_requests_total" in metrics.text


def test_client_disconnect_before_the_first_token_closes_the_worker_stream(
        patient: tuple[str, WordBackend]) -> None:
    url, backend = patient
    backend.hang_after = 0
    with httpx.Client(base_url=url, timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert backend.closed_early.wait(WAIT_S)
    assert backend.closed_ids == [backend.requests[0].request_id]
