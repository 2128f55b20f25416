"""`/tokenize`, `/detokenize`, `/version` and served model names, through the app in process."""
import asyncio

import httpx
import pytest

from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.app import create_app
from pdserve.router.openai.tokenization import pdserve_version

MAX_MODEL_LEN = 64


class NoBackend:
    """The tokenizer routes never call a worker; this one fails the test if they do."""

    async def generate(self, request):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a tokenizer route called the backend")

    async def close(self) -> None:
        pass


def info(tokenizer: Tokenizer) -> ModelInfo:
    return ModelInfo(model_name="worker-name", max_model_len=MAX_MODEL_LEN, tokens_per_block=16,
                     block_hash_algorithm="sha256-v1", role=WorkerRole.BOTH, vocab_size=tokenizer.vocab_size,
                     eos_token_ids=tokenizer.eos_token_ids)


def call(tokenizer: Tokenizer, method: str, path: str, body: object = None,
         names: tuple[str, ...] = ("/models/x", "x")) -> httpx.Response:
    app = create_app(NoBackend(), tokenizer, info(tokenizer), names)  # type: ignore[arg-type]

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(run())


def test_tokenize_a_prompt_as_completions_would(tokenizer: Tokenizer) -> None:
    response = call(tokenizer, "POST", "/tokenize", {"model": "x", "prompt": "Hello world"})
    tokens = tokenizer.encode("Hello world", add_special_tokens=True)
    assert response.status_code == 200
    assert response.json() == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}


def test_tokenize_returns_token_strings_when_asked(tokenizer: Tokenizer) -> None:
    body = {"prompt": "Hello world", "return_token_strs": True, "add_special_tokens": False}
    answer = call(tokenizer, "POST", "/tokenize", body).json()
    assert answer["token_strs"] == [tokenizer.id_to_token(t) for t in answer["tokens"]] == ["Hello", "Ġworld"]


def test_tokenize_a_chat_renders_the_template_without_adding_special_tokens(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    answer = call(tokenizer, "POST", "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(answer["tokens"], skip_special_tokens=False) == text


def test_detokenize_round_trips_with_special_tokens_kept(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode("<|im_start|>user hi", add_special_tokens=False)
    response = call(tokenizer, "POST", "/detokenize", {"model": "/models/x", "tokens": tokens})
    assert response.json() == {"prompt": "<|im_start|>user hi"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, ""),
    ("/tokenize", {}, ""),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_input_is_a_400_in_openais_envelope(tokenizer: Tokenizer, path: str, body: object,
                                                 param: str | None) -> None:
    response = call(tokenizer, "POST", path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)


def test_an_unknown_model_is_a_404_naming_every_served_name(tokenizer: Tokenizer) -> None:
    response = call(tokenizer, "POST", "/tokenize", {"model": "y", "prompt": "a"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == (
        "the model 'y' does not exist; this server serves '/models/x', 'x'")


def test_version_and_models_list_every_served_name(tokenizer: Tokenizer) -> None:
    assert call(tokenizer, "GET", "/version").json() == {"version": pdserve_version()}
    assert pdserve_version() != ""
    models = call(tokenizer, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["/models/x", "x"]
    assert [m["id"] for m in call(tokenizer, "GET", "/v1/models", names=()).json()["data"]] == ["worker-name"]
