"""Schemathesis against the real router's `/openapi.json`: valid and invalid bodies for every
operation. No answer is a 5xx, every error is OpenAI's envelope with a bounded message, and
afterwards the worker's KV cache is intact and it still answers a normal request."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from pdserve.router.openai.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS
from tests.fuzz.worker_calls import MAX_TOKENS, PROMPT, FuzzStack, assert_worker_sound

pytestmark = pytest.mark.integration
MAX_EXAMPLES = 75  # per operation and generation mode: with the gRPC runs, about a minute on 2 cores
MAX_ERROR_BODY_BYTES = 4 * (MAX_MESSAGE_CHARS + MAX_PARAM_CHARS) + 256  # JSON escapes a character to <= 6 bytes


@pytest.fixture(scope="module")
def api_schema(fuzz_stack: FuzzStack) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_stack.router_url}/openapi.json", timeout=10)


def test_the_schema_describes_the_request_bodies(api_schema: schemathesis.BaseSchema) -> None:
    body = api_schema.raw_schema["components"]["schemas"]
    assert {"prompt", "max_tokens", "n", "stream"} <= set(body["CompletionRequest"]["properties"])
    assert {"messages", "max_completion_tokens"} <= set(body["ChatCompletionRequest"]["properties"])
    operations = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")} <= operations


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_server_error_and_bounded_error_bodies(api_schema: schemathesis.BaseSchema, fuzz_stack: FuzzStack,
                                                  mode: GenerationMode) -> None:
    """Schemathesis' bodies, headers and query strings for every operation (negative: each breaks the schema)."""
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.POSITIVE or len(operation.body):  # no input to break in a bare GET
            _fuzz(operation, mode, fuzz_stack.router_url)


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str) -> None:
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def answers_without_a_server_error(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            assert len(response.content) <= MAX_ERROR_BODY_BYTES, response.content[:200]
            error = response.json()["error"]
            assert len(error["message"]) <= MAX_MESSAGE_CHARS
            assert error["code"] == response.status_code

    answers_without_a_server_error()


HUGE = 300_000  # characters or tokens: far past the context and any echo bound, within the body limit


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "never mind " * (HUGE // 11)}),
    ("/v1/completions", {"prompt": [99_999_999] * (HUGE // 10)}),
    ("/v1/completions", {"prompt": "hi", "model": "m" * HUGE}),
    ("/v1/completions", {"prompt": "hi", "stop": ["s" * HUGE]}),
    ("/v1/completions", {"prompt": "hi", "user": "u" * HUGE, "cache_salt": "c" * HUGE}),
    ("/v1/completions", {"prompt": ["x" * HUGE, 5]}),
    ("/v1/chat/completions", {"messages": [{"role": "r" * HUGE, "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c" * HUGE}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"t" * HUGE: 1}]}),
], ids=["text-prompt", "token-prompt", "model", "stop", "user-and-salt", "mixed-batch", "role", "content", "tools"])
def test_a_huge_invalid_value_gets_a_small_error(fuzz_stack: FuzzStack, path: str, body: dict[str, object]) -> None:
    response = httpx.post(f"{fuzz_stack.router_url}{path}", json=body, timeout=120)
    assert response.status_code == 400, response.text[:200]
    assert len(response.content) <= MAX_ERROR_BODY_BYTES


def test_a_huge_request_id_gets_a_small_error(fuzz_stack: FuzzStack) -> None:
    response = httpx.post(f"{fuzz_stack.router_url}/v1/completions", json={"prompt": "hi"},
                          headers={"X-Request-Id": "r" * 60_000}, timeout=60)
    assert response.status_code == 400, response.text[:200]
    assert len(response.content) <= MAX_ERROR_BODY_BYTES


def test_the_stack_is_sound_after_the_http_fuzz(fuzz_stack: FuzzStack) -> None:
    baseline = fuzz_stack.baselines[fuzz_stack.worker]
    assert_worker_sound(fuzz_stack.worker, baseline.integrity, baseline.tokens)
    assert httpx.get(f"{fuzz_stack.router_url}/health/ready", timeout=10).status_code == 200
    response = httpx.post(f"{fuzz_stack.router_url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
