"""The OpenAI-compatible API through a real uvicorn server and the official `openai` client.

The worker is `WordBackend` (deterministic, see http_fakes.py); the tokenizer is the default
model's real one, so token counts are the real counts.
"""
from collections.abc import Iterator

import httpx
import openai
import pytest

from http_fakes import MODEL_NAME, WORDS, WordBackend, greedy_word, model_info, serve
from pdserve.common.tokenizer import Tokenizer, load_tokenizer
from pdserve.router.app import create_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture
def backend(tokenizer: Tokenizer) -> WordBackend:
    return WordBackend(tokenizer)


@pytest.fixture
def base_url(backend: WordBackend, tokenizer: Tokenizer) -> Iterator[str]:
    with serve(create_app(backend, tokenizer, model_info(tokenizer))) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30.0) as c:
        yield c


def greedy_text(prompt_ids: list[int], num_tokens: int) -> str:
    return "".join(WORDS[greedy_word(tuple(prompt_ids), step)] for step in range(num_tokens))


def test_completion_greedy_text_and_usage(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("The sky is", add_special_tokens=True)
    out = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=5, temperature=0)
    assert out.object == "text_completion"
    assert out.model == MODEL_NAME
    assert [c.index for c in out.choices] == [0]
    assert out.choices[0].text == greedy_text(prompt_ids, 5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(prompt_ids), 5, len(prompt_ids) + 5)


def test_chat_greedy_text_and_usage(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == greedy_text(prompt_ids, 4)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 4)


def test_completion_stream_concatenates_to_the_full_text(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Once upon", add_special_tokens=True)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == greedy_text(prompt_ids, 6)
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * 5 + ["length"]
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt_ids), 6)


def test_chat_stream_role_first_then_content(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy_text(prompt_ids, 3)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_health_is_200(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
