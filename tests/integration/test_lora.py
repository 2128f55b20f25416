"""Multi-LoRA through `pdserve serve`, aggregated and disaggregated (tiny checkpoint, two random
PEFT adapters from the tests): requests for both adapters and for the base model, sent at once,
give PEFT's greedy tokens (float32); `/v1/models` lists the adapters with their base; adapters
load and unload over HTTP (on every worker); a prefix cached under one adapter is not a hit for
another adapter or the base model."""
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.integration.stack import free_port, make_tiny_checkpoint, start_serve
from tests.lora_builders import ATTENTION, greedy, make_adapter

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MAX_TOKENS = 6
PROMPTS = [[(seed * 7919 + i * 104729) % 40000 + 100 for i in range(length)]
           for seed, length in ((1, 7), (2, 19), (3, 40))]
SHARED = PROMPTS[2]  # 40 tokens: two full blocks of 16 to find in the cache


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoint, three adapters (two served from the start, one loaded later) and the
    reference tokens (their texts) of every prompt under each (None: the base model)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora")
    checkpoint = make_tiny_checkpoint(root / "base")
    base = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    models = {None: base,
              "sql": make_adapter(base, root / "sql", seed=1, scale=3.0),  # the base's weights are small
              "chat": make_adapter(base, root / "chat", seed=2, targets=ATTENTION, r=4, alpha=8, use_rslora=True,
                                   scale=3.0),
              "late": make_adapter(base, root / "late", seed=3, r=2, scale=3.0)}
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    expected = {name: [[tokenizer.decode([t], skip_special_tokens=False) for t in greedy(model, p, MAX_TOKENS)]
                       for p in PROMPTS] for name, model in models.items()}
    assert expected["sql"] != expected[None] and expected["chat"] != expected[None]
    return {"checkpoint": checkpoint, "root": root, "expected": expected}


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def served(request, family: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # nine requests go at once and every prompt must reach the prefill worker: above the default
    # bound of 8 unanswered orders a decode worker prefills locally (--max-prefill-queue)
    topology = (["--aggregated"] if request.param == "aggregated"
                else ["--disagg-min-prefill-tokens", "1", "--max-prefill-queue", "16"])
    root, port = family["root"], free_port()
    process, _ = start_serve(tmp_path_factory.mktemp(request.param), [
        "--model", str(family["checkpoint"]), "--served-model-name", "base", "--port", str(port),
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--max-kv-tokens", "4096",
        "--cache-dir", "", "--startup-timeout", "150", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
        "--lora-modules", f"sql={root / 'sql'}", f'{{"name": "chat", "path": "{root / "chat"}"}}',
        "--allow-runtime-lora-updating", "--lora-dir", str(root), *topology])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(60)


def complete(url: str, model: str, prompt: list[int]) -> tuple[list[str], int, dict[str, str]]:
    """Greedy tokens (each one's text, as logprobs name them), cached prompt tokens and the route
    of one completion."""
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model
    tokens = body["choices"][0]["logprobs"]["tokens"]
    route = dict(part.split("=", 1) for part in response.headers["x-pdserve-route"].split(";"))
    return tokens, body["usage"]["prompt_tokens_details"]["cached_tokens"], route


def test_adapters_and_the_base_model_at_once_give_peft_tokens(served: str, family: dict) -> None:
    models = {"base": None, "sql": "sql", "chat": "chat"}
    jobs = [(model, i) for i in range(len(PROMPTS)) for model in models]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(served, job[0], PROMPTS[job[1]]), jobs))
    for (model, i), (tokens, _, route) in zip(jobs, results):
        assert tokens == family["expected"][models[model]][i], (model, i)
        if "prefill" in route:  # disaggregated: the prefill worker computed every prompt
            assert route["prefilled_by"] == route["prefill"], route


def test_models_lists_the_adapters_with_their_base(served: str, family: dict) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{served}/v1/models").json()["data"]}
    assert set(cards) >= {"base", "sql", "chat"}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(family["root"] / "sql")
    assert "parent" not in cards["base"]


def test_a_prefix_cached_under_one_adapter_is_no_hit_for_another(served: str) -> None:
    prompt = [t + 1 for t in SHARED]  # a prompt no other test sends
    assert complete(served, "sql", prompt)[1] == 0
    assert complete(served, "chat", prompt)[1] == 0
    assert complete(served, "base", prompt)[1] == 0
    assert complete(served, "sql", prompt)[1] == 32


def test_an_adapter_loaded_over_http_serves_and_unloads(served: str, family: dict) -> None:
    load = httpx.post(f"{served}/v1/load_lora_adapter",
                      json={"lora_name": "late", "lora_path": str(family["root"] / "late")})
    assert load.status_code == 200 and "added successfully" in load.text, load.text
    assert "late" in {card["id"] for card in httpx.get(f"{served}/v1/models").json()["data"]}
    for i, prompt in enumerate(PROMPTS):
        tokens, _, route = complete(served, "late", prompt)
        assert tokens == family["expected"]["late"][i]
        if "prefill" in route:  # both workers loaded it: the prefill worker computes it
            assert route["prefilled_by"] == route["prefill"], route
    again = httpx.post(f"{served}/v1/load_lora_adapter",
                       json={"lora_name": "late", "lora_path": str(family["root"] / "late")})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    unload = httpx.post(f"{served}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unload.status_code == 200 and "removed successfully" in unload.text, unload.text
    gone = httpx.post(f"{served}/v1/completions", json={"model": "late", "prompt": PROMPTS[0], "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert httpx.post(f"{served}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    assert complete(served, "sql", PROMPTS[0])[0] == family["expected"]["sql"][0]  # the others stay


def test_a_folder_without_an_adapter_or_outside_the_lora_dir_is_refused_by_name(served: str, family: dict,
                                                                               tmp_path: Path) -> None:
    empty = family["root"] / "empty"
    empty.mkdir(exist_ok=True)
    response = httpx.post(f"{served}/v1/load_lora_adapter", json={"lora_name": "empty", "lora_path": str(empty)})
    assert response.status_code == 400
    assert "adapter_config.json" in response.json()["error"]["message"]
    outside = httpx.post(f"{served}/v1/load_lora_adapter", json={"lora_name": "out", "lora_path": str(tmp_path)})
    assert outside.status_code == 400 and "not in a --lora-dir folder" in outside.json()["error"]["message"]
    missing = httpx.post(f"{served}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400
    assert "empty" not in {card["id"] for card in httpx.get(f"{served}/v1/models").json()["data"]}
