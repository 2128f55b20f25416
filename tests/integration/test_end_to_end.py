"""The whole product through the official `openai` client: real routers, real workers, real
engine on a tiny checkpoint. One router fronts a prefill + a decode worker (KV over NIXL), the
other a single aggregated worker; greedy outputs must be identical between them."""
from collections.abc import Iterator

import openai
import pytest

from tests.integration.stack import free_port, metric, make_tiny_checkpoint, start, stop, wait_for_http, wait_for_worker

pytestmark = pytest.mark.integration
PROMPTS = ["Hello", "The capital of France is", "Once upon a time, in a land far away, there lived " * 3,
           "Count: " + " ".join(str(i) for i in range(60))]


@pytest.fixture(scope="module")
def clients(tmp_path_factory) -> Iterator[dict[str, openai.OpenAI]]:
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
              "--max-kv-tokens", "8192", "--num-threads", "1", "--cache-dir", ""]
    ports = {name: free_port() for name in ("prefill", "decode", "both", "router_pd", "router_agg", "metrics")}
    workers = {role: start(["worker", "--role", role, "--port", str(ports[role]), *common,
                            "--disagg-min-prefill-tokens", "1",
                            *(["--metrics-port", str(ports["metrics"])] if role == "decode" else [])],
                           logs / f"{role}.log")
               for role in ("prefill", "decode", "both")}
    procs = list(workers.values())
    try:
        for role, proc in workers.items():
            wait_for_worker(f"127.0.0.1:{ports[role]}", proc)
        routers = {
            "disagg": start(["router", "--model", checkpoint, "--port", str(ports["router_pd"]), "--cache-dir", "",
                             "--worker", f"127.0.0.1:{ports['prefill']}", "--worker", f"127.0.0.1:{ports['decode']}"],
                            logs / "router_pd.log"),
            "agg": start(["router", "--model", checkpoint, "--port", str(ports["router_agg"]), "--cache-dir", "",
                          "--worker", f"127.0.0.1:{ports['both']}"], logs / "router_agg.log"),
        }
        procs += list(routers.values())
        urls = {"disagg": f"http://127.0.0.1:{ports['router_pd']}", "agg": f"http://127.0.0.1:{ports['router_agg']}"}
        for url in urls.values():
            wait_for_http(url, procs)
        clients = {name: openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60.0) for name, url in urls.items()}
        yield {**clients, "decode_metrics": f"http://127.0.0.1:{ports['metrics']}/metrics"}
    finally:
        for proc in reversed(procs):
            stop(proc)


def _complete(client: openai.OpenAI, prompt: str, **kw):
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, **kw)


def test_disaggregated_greedy_equals_aggregated_through_the_api(clients):
    received = 'direction="received"'
    before = metric(clients["decode_metrics"], "pdserve_kv_transfer_blocks_count", received)
    for prompt in PROMPTS:
        outs = {name: _complete(clients[name], prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
                for name in ("disagg", "agg")}
        assert outs["disagg"].choices[0].text == outs["agg"].choices[0].text
        assert outs["disagg"].usage.completion_tokens == outs["agg"].usage.completion_tokens == 12
        assert outs["disagg"].usage.prompt_tokens == outs["agg"].usage.prompt_tokens
    # every prompt's KV came from the prefill worker (one transfer each), none was prefilled locally
    assert metric(clients["decode_metrics"], "pdserve_kv_transfer_blocks_count", received) == before + len(PROMPTS)


def test_streamed_text_and_usage_equal_the_one_shot_answer(clients):
    client = clients["disagg"]
    one_shot = _complete(client, PROMPTS[1], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(_complete(client, PROMPTS[1], max_tokens=10, temperature=0, stream=True,
                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == one_shot.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == one_shot.usage.prompt_tokens


def test_seeded_sampling_is_reproducible_and_n_gives_n_choices(clients):
    client = clients["agg"]
    kw = dict(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, extra_body={"ignore_eos": True})
    first, second = _complete(client, PROMPTS[2], **kw), _complete(client, PROMPTS[2], **kw)
    assert first.choices[0].text == second.choices[0].text
    many = _complete(client, PROMPTS[2], n=3, **kw)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]


def test_stop_string_cuts_the_text_where_the_greedy_answer_has_it(clients):
    client = clients["agg"]
    full = _complete(client, PROMPTS[3], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2 and stop in text
    cut = _complete(client, PROMPTS[3], max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_through_both_topologies(clients):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    outs = {name: c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
            for name, c in clients.items() if name != "decode_metrics"}
    assert outs["disagg"].choices[0].message.content == outs["agg"].choices[0].message.content
    assert outs["disagg"].choices[0].message.role == "assistant"


def test_bad_input_gets_the_openai_error_envelope(clients):
    client = clients["disagg"]
    with pytest.raises(openai.BadRequestError) as info:
        _complete(client, PROMPTS[0], max_tokens=100_000)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "max_tokens"
