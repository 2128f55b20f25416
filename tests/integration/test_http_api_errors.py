"""Every class of bad input answers with OpenAI's envelope and the right status — never 422 or 500."""
from collections.abc import Iterator

import httpx
import openai
import pytest

from http_fakes import MAX_MODEL_LEN, MODEL_NAME, WordBackend, load_test_tokenizer, model_info, serve
from pdserve.common.errors import InvalidRequestError, WorkerUnavailableError
from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.app import create_app
from pdserve.router.openai.serving import ApiLimits

pytestmark = pytest.mark.integration
MAX_BODY_BYTES = 4096


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_test_tokenizer(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(tokenizer: Tokenizer) -> Iterator[tuple[str, WordBackend]]:
    backend = WordBackend(tokenizer)
    app = create_app(backend, tokenizer, model_info(tokenizer), limits=ApiLimits(max_body_bytes=MAX_BODY_BYTES))
    with serve(app) as url:
        yield url, backend


@pytest.fixture
def backend(server: tuple[str, WordBackend]) -> WordBackend:
    server[1].reset()
    return server[1]


@pytest.fixture
def http(server: tuple[str, WordBackend], backend: WordBackend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=30.0) as client:
        yield client


def envelope(status: int, err_type: str, message: str, param: str | None) -> dict[str, object]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def bad(message: str, param: str | None) -> dict[str, object]:
    return envelope(400, "BadRequestError", message, param)


def post(http: httpx.Client, path: str, content: bytes | str) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("body", "expected"), [
    ('{"prompt": "hi"', bad("malformed JSON body: EOF while parsing an object at line 1 column 15", None)),
    ("", bad("request body is empty; expected a JSON object", None)),
    ('["hi"]', bad("request body must be a JSON object", None)),
    ("{}", bad("missing required field 'prompt'", "prompt")),
    ('{"prompt": 5}', bad(
        "invalid value for 'prompt': Input should be a valid string or a valid array (got 5)", "prompt")),
    ('{"prompt": "hi", "max_tokens": "5"}', bad(
        "invalid value for 'max_tokens': Input should be a valid integer (got '5')", "max_tokens")),
    ('{"prompt": "hi", "temperature": NaN}', bad(
        "invalid value for 'temperature': Input should be a finite number (got nan)", "temperature")),
    ('{"prompt": "hi", "stream": "yes"}', bad(
        "invalid value for 'stream': Input should be a valid boolean (got 'yes')", "stream")),
    ('{"prompt": "hi", "max_tokens": -1}', bad(
        "invalid value for 'max_tokens': Input should be greater than or equal to 0 (got -1)", "max_tokens")),
    ('{"prompt": "hi", "max_tokens": 0}', bad(
        "'max_tokens' may be 0 only with 'echo' (the prompt alone, as vLLM answers it)", "max_tokens")),
    ('{"prompt": "hi", "temperature": 2.5}', bad(
        "invalid value for 'temperature': Input should be less than or equal to 2 (got 2.5)", "temperature")),
    ('{"prompt": "hi", "top_p": 0}', bad(
        "invalid value for 'top_p': Input should be greater than 0 (got 0)", "top_p")),
    ('{"prompt": "hi", "n": 0}', bad("invalid value for 'n': Input should be greater than or equal to 1 (got 0)", "n")),
    ('{"prompt": "hi", "logprobs": 21}', bad(
        "invalid value for 'logprobs': Input should be less than or equal to 20 (got 21)", "logprobs")),
    ('{"prompt": "hi", "priority": 101}', bad(
        "invalid value for 'priority': Input should be less than or equal to 100 or a valid array (got 101)",
        "priority")),
    ('{"prompt": "hi", "suffix": "x"}', bad("'suffix' is not supported by this server", "suffix")),
    ('{"prompt": "hi", "presence_penalty": 2.5}', bad(
        "invalid value for 'presence_penalty': Input should be less than or equal to 2 (got 2.5)",
        "presence_penalty")),
    ('{"prompt": "hi", "repetition_penalty": 0}', bad(
        "invalid value for 'repetition_penalty': Input should be greater than 0 (got 0)", "repetition_penalty")),
    ('{"prompt": "hi", "logit_bias": {"49152": 5}}', bad(
        "logit_bias names token id 49152, outside the vocabulary [0, 49152)", "logit_bias")),
    ('{"prompt": "hi", "max_tokens": 3, "min_tokens": 4}', bad(
        "min_tokens (4) must be less than or equal to max_tokens (3)", "min_tokens")),
    ('{"prompt": "hi", "bad_words": [" "]}', bad("bad_words[0] (' ') has no tokens", "bad_words[0]")),
    ('{"prompt": "hi", "lora_id": 3}', bad("'lora_id' is not supported by this server; leave it unset", "lora_id")),
    ('{"prompt": "hi", "stream_options": {"include_usage": true}}', bad(
        "'stream_options' is only allowed when 'stream' is true", "stream_options")),
    ('{"prompt": [1, 99999999]}', bad(
        "token id 99999999 at prompt[1] is outside the vocabulary [0, 49152)", "prompt")),
    ('{"prompt": []}', bad("'prompt' must not be empty", "prompt")),
    ('{"prompt": [""]}', bad("'prompt' must contain at least one token", "prompt")),
    ('{"prompt": "hi", "stop": ["", "x"]}', bad("each stop string must have 1 to 256 characters", "stop")),
    ('{"prompt": "hi", "priority": [{"start": 0, "end": 50, "priority": 80}]}', bad(
        "priority[0] covers tokens [0, 50) outside the prompt's 1 tokens", "priority[0]")),
])
def test_bad_completion_bodies(http: httpx.Client, body: str, expected: dict[str, object]) -> None:
    response = post(http, "/v1/completions", body)
    assert (response.status_code, response.json()) == (400, expected)


@pytest.mark.parametrize(("body", "expected"), [
    ('{"messages": []}', bad(
        "invalid value for 'messages': List should have at least 1 item after validation, not 0 (got [])",
        "messages")),
    ('{"messages": [{"role": "robot", "content": "x"}]}', bad(
        "invalid value for 'messages[0].role': Input should be 'system', 'developer', 'user', 'assistant' or "
        "'tool' (got 'robot')", "messages[0].role")),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', bad(
        "invalid value for 'messages[0].content[0].type': Input should be 'text' (got 'image_url')",
        "messages[0].content[0].type")),
    ('{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', bad(
        "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', bad(
        "missing required field 'tools[0].function'", "tools[0].function")),
])
def test_bad_chat_bodies(http: httpx.Client, body: str, expected: dict[str, object]) -> None:
    response = post(http, "/v1/chat/completions", body)
    assert (response.status_code, response.json()) == (400, expected)


def test_prompt_longer_than_the_context(http: httpx.Client) -> None:
    response = post(http, "/v1/completions", '{"prompt": [%s]}' % ", ".join(["7"] * MAX_MODEL_LEN))
    assert (response.status_code, response.json()) == (400, bad(
        f"this model's maximum context length is {MAX_MODEL_LEN} tokens, but 'prompt' has {MAX_MODEL_LEN} "
        "tokens, leaving no room to generate; shorten it", "prompt"))


def test_max_tokens_beyond_the_context(http: httpx.Client) -> None:
    response = post(http, "/v1/completions", '{"prompt": [7, 7, 7], "max_tokens": 126}')
    assert (response.status_code, response.json()) == (400, bad(
        f"this model's maximum context length is {MAX_MODEL_LEN} tokens, but 3 prompt tokens plus "
        "max_tokens=126 would need 129; reduce the prompt or 'max_tokens'", "max_tokens"))


def test_max_completion_tokens_beyond_the_context_is_named(http: httpx.Client) -> None:
    response = post(http, "/v1/chat/completions",
                    '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}')
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_completion_tokens"


def test_unknown_model_is_404(http: httpx.Client) -> None:
    response = post(http, "/v1/completions", '{"model": "gpt-9", "prompt": "hi"}')
    assert (response.status_code, response.json()) == (404, envelope(
        404, "NotFoundError", f"the model 'gpt-9' does not exist; this server serves '{MODEL_NAME}'", "model"))


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    response = post(http, "/v1/completions", '{"prompt": "%s"}' % ("a" * MAX_BODY_BYTES))
    assert (response.status_code, response.json()) == (413, envelope(
        413, "RequestTooLargeError", f"request body exceeds {MAX_BODY_BYTES} bytes", None))


def test_unknown_route_and_wrong_method_use_the_envelope(http: httpx.Client) -> None:
    missing = http.get("/v1/nothing")
    wrong_method = http.get("/v1/completions")
    assert (missing.status_code, missing.json()) == (404, envelope(404, "NotFoundError", "Not Found", None))
    assert (wrong_method.status_code, wrong_method.json()) == (
        405, envelope(405, "MethodNotAllowedError", "Method Not Allowed", None))


def test_echoed_input_is_clipped(http: httpx.Client) -> None:
    response = post(http, "/v1/completions", '{"prompt": "hi", "user": ["%s"]}' % ("u" * 3000))
    assert (response.status_code, response.json()) == (400, bad(
        "invalid value for 'user': Input should be a valid string (got " + repr(["u" * 3000])[:77] + "...)",
        "user"))


def test_worker_refusal_is_400_naming_its_field(http: httpx.Client, backend: WordBackend) -> None:
    backend.fail_on_start = InvalidRequestError("top_k too large for this worker", "top_k")
    response = post(http, "/v1/completions", '{"prompt": "hi"}')
    assert (response.status_code, response.json()) == (400, bad("top_k too large for this worker", "top_k"))


def test_unavailable_worker_is_503(http: httpx.Client, backend: WordBackend) -> None:
    backend.fail_on_start = WorkerUnavailableError("127.0.0.1:1", "connection refused")
    response = post(http, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "stream": true}')
    assert (response.status_code, response.json()) == (503, envelope(
        503, "ServiceUnavailableError",
        "generation service unavailable: worker 127.0.0.1:1 unavailable: connection refused", None))


def test_openai_client_raises_typed_errors(http: httpx.Client) -> None:
    with openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as bad_request:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1000)
        with pytest.raises(openai.NotFoundError) as not_found:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert bad_request.value.status_code == 400
    assert bad_request.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert not_found.value.body["param"] == "model"  # type: ignore[index]


def test_unprintable_or_huge_request_id_is_refused(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "r" * 300})
    assert (response.status_code, response.json()) == (400, bad(
        "X-Request-Id must be at most 256 printable characters", "X-Request-Id"))
    assert response.headers["x-request-id"].startswith("cmpl-")


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'),
    ("/tokenize", '{"prompt": "hi"}'),
], ids=["completions", "chat", "tokenize"])
def test_a_body_that_is_not_said_to_be_json_is_415(http: httpx.Client, path: str, body: str,
                                                    content_type: str) -> None:
    """What a web page may post cross-site without the browser asking first is refused, unread."""
    response = http.post(path, content=body, headers={"content-type": content_type})
    assert response.json() == envelope(
        415, "UnsupportedMediaType",
        f"Content-Type {content_type!r} is not accepted: send the body as application/json", None)
    for fine in ("application/json; charset=utf-8", None):  # as FastAPI, a body of no stated type is read
        headers = {"content-type": fine} if fine else {}
        assert http.post(path, content=body, headers=headers).status_code == 200
