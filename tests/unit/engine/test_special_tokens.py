"""vLLM's special-token options through the engine: `skip_special_tokens`, and the text of the
token that stops a sequence (EOS or a stop token id), left out unless
`include_stop_str_in_output`."""
import pytest

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from token_store_runner import CharTokenizer, TokenStoreRunner, next_token

EOS = 0  # CharTokenizer's; it decodes to "A"


def generate(max_tokens: int, prompt: list[int], **sampling) -> list[tuple[tuple[int, ...], str, str | None]]:
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=4), 16)
    engine = LLMEngine(TokenStoreRunner(16, 4), kv, CharTokenizer(), SchedulerConfig(4, 64, 64))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    engine.add_request(GenerationRequest(RequestId("r"), tuple(prompt), params))
    outputs = []
    while engine.has_work:
        outputs += [(o.token_ids, o.text, o.finish_reason) for o in engine.step()]
    return outputs


def prompt_before(token: int) -> list[int]:
    """A one-token prompt whose greedy next token is `token`."""
    return [next(t for t in range(3, 97) if next_token([t]) == token)]


@pytest.mark.parametrize(("skip", "text"), [(True, ""), (False, "A")])
def test_skip_special_tokens_decides_whether_a_special_token_shows(skip, text):
    outputs = generate(1, prompt_before(EOS), ignore_eos=True, skip_special_tokens=skip)
    assert outputs == [((EOS,), text, "length")]


@pytest.mark.parametrize(("include", "text"), [(False, ""), (True, "A")])
def test_the_eos_that_stops_a_sequence_shows_only_with_include_stop_str_in_output(include, text):
    outputs = generate(4, prompt_before(EOS), skip_special_tokens=False, include_stop_str_in_output=include)
    assert outputs == [((EOS,), text, "stop")]


def test_an_ordinary_stop_token_is_left_out_of_the_text_as_vllm_does():
    prompt = [5, 6, 7]
    first = next_token(prompt)
    second = next_token([*prompt, first])
    assert second not in (EOS, first)
    letter = CharTokenizer().decode
    cut = generate(4, prompt, stop_token_ids=(second,))
    assert [text for _, text, _ in cut] == [letter([first]), ""] and cut[-1][2] == "stop"
    kept = generate(4, prompt, stop_token_ids=(second,), include_stop_str_in_output=True)
    assert "".join(text for _, text, _ in kept) == letter([first, second])


@pytest.fixture(scope="module")
def flat_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose final norm is zero: every logit is 0, so greedy picks id 0, which
    SmolLM2's tokenizer spells `<|endoftext|>`, a special token; a real model that emits one."""
    import torch

    from model_builders import make_checkpoint

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("flat"), "llama")
    with torch.no_grad():
        checkpoint.hf_model.model.norm.weight.zero_()
    checkpoint.hf_model.save_pretrained(checkpoint.path)
    return checkpoint


@pytest.mark.parametrize(("options", "text"), [
    ({}, ""),
    ({"skip_special_tokens": False}, "<|endoftext|>" * 3),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, "<|endoftext|>" * 3),  # byte-level
])
def test_a_real_model_and_tokenizer_show_special_tokens_only_when_asked(flat_checkpoint, smollm_tokenizer,
                                                                         options, text):
    from model_builders import load_runner

    kv = KvCacheManager(KvCacheConfig(tokens_per_block=4), 16)
    engine = LLMEngine(load_runner(flat_checkpoint, num_blocks=16), kv, smollm_tokenizer, SchedulerConfig(4, 64, 64))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, **options)
    engine.add_request(GenerationRequest(RequestId("r"), (5, 6, 7), params))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert [t for o in outputs for t in o.token_ids] == [0, 0, 0]
    assert "".join(o.text for o in outputs) == text
