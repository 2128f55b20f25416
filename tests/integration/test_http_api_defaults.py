"""Over HTTP: the model's generation_config.json defaults reach the worker for fields a request
leaves unset or null, the request's own values win, and a default max_tokens is capped to the
context left; explicit nulls everywhere are accepted, through the official client too."""
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from http_fakes import MAX_MODEL_LEN, MODEL_NAME, WordBackend, load_test_tokenizer, model_info, serve
from pdserve.models.generation_config import generation_defaults
from pdserve.router.openai.app import create_app
from pdserve.router.openai.sampling import checked_defaults

pytestmark = pytest.mark.integration
MODEL_DEFAULTS = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "max_new_tokens": MAX_MODEL_LEN * 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    root = tmp_path_factory.getbasetemp()
    tokenizer = load_test_tokenizer(root)
    model_dir = Path(root / "model-with-defaults")
    model_dir.mkdir(exist_ok=True)
    (model_dir / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    defaults = checked_defaults(generation_defaults("auto", str(model_dir)))
    backend = WordBackend(tokenizer)
    with serve(create_app(backend, tokenizer, model_info(tokenizer), sampling_defaults=defaults)) as url:
        yield url, backend


@pytest.fixture
def backend(server: tuple[str, WordBackend]) -> WordBackend:
    server[1].reset()
    return server[1]


def test_unset_fields_take_the_models_defaults(server: tuple[str, WordBackend], backend: WordBackend) -> None:
    response = httpx.post(f"{server[0]}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200, response.text
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.8, 7)
    prompt_len = len(backend.requests[-1].prompt_token_ids)
    assert sampling.max_tokens == MAX_MODEL_LEN - prompt_len  # the default, capped to the room left


def test_the_requests_own_values_win_and_null_means_the_default(server: tuple[str, WordBackend],
                                                                backend: WordBackend) -> None:
    body = {**CHAT, "temperature": 0, "top_p": None, "max_tokens": 3}
    assert httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=30).status_code == 200
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.0, 0.8, 7, 3)


def test_nulls_for_every_optional_field_through_the_openai_client(server: tuple[str, WordBackend],
                                                                   backend: WordBackend) -> None:
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)
    nulls = {"n": None, "stream": None, "logprobs": None, "presence_penalty": None, "frequency_penalty": None,
             "stop": None, "seed": None, "user": None, "logit_bias": None, "top_logprobs": None,
             "max_completion_tokens": None, "response_format": None, "tools": None, "tool_choice": None}
    answer = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=4, extra_body=nulls)
    assert answer.choices[0].message.content
    completion = httpx.post(f"{server[0]}/v1/completions", timeout=30, json={
        "model": MODEL_NAME, "prompt": "a b", "max_tokens": 2, "n": None, "echo": None, "suffix": None,
        "best_of": None, "stream_options": None, "logprobs": None, "temperature": None})
    assert completion.status_code == 200, completion.text
