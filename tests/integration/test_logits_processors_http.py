"""vLLM's logits-processor parameters through the official `openai` client and the real stack
(router, engine, tiny random checkpoint): each is accepted and changes greedy output where it
should, the same whether the first token is sampled by a prefill worker or not."""
from collections.abc import Iterator

import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.stack import free_port, make_tiny_checkpoint, start, stop, wait_for_http, wait_for_worker

pytestmark = pytest.mark.integration
PROMPT = "Once upon a time, in a land far away, there lived"
GREEDY = {"temperature": 0, "max_tokens": 12, "logprobs": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict[str, object]]:
    """An aggregated worker and a prefill + decode pair, each behind its own router."""
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
              "--max-kv-tokens", "4096", "--num-threads", "1", "--cache-dir", ""]
    ports = {name: free_port() for name in ("both", "prefill", "decode", "router_agg", "router_pd")}
    workers = {role: start(["worker", "--role", role, "--port", str(ports[role]), *common,
                            "--disagg-min-prefill-tokens", "1"], logs / f"{role}.log")
               for role in ("both", "prefill", "decode")}
    procs = list(workers.values())
    try:
        for role, proc in workers.items():
            wait_for_worker(f"127.0.0.1:{ports[role]}", proc)
        procs.append(start(["router", "--model", checkpoint, "--port", str(ports["router_agg"]), "--cache-dir", "",
                            "--worker", f"127.0.0.1:{ports['both']}"], logs / "router_agg.log"))
        procs.append(start(["router", "--model", checkpoint, "--port", str(ports["router_pd"]), "--cache-dir", "",
                            "--worker", f"127.0.0.1:{ports['prefill']}", "--worker", f"127.0.0.1:{ports['decode']}"],
                           logs / "router_pd.log"))
        urls = {name: f"http://127.0.0.1:{ports[f'router_{name}']}" for name in ("agg", "pd")}
        for url in urls.values():
            wait_for_http(url, procs)
        clients = {name: openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60.0, max_retries=0)
                   for name, url in urls.items()}
        yield {**clients, "tokenizer": AutoTokenizer.from_pretrained(checkpoint)}
    finally:
        for proc in reversed(procs):
            stop(proc)


def complete(client: openai.OpenAI, **kw: object) -> tuple[list[str], str, int]:
    """(tokens as text, finish reason, number of completion tokens) of a greedy completion."""
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}  # type: ignore[dict-item]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                    **{**GREEDY, **kw}, extra_body=extra)
    choice = out.choices[0]
    return list(choice.logprobs.tokens), choice.finish_reason, out.usage.completion_tokens


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def test_plain_greedy_output_repeats_tokens(stack):
    """The premise of the penalty tests: without them this random model repeats itself."""
    tokens, _, _ = complete(stack["agg"])
    assert len(set(tokens)) < len(tokens)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 50.0}}])
def test_a_strong_penalty_stops_repeats(stack, penalty):
    plain, _, _ = complete(stack["agg"])
    tokens, _, _ = complete(stack["agg"], **penalty)
    assert tokens != plain
    assert len(set(tokens)) == len(tokens)
    assert complete(stack["pd"], **penalty)[0] == tokens


def test_logit_bias_forces_a_token_and_bad_words_ban_it(stack):
    tokenizer = stack["tokenizer"]
    (hello,) = tokenizer.encode(" hello", add_special_tokens=False)
    forced, _, _ = complete(stack["agg"], logit_bias={str(hello): 100})
    assert forced == [token_text(tokenizer, hello)] * GREEDY["max_tokens"]
    nudged, _, _ = complete(stack["agg"], logit_bias={str(hello): 5}, extra_body={"bad_words": ["hello"]})
    assert token_text(tokenizer, hello) not in nudged
    assert complete(stack["pd"], logit_bias={str(hello): 5}, extra_body={"bad_words": ["hello"]})[0] == nudged


def test_min_tokens_holds_back_eos(stack):
    bias = {str(stack["tokenizer"].eos_token_id): 100}
    _, reason, count = complete(stack["agg"], logit_bias=bias, extra_body={"ignore_eos": False})
    assert (reason, count) == ("stop", 1)
    for name in ("agg", "pd"):
        _, reason, count = complete(stack[name], logit_bias=bias, extra_body={"ignore_eos": False, "min_tokens": 4})
        assert (reason, count) == ("stop", 5)


def test_chat_accepts_the_same_parameters(stack):
    tokenizer = stack["tokenizer"]
    (hello,) = tokenizer.encode(" hello", add_special_tokens=False)
    client = stack["agg"]
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say something."}],
        temperature=0, max_tokens=4, logit_bias={str(hello): 100}, frequency_penalty=0.5, presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.1, "min_tokens": 2, "bad_words": ["goodbye"], "ignore_eos": True})
    assert out.choices[0].message.content == token_text(tokenizer, hello) * 4
