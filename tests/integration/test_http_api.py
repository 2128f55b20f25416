"""The OpenAI-compatible API through a real uvicorn server and the official `openai` client.

The worker is `WordBackend` (deterministic, see http_fakes.py); the tokenizer is the default
model's real one, so token counts are the real counts.
"""
from collections.abc import Iterator

import httpx
import openai
import pytest

from http_fakes import MAX_MODEL_LEN, MODEL_NAME, WORDS, WordBackend, greedy_word, load_test_tokenizer, model_info, serve
from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.app import create_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_test_tokenizer(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(tokenizer: Tokenizer) -> Iterator[tuple[str, WordBackend]]:
    backend = WordBackend(tokenizer)
    with serve(create_app(backend, tokenizer, model_info(tokenizer))) as url:
        yield url, backend


@pytest.fixture
def backend(server: tuple[str, WordBackend]) -> WordBackend:
    server[1].reset()
    return server[1]


@pytest.fixture
def base_url(server: tuple[str, WordBackend], backend: WordBackend) -> str:
    return server[0]


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


def test_n_choices_and_batch_prompts_are_indexed_prompt_major(client: openai.OpenAI, backend: WordBackend) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=["a b", "c d e"], n=2, max_tokens=3, temperature=0)
    prompts = [r.prompt_token_ids for r in backend.requests]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [greedy_text(list(prompts[0]), 3)] * 2 + [
        greedy_text(list(prompts[1]), 3)] * 2
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompts[0]) + len(prompts[1]), 12)
    assert [r.sampling.n for r in backend.requests] == [2, 2]


def test_token_id_prompts_pass_through_unchanged(client: openai.OpenAI, backend: WordBackend) -> None:
    client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=1)
    client.completions.create(model=MODEL_NAME, prompt=[10, 11], max_tokens=1)
    assert [r.prompt_token_ids for r in backend.requests] == [(5, 6, 7), (8, 9), (10, 11)]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        out = client.completions.create(
            model=MODEL_NAME, prompt="Pick words:", n=2, max_tokens=12, temperature=0.9, seed=seed)
        return [c.text for c in out.choices]

    first, again, other = sample(1234), sample(1234), sample(99)
    assert first == again
    assert first != other
    assert first[0] != first[1]  # each choice draws its own tokens


def test_sampling_fields_reach_the_worker(client: openai.OpenAI, backend: WordBackend) -> None:
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_completion_tokens=7,
        temperature=0.5, top_p=0.8, seed=3, stop=["zz"],
        extra_body={"top_k": 20, "ignore_eos": True, "stop_token_ids": [4, 5], "cache_salt": "tenant-a",
                    "priority": [{"start": 0, "end": 4, "priority": 90, "duration_s": 30.0}]})
    (request,) = backend.requests
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (
        7, 0.5, 0.8, 20, 3)
    assert (sampling.stop, sampling.stop_token_ids, sampling.ignore_eos) == (("zz",), (4, 5), True)
    assert request.cache_salt == "tenant-a"
    assert [(p.start, p.end, p.priority, p.duration_s) for p in request.priorities] == [(0, 4, 90, 30.0)]


def test_single_priority_covers_the_whole_prompt(client: openai.OpenAI, backend: WordBackend) -> None:
    client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3, 4, 5], max_tokens=1, extra_body={"priority": 70})
    assert [(p.start, p.end, p.priority, p.duration_s) for p in backend.requests[0].priorities] == [(0, 5, 70, None)]


def test_chat_default_max_tokens_fills_the_context(client: openai.OpenAI, backend: WordBackend) -> None:
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], temperature=0,
                                   stream=True).close()
    request = backend.requests[0]
    assert request.sampling.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)


def test_stop_string_ends_the_choice(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Go", add_special_tokens=True)
    full = greedy_text(prompt_ids, 6)
    stop = WORDS[greedy_word(tuple(prompt_ids), 3)]
    cut = client.completions.create(model=MODEL_NAME, prompt="Go", max_tokens=6, temperature=0, stop=stop)
    kept = client.completions.create(model=MODEL_NAME, prompt="Go", max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (full[: full.index(stop)], "stop")
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]
    assert cut.usage is not None and cut.usage.completion_tokens == 4


def test_completion_logprobs_format(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Hi", add_special_tokens=True)
    out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=0, logprobs=2)
    words = [greedy_word(tuple(prompt_ids), step) for step in range(2)]
    logprobs = out.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == [WORDS[w] for w in words]
    assert logprobs.token_logprobs == [-0.125, -0.125]
    assert logprobs.top_logprobs == [
        {WORDS[w]: -0.125, WORDS[(w + 1) % 16]: -0.5} for w in words]
    assert logprobs.text_offset == [0, len(WORDS[words[0]])]


def test_chat_logprobs_format(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0,
                                         logprobs=True, top_logprobs=2)
    word = greedy_word(tuple(prompt_ids), 0)
    assert out.choices[0].logprobs is not None
    (entry,) = out.choices[0].logprobs.content or []
    assert (entry.token, entry.logprob, entry.bytes) == (WORDS[word], -0.125, list(WORDS[word].encode()))
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
        (WORDS[(word + 0) % 16], -0.25), (WORDS[(word + 1) % 16], -0.5)]


def test_cached_tokens_are_reported(client: openai.OpenAI, backend: WordBackend) -> None:
    backend.num_cached_tokens = 16
    out = client.completions.create(model=MODEL_NAME, prompt=["one", "two"], max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 32


def test_request_id_header_is_echoed(base_url: str) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    given = httpx.post(f"{base_url}/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=10)
    generated = httpx.post(f"{base_url}/v1/completions", json=body, timeout=10)
    assert given.headers["x-request-id"] == "trace-42"
    assert generated.headers["x-request-id"] == generated.json()["id"]
    assert generated.json()["id"].startswith("cmpl-")


def test_metrics_count_requests_and_leave_worker_figures_to_the_workers(tokenizer: Tokenizer) -> None:
    app = create_app(WordBackend(tokenizer), tokenizer, model_info(tokenizer))  # fresh counters
    with serve(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
        text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = set(text.splitlines())
    assert 'pdserve_http_requests_total{route="/v1/completions",status="200"} 1.0' in lines
    assert 'pdserve_http_requests_total{route="/v1/completions",status="400"} 1.0' in lines
    assert "pdserve_time_to_first_token_seconds_count 1.0" in lines
    assert "pdserve_time_per_output_token_seconds_count 1.0" in lines
    assert "pdserve_e2e_request_latency_seconds_count 1.0" in lines
    assert not [line for line in lines if "num_requests" in line or "prefix_cache" in line or "vllm:" in line]


def test_chat_stream_with_n_opens_every_choice_first(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=2, temperature=0.7,
        seed=5, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason == "length")
    assert finished == [0, 1]
    assert len(chunks) == 6  # two role chunks, then two tokens for each choice
