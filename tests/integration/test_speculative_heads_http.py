"""EAGLE-3 and MTP heads over HTTP: every output equals a server's without speculation.

One tiny random MiMo-style checkpoint (a Qwen2 body of 4 layers with an MTP layer, SmolLM2's
tokenizer) behind three routers: an aggregated worker drafting with a random EAGLE-3 head on
torch ops; a prefill worker on torch ops and a decode worker drafting with the MTP layer on the
native kernels (every prompt crosses over NIXL, so the decode worker's head never sees a prompt
position); an aggregated worker without speculation, the reference. The heads are random: the
drafts are rarely accepted, and the outputs must not change.
"""
from collections.abc import Iterator

import httpx
import pytest

from tests.head_builders import make_eagle3_head, make_mimo_checkpoint
from tests.integration.stack import free_port, start, stop, wait_for_http, wait_for_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EAGLE3 = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 3}'
MTP = '{"method": "mtp", "num_speculative_tokens": 2}'
PROMPTS = ["the cat sat on the mat and the dog sat on the log; " * 2, "one two three four five six seven"]


def _target(directory) -> None:
    import os

    from transformers import AutoTokenizer

    from pdserve.common.model_source import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    make_mimo_checkpoint(directory, num_hidden_layers=4, vocab_size=len(tokenizer), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("heads_http")
    model = root / "mimo"
    _target(model)
    head = make_eagle3_head(root / "eagle3", model, aux_layers=[1, 2, 3])
    common = ["--model", str(model), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
              "--max-model-len", "512", "--num-threads", "1", "--cache-dir", "", "--block-size", "16",
              "--max-kv-tokens", "2048"]
    roles = {"eagle3": ["--kernels", "torch", "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
                        "--speculative-config", EAGLE3 % head],
             "prefill": ["--role", "prefill", "--kernels", "torch"],
             "decode": ["--role", "decode", "--kernels", "auto", "--disagg-min-prefill-tokens", "1",
                        "--speculative-config", MTP],
             "plain": ["--kernels", "auto"]}
    ports = {name: (free_port(), free_port()) for name in roles}
    procs = [start(["worker", "--port", str(ports[name][0]), "--metrics-port", str(ports[name][1]), *common, *args],
                   root / f"{name}.log") for name, args in roles.items()]
    try:
        for name, proc in zip(roles, procs):
            wait_for_worker(f"127.0.0.1:{ports[name][0]}", proc)
        found = {"metrics": {name: f"http://127.0.0.1:{ports[name][1]}/metrics" for name in roles}}
        for name, workers in (("eagle3", ("eagle3",)), ("mtp", ("prefill", "decode")), ("plain", ("plain",))):
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


def complete(url: str, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"], "route": response.headers.get("x-pdserve-route")}


def spec_counter(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:spec_decode_{name}_total{{"))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_outputs_equal_those_without_speculation(urls, prompt):
    plain = complete(urls["plain"], prompt)
    for name in ("eagle3", "mtp"):
        got = complete(urls[name], prompt)
        assert (got["text"], got["tokens"]) == (plain["text"], plain["tokens"]), name


def test_the_heads_draft_aggregated_and_on_the_decode_worker(urls):
    route = dict(part.split("=", 1) for part in complete(urls["mtp"], PROMPTS[0])["route"].split(";"))
    assert route["prefilled_by"] != "local"  # the prompt crossed over: the decode worker's head never saw it
    for name in ("eagle3", "decode"):
        assert spec_counter(urls["metrics"][name], "num_draft_tokens") > 0, name
    for name in ("prefill", "plain"):
        assert spec_counter(urls["metrics"][name], "num_drafts") == 0, name
