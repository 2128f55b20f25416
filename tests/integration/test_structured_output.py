"""Structured output and tool calling through `pdserve serve` (router, prefill and decode
workers, real model forward on a random-weight checkpoint) with the official `openai` client.

The schemas bound every string, number and array, so a complete output always fits in
`max_tokens` and every generation must end with finish_reason "stop" (or "tool_calls"),
however random the model. The prompts are short, but `--disagg-min-prefill-tokens 1` sends each
one to the prefill worker: the first token is sampled there, under the grammar, and the decode
worker's matcher continues from it.
"""
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.integration.stack import banner_address, free_port, make_tiny_checkpoint, start_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "scores"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 96


@dataclass
class Serve:
    url: str
    prefill: str


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    directory = tmp_path_factory.mktemp("structured")
    checkpoint = make_tiny_checkpoint(directory / "tiny")
    port = free_port()
    process, banner = start_serve(directory, [
        "--model", str(checkpoint), "--served-model-name", "tiny", "--port", str(port), "--device", "cpu",
        "--dtype", "float32", "--max-model-len", "512", "--max-kv-tokens", "16384", "--cache-dir", "",
        "--startup-timeout", "150", "--disagg-min-prefill-tokens", "1"])
    try:
        yield Serve(f"http://127.0.0.1:{port}", banner_address(banner, "prefill"))
    finally:
        process.terminate()
        process.wait(60)


@pytest.fixture
def client(serve: Serve) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c


def test_a_hundred_json_schema_generations_all_parse_and_validate(client: openai.OpenAI) -> None:
    def one(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Describe person {seed} as JSON."}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(100)))
    contents = []
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        contents.append(choice.message.content)
    assert len(set(contents)) > 50  # sampled under the grammar, not one forced string


def test_the_prefill_worker_samples_the_first_token_under_the_grammar(serve: Serve) -> None:
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": 8, "temperature": 1.0,
            "guided_choice": ["alpha", "beta gamma", "delta"]}
    seen = set()
    with httpx.Client(base_url=serve.url, timeout=60.0) as http:
        for seed in range(12):
            response = http.post("/v1/completions", json={**body, "seed": seed})
            assert response.status_code == 200, response.text
            assert f"prefilled_by={serve.prefill}" in response.headers["X-Pdserve-Route"]
            choice = response.json()["choices"][0]
            assert (choice["text"] in body["guided_choice"], choice["finish_reason"]) == (True, "stop")
            seen.add(choice["text"])
    assert len(seen) > 1


def test_guided_regex_and_json_object(client: openai.OpenAI) -> None:
    pattern = r"[A-Z][a-z]{1,6}-[0-9]{2,4}"
    for seed in range(8):
        out = client.completions.create(model="tiny", prompt="Code:", max_tokens=32, temperature=1.0, seed=seed,
                                        extra_body={"guided_regex": pattern})
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.choices[0].text)
    out = client.completions.create(model="tiny", prompt="Data:", max_tokens=48, temperature=0.0,
                                    extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_tool_choice_required_always_yields_a_well_formed_call(client: openai.OpenAI) -> None:
    for seed in range(10):
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_arguments_of_its_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = response.choices[0].message.tool_calls
    assert (call.function.name, response.choices[0].finish_reason) == ("get_time", "tool_calls")
    jsonschema.validate(json.loads(call.function.arguments), TIME)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(client: openai.OpenAI, tool_choice) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS,
                  temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish_reasons = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            finish_reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # a call's first delta names it
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [r for r in finish_reasons if r] == [whole.finish_reason] == ["tool_calls"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # served only with --enable-auto-tool-choice
])
def test_a_bad_guide_or_tool_choice_is_a_400_envelope(serve: Serve, extra: dict, param: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=30.0)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """One role=both worker, with tool_choice "auto" read by the Hermes parser."""
    directory = tmp_path_factory.mktemp("structured-aggregated")
    checkpoint = make_tiny_checkpoint(directory / "tiny")
    port = free_port()
    process, _ = start_serve(directory, [
        "--model", str(checkpoint), "--served-model-name", "tiny", "--port", str(port), "--device", "cpu",
        "--dtype", "float32", "--max-model-len", "512", "--max-kv-tokens", "16384", "--cache-dir", "",
        "--startup-timeout", "150", "--aggregated", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=120.0) as c:
            yield c
    finally:
        process.terminate()
        process.wait(60)


def test_aggregated_json_schema_generations_validate(aggregated: openai.OpenAI) -> None:
    for seed in range(20):
        out = aggregated.completions.create(model="tiny", prompt=f"Person {seed}:", max_tokens=MAX_TOKENS,
                                            temperature=1.0, seed=seed, extra_body={"guided_json": PERSON})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_auto_tool_choice_reads_a_hermes_call_whole_and_streamed(aggregated: openai.OpenAI) -> None:
    """The model is guided to write a Hermes call after some content; "auto" reads it back."""
    pattern = r'[A-Za-z]{1,5} <tool_call>\{"name": "get_time", "arguments": \{"zone": "[a-z]{1,4}"\}\}</tool_call>'
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=MAX_TOKENS,
                  temperature=0.0, extra_body={"guided_regex": pattern})
    whole = aggregated.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert (call.function.name, whole.finish_reason) == ("get_time", "tool_calls")
    assert re.fullmatch(r"[A-Za-z]{1,5} ", whole.message.content)
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    content, arguments, names = "", "", []
    for chunk in aggregated.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
    assert (content, names, arguments) == (whole.message.content, ["get_time"], call.function.arguments)
