"""The SSE client and the runner against a fake OpenAI server with known answers."""
import asyncio
import socket

import httpx
import pytest

from bench_fake_server import MODEL_ID, PROMPT_TOKENS_BASE, Behavior
from pdserve.bench.client import EndpointError, fetch_model_ids, stream_request
from pdserve.bench.datasets import Conversation, Turn
from pdserve.bench.runner import RequestOptions, build_payload, run_requests


def run(coro_fn):
    async def with_client():
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as http:
            return await coro_fn(http)
    return asyncio.run(with_client())


def completion(max_tokens, prompt="hello"):
    return {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "stream": True}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stream_records_every_token_chunk_and_the_usage(serve, endpoint):
    server = serve()
    options = RequestOptions(server.base_url, endpoint, MODEL_ID)
    payload = build_payload(options, Conversation((Turn("abc", 3, 4),)), [], Turn("abc", 3, 4))
    result = run(lambda http: stream_request(http, options.url, payload))
    assert result.error is None
    assert result.text == "t0 t1 t2 t3 "
    assert len(result.chunk_times) == 4  # the chat role chunk carries no text and is not a token
    assert list(result.chunk_times) == sorted(result.chunk_times)
    assert (result.prompt_tokens, result.completion_tokens) == (PROMPT_TOKENS_BASE + 3, 4)
    assert result.finish_time >= result.chunk_times[-1]


def test_refused_request_is_an_error_not_an_exception(serve):
    server = serve(Behavior(refuse=lambda body: 429))
    result = run(lambda http: stream_request(http, server.base_url + "/v1/completions", completion(3)))
    assert result.error == "HTTP 429: refused"
    assert result.chunk_times == ()


def test_error_event_inside_an_http_200_stream_fails_the_request(serve):
    server = serve(Behavior(fail_midway=lambda body: True))
    result = run(lambda http: stream_request(http, server.base_url + "/v1/completions", completion(5)))
    assert result.error == "error event: engine failed"
    assert result.text == "t0 t1 "


def test_missing_usage_leaves_counts_to_the_caller(serve):
    server = serve(Behavior(include_usage=False))
    result = run(lambda http: stream_request(http, server.base_url + "/v1/completions", completion(2)))
    assert (result.error, result.prompt_tokens, result.completion_tokens) == (None, None, None)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_a_failed_request_and_an_endpoint_error():
    url = f"http://127.0.0.1:{free_port()}"
    result = run(lambda http: stream_request(http, url + "/v1/completions", completion(2)))
    assert result.error.startswith("ConnectError")
    with pytest.raises(EndpointError, match="cannot reach"):
        run(lambda http: fetch_model_ids(http, url))


def test_model_ids_come_from_v1_models(serve):
    server = serve()
    assert run(lambda http: fetch_model_ids(http, server.base_url)) == [MODEL_ID]


def test_multi_turn_resends_history_with_the_server_answers(serve):
    server = serve()
    options = RequestOptions(server.base_url, "/v1/chat/completions", MODEL_ID)
    conversation = Conversation((Turn("q1", 1, 2), Turn("q2", 1, 3)), system="sys", system_tokens=1)
    result = run(lambda http: run_requests(options, http, [conversation], [0.0], count_tokens=len))
    assert [b["messages"] for b in server.behavior.bodies] == [
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
         {"role": "assistant", "content": "t0 t1 "}, {"role": "user", "content": "q2"}],
    ]
    assert [(r.prompt_len, r.output_len) for r in result.records] == [
        (PROMPT_TOKENS_BASE + 5, 2), (PROMPT_TOKENS_BASE + 13, 3)]


def test_completions_history_is_concatenated_text(serve):
    server = serve()
    options = RequestOptions(server.base_url, "/v1/completions", MODEL_ID)
    conversation = Conversation((Turn("q1 ", 1, 1), Turn("q2 ", 1, 1)), system="sys ")
    run(lambda http: run_requests(options, http, [conversation], [0.0], count_tokens=len))
    assert [b["prompt"] for b in server.behavior.bodies] == ["sys q1 ", "sys q1 t0 q2 "]


def test_failed_turn_ends_its_conversation_and_the_progress_still_completes(serve):
    server = serve(Behavior(refuse=lambda body: 500 if body["max_tokens"] == 2 else None))
    options = RequestOptions(server.base_url, "/v1/completions", MODEL_ID)
    conversations = [Conversation((Turn("a", 1, 2), Turn("b", 1, 1), Turn("c", 1, 1))),
                     Conversation((Turn("d", 1, 1),))]
    done = []
    result = run(lambda http: run_requests(options, http, conversations, [0.0, 0.0], len,
                                           on_request_done=done.append))
    assert sorted(r.error or "" for r in result.records) == ["", "HTTP 500: refused"]
    assert sum(done) == 4


def test_without_usage_counts_fall_back_to_the_client(serve):
    server = serve(Behavior(include_usage=False))
    options = RequestOptions(server.base_url, "/v1/completions", MODEL_ID)
    conversations = [Conversation((Turn("abc", 7, 3),))]
    result = run(lambda http: run_requests(options, http, conversations, [0.0], count_tokens=len))
    assert [(r.prompt_len, r.output_len) for r in result.records] == [(7, len("t0 t1 t2 "))]


def test_concurrency_cap_bounds_requests_in_flight(serve):
    server = serve(Behavior(chunk_delay_s=0.01))
    options = RequestOptions(server.base_url, "/v1/completions", MODEL_ID)
    conversations = [Conversation((Turn(f"p{i}", 1, 5),)) for i in range(6)]
    result = run(lambda http: run_requests(options, http, conversations, [0.0] * 6, len, max_concurrency=2))
    assert server.behavior.max_in_flight == 2
    assert len(result.records) == 6 and all(r.is_success for r in result.records)


def test_a_request_past_its_deadline_fails_with_a_timeout(serve):
    server = serve(Behavior(chunk_delay_s=0.2))
    result = run(lambda http: stream_request(http, server.base_url + "/v1/completions", completion(50),
                                             timeout_s=0.5))
    assert result.error == "timed out after 0.5 s"
    assert len(result.chunk_times) < 50
