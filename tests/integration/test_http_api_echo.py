"""vLLM's conventions through `pdserve serve` (a prefill and a decode worker on a tiny random
checkpoint) and the official `openai` client: the model served under its `--model` path,
`echo` with the prompt's logprobs (checked against transformers' float32 log_softmax, and
computed by the decode worker itself, never a prefill worker), `max_tokens: 0`, streaming,
and `/tokenize` / `/detokenize`."""
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.integration.stack import free_port, make_tiny_checkpoint, start_serve, stop

pytestmark = pytest.mark.integration
TOL = 1e-4  # as the engine's logits parity tests
PROMPT = "The quick brown fox jumps over the lazy dog because"
NUM_TOP = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, checkpoint path) of `pdserve serve --model PATH` with a prefill and a decode worker."""
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_model_len=256))
    port = free_port()
    process, _ = start_serve(tmp_path_factory.mktemp("serve"), [
        "--model", checkpoint, "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--max-kv-tokens", "4096", "--cache-dir", "", "--prefill", "1", "--decode", "1",
        "--disagg-min-prefill-tokens", "1", "--insecure-internal", "--startup-timeout", "150"])
    try:
        yield f"http://127.0.0.1:{port}", checkpoint
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(stack: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(stack: tuple[str, str]) -> torch.Tensor:
    """transformers' float32 log_softmax over the prompt, (T, vocab)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    checkpoint = stack[1]
    ids = AutoTokenizer.from_pretrained(checkpoint)(PROMPT)["input_ids"]
    model = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def prompt_ids(url: str) -> list[int]:
    response = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_the_model_is_served_under_its_path_as_given(client: openai.OpenAI, stack: tuple[str, str]) -> None:
    assert [m.id for m in client.models.list().data] == [stack[1]]
    out = client.completions.create(model=stack[1], prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.model == stack[1]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=Path(stack[1]).name, prompt=PROMPT, max_tokens=2)


def test_tokenize_and_detokenize_agree_with_the_generation_routes(client: openai.OpenAI,
                                                                  stack: tuple[str, str]) -> None:
    url, checkpoint = stack
    ids = prompt_ids(url)
    out = client.completions.create(model=checkpoint, prompt=PROMPT, max_tokens=1, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    back = httpx.post(f"{url}/detokenize", json={"model": checkpoint, "tokens": ids}, timeout=30).json()
    assert back == {"prompt": PROMPT}
    assert httpx.get(f"{url}/version", timeout=30).json()["version"]
    refused = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs(client: openai.OpenAI, stack: tuple[str, str],
                                                                   reference: torch.Tensor) -> None:
    url, checkpoint = stack
    ids = prompt_ids(url)
    with httpx.Client(timeout=120) as http:
        raw = http.post(f"{url}/v1/completions", json={"model": checkpoint, "prompt": PROMPT, "echo": True,
                                                       "logprobs": NUM_TOP, "max_tokens": 0})
    assert raw.status_code == 200, raw.text
    assert "prefilled_by=local" in raw.headers["x-pdserve-route"]  # the decode worker computed the prompt
    out = client.completions.create(model=checkpoint, prompt=PROMPT, echo=True, logprobs=NUM_TOP, max_tokens=0)
    (choice,) = out.choices
    assert (choice.text, choice.finish_reason) == (PROMPT, "length")
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(ids)
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), want, atol=TOL, rtol=0)
    for position, top in enumerate(logprobs.top_logprobs[1:]):
        best = reference[position].topk(NUM_TOP).values
        assert top is not None and logprobs.tokens[position + 1] in top and len(top) in (NUM_TOP, NUM_TOP + 1)
        assert sorted(top.values(), reverse=True)[:NUM_TOP] == pytest.approx(best.tolist(), abs=TOL)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]


def test_echo_prepends_the_prompt_to_generated_text_and_logprobs(client: openai.OpenAI, stack: tuple[str, str],
                                                                  reference: torch.Tensor) -> None:
    url, checkpoint = stack
    ids = prompt_ids(url)
    plain = client.completions.create(model=checkpoint, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    echoed = client.completions.create(model=checkpoint, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    prompt_part, plain_part = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert prompt_part is not None and plain_part is not None
    assert prompt_part.tokens == [*prompt_part.tokens[:len(ids)], *plain_part.tokens]
    assert prompt_part.token_logprobs[len(ids):] == pytest.approx(plain_part.token_logprobs, abs=TOL)
    assert prompt_part.text_offset[len(ids)] == len("".join(prompt_part.tokens[:len(ids)]))
    want = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(prompt_part.token_logprobs[1:len(ids)]), want, atol=TOL, rtol=0)
    streamed = client.completions.create(model=checkpoint, prompt=PROMPT, max_tokens=4, temperature=0,
                                         echo=True, stream=True)
    chunks = [chunk.choices[0].text for chunk in streamed if chunk.choices]
    assert chunks[0].startswith(PROMPT) and "".join(chunks) == echoed.choices[0].text
    without_logprobs = client.completions.create(model=checkpoint, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert without_logprobs.choices[0].text == echoed.choices[0].text  # token ids echo as their text


def test_detokenization_options_pass_through_the_api(client: openai.OpenAI, stack: tuple[str, str]) -> None:
    """Accepted (they were refused before); the engine's tests show the special tokens they keep
    (tests/unit/engine/test_special_tokens.py: a random model rarely emits one)."""
    checkpoint = stack[1]
    options = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    kept = client.completions.create(model=checkpoint, prompt="<|im_start|>", max_tokens=12, temperature=0,
                                     logprobs=0, extra_body=options)
    default = client.completions.create(model=checkpoint, prompt="<|im_start|>", max_tokens=12, temperature=0)
    tokens = kept.choices[0].logprobs.tokens  # each token's text, special tokens included
    assert kept.choices[0].text == "".join(tokens)
    specials = [t for t in tokens if t.startswith("<|") and t.endswith("|>")]
    assert default.choices[0].text == "".join(t for t in tokens if t not in specials)
