"""n-gram speculative decoding over HTTP: every output equals a server's without speculation.

Three routers over one tiny random checkpoint (real tokenizer): a prefill worker on torch ops
and a decode worker that speculates on the native kernels (every prompt crosses over NIXL);
an aggregated worker that speculates on torch ops with a small device cache over a host tier;
and an aggregated worker without speculation, the reference. Greedy completions, stop strings,
a JSON-schema guide and seeded sampling give the same tokens on all three, and the speculating
workers' vllm:spec_decode_* counters show drafts accepted.
"""
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.stack import free_port, make_tiny_checkpoint, start, stop, wait_for_http, wait_for_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
TEXT = "the cat sat on the mat and the dog sat on the log; "
PROMPTS = [TEXT * 3, "one two three four " * 6, (TEXT + "a b c d e f ") * 2 + "the cat"]


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("speculative")
    model = make_tiny_checkpoint(root / "tiny", hidden_size=128)
    common = ["--model", str(model), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
              "--max-model-len", "512", "--num-threads", "1", "--cache-dir", "", "--block-size", "16"]
    spec = ["--speculative-config", SPEC]
    roles = {"prefill": ["--role", "prefill", "--kernels", "torch", "--max-kv-tokens", "4096", *spec],
             "decode": ["--role", "decode", "--kernels", "auto", "--max-kv-tokens", "4096",
                        "--disagg-min-prefill-tokens", "1", *spec],
             "spec": ["--kernels", "torch", "--max-kv-tokens", "640", "--host-cache-size", "64MiB", *spec],
             "plain": ["--kernels", "auto", "--max-kv-tokens", "4096"]}
    ports = {name: (free_port(), free_port()) for name in roles}
    procs = [start(["worker", "--port", str(ports[name][0]), "--metrics-port", str(ports[name][1]), *common, *args],
                   root / f"{name}.log") for name, args in roles.items()]
    try:
        for name, proc in zip(roles, procs):
            wait_for_worker(f"127.0.0.1:{ports[name][0]}", proc)
        found = {"metrics": {name: f"http://127.0.0.1:{ports[name][1]}/metrics" for name in roles}}
        for name, workers in (("disagg", ("prefill", "decode")), ("spec", ("spec",)), ("plain", ("plain",))):
            port = free_port()
            procs.append(start(["router", "--model", str(model), "--served-model-name", "tiny", "--port", str(port),
                                "--cache-dir", "", *[a for w in workers for a in ("--worker", f"127.0.0.1:{ports[w][0]}")]],
                               root / f"router_{name}.log"))
            found[name] = f"http://127.0.0.1:{port}"
            wait_for_http(found[name], procs)
        yield found
    finally:
        for proc in reversed(procs):
            stop(proc)


def complete(url: str, prompt: str, **params) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, **params}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"], "finish": choice["finish_reason"]}


def spec_counter(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:spec_decode_{name}_total{{"))


def on_all(urls: dict, prompt: str, **params) -> list[dict]:
    return [complete(urls[name], prompt, **params) for name in ("plain", "disagg", "spec")]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_outputs_equal_those_without_speculation(urls, prompt):
    plain, disagg, spec = on_all(urls, prompt)
    assert disagg == plain
    assert spec == plain


def test_the_speculating_workers_accept_drafts_and_the_others_draft_nothing(urls):
    for prompt in PROMPTS:
        on_all(urls, prompt)
    for name in ("decode", "spec"):
        assert spec_counter(urls["metrics"][name], "num_accepted_tokens") > 0, name
        assert spec_counter(urls["metrics"][name], "num_draft_tokens") >= spec_counter(
            urls["metrics"][name], "num_accepted_tokens")
    for name in ("prefill", "plain"):
        assert spec_counter(urls["metrics"][name], "num_drafts") == 0, name


def test_stop_strings_end_each_output_at_the_same_place(urls):
    reference = complete(urls["plain"], PROMPTS[0])["text"]
    stop_at = reference[len(reference) // 2:len(reference) // 2 + 3]
    outputs = on_all(urls, PROMPTS[0], stop=[stop_at])
    assert outputs[0]["finish"] == "stop" and stop_at not in outputs[0]["text"]
    assert outputs[1:] == outputs[:1] * 2


def test_a_guided_output_is_the_same(urls):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["a", "b"], "additionalProperties": False}
    outputs = on_all(urls, PROMPTS[1], guided_json=schema, ignore_eos=False, max_tokens=60)
    assert outputs[0]["finish"] == "stop"
    assert outputs[1:] == outputs[:1] * 2


def test_seeded_sampling_gives_the_same_tokens(urls):
    outputs = on_all(urls, PROMPTS[2], temperature=0.8, seed=1234)
    assert outputs[1:] == outputs[:1] * 2


def test_outputs_stay_equal_through_the_host_tier(urls):
    """The speculating aggregated worker holds 640 tokens on the device: other prompts push the
    first one's blocks to the host tier, from where the repeat copies them back."""
    first = complete(urls["spec"], PROMPTS[0] * 2)
    for i in range(4):
        complete(urls["spec"], f"{i} " + PROMPTS[1] * 3)
    again = httpx.post(f"{urls['spec']}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPTS[0] * 2, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "logprobs": 0}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["logprobs"]["tokens"] == first["tokens"] == complete(urls["plain"], PROMPTS[0] * 2)["tokens"]
