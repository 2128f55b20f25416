"""Every family of issue 44 over HTTP, greedy token-identical to transformers: behind one router
a prefill worker on torch ops and a decode worker on the native kernels (where this CPU has them),
behind another an aggregated worker on torch ops. A short prompt is prefilled by the decode worker
itself, in chunks of 16 tokens; a long one (3x Gemma 3's window) crosses over NIXL, then comes
again from the cache."""
from collections.abc import Iterator

import httpx
import pytest

from tests.family_builders import FAMILIES, WINDOW, make_family_checkpoint
from tests.integration.stack import free_port, start, stop, wait_for_http, wait_for_worker
from tests.lora_builders import greedy

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MAX_TOKENS = 8
SHORT = [(i * 7919) % 40000 + 100 for i in range(20)]
LONG = [(i * 104729) % 40000 + 100 for i in range(3 * WINDOW + 7)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp(request.param)
    model = make_family_checkpoint(root / "model", request.param)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    expected = {name: [tokenizer.decode([t], skip_special_tokens=False) for t in greedy(model, prompt, MAX_TOKENS)]
                for name, prompt in (("short", SHORT), ("long", LONG))}
    common = ["--model", str(root / "model"), "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
              "--max-kv-tokens", "4096", "--num-threads", "1", "--cache-dir", ""]
    roles = {"prefill": ["--kernels", "torch"],
             "decode": ["--kernels", "auto", "--disagg-min-prefill-tokens", str(len(LONG)),
                        "--max-num-batched-tokens", "16", "--max-num-seqs", "4"],
             "both": ["--kernels", "torch"]}
    ports = {name: free_port() for name in (*roles, "router_pd", "router_agg")}
    procs = [start(["worker", "--role", role, "--port", str(ports[role]), *common, *args], root / f"{role}.log")
             for role, args in roles.items()]
    try:
        for role, proc in zip(roles, procs):
            wait_for_worker(f"127.0.0.1:{ports[role]}", proc)
        urls = {}
        for name, workers in (("disagg", ("prefill", "decode")), ("agg", ("both",))):
            port = ports[f"router_{'pd' if name == 'disagg' else 'agg'}"]
            procs.append(start(["router", "--model", str(root / "model"), "--port", str(port), "--cache-dir", "",
                                *[arg for w in workers for arg in ("--worker", f"127.0.0.1:{ports[w]}")]],
                               root / f"router_{name}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
            wait_for_http(urls[name], procs)
        yield {"urls": urls, "expected": expected, "kind": request.param, "model": model}
    finally:
        for proc in reversed(procs):
            stop(proc)


def complete(url: str, prompt: list[int]) -> tuple[list[str], dict[str, str]]:
    """Greedy tokens (each one's text, as logprobs name them) and the route of one completion."""
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert response.status_code == 200, response.text
    route = dict(part.split("=", 1) for part in response.headers["x-pdserve-route"].split(";"))
    return response.json()["choices"][0]["logprobs"]["tokens"], route


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_greedy_tokens_equal_transformers_aggregated_and_disaggregated(family, prompt):
    ids = SHORT if prompt == "short" else LONG
    expected = family["expected"][prompt]
    tokens, route = complete(family["urls"]["disagg"], ids)
    assert tokens == expected
    assert (route["prefilled_by"] == "local") == (prompt == "short"), route
    assert complete(family["urls"]["agg"], ids)[0] == expected


def test_a_cached_repeat_of_the_long_prompt_gives_the_same_tokens(family):
    complete(family["urls"]["disagg"], LONG)
    tokens, _ = complete(family["urls"]["disagg"], LONG)
    assert tokens == family["expected"]["long"]


def test_gemma3s_window_changes_the_long_answer(family):
    """Guards the Gemma 3 cases: without its window the long prompt's greedy answer differs, so an
    answer that ignored the window (or lost the window layers' keys) would be caught."""
    if family["kind"] != "gemma3":
        pytest.skip("the window guard is Gemma 3's")
    model = family["model"]
    model.config.sliding_window = 10 * len(LONG)  # transformers builds the window layers' mask from it
    try:
        unwindowed = greedy(model, LONG, MAX_TOKENS)
    finally:
        model.config.sliding_window = WINDOW
    assert unwindowed != greedy(model, LONG, MAX_TOKENS)
