import pytest

from pdserve.common.request import PriorityRange, SamplingParams
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import CompletionRequest
from pdserve.router.openai.sampling import (
    check_completion_supported,
    priority_ranges,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def refusal(call: object, *args: object) -> tuple[int, str, str | None]:
    with pytest.raises(ApiError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value.status, caught.value.message, caught.value.param


def test_max_tokens_default_is_capped_to_the_room_left() -> None:
    assert resolve_max_tokens(None, 16, num_prompt_tokens=120, max_model_len=128, param="max_tokens") == 8
    assert resolve_max_tokens(None, None, num_prompt_tokens=100, max_model_len=128, param="max_tokens") == 28
    assert resolve_max_tokens(28, None, num_prompt_tokens=100, max_model_len=128, param="max_tokens") == 28


def test_max_tokens_beyond_the_context_is_refused() -> None:
    assert refusal(resolve_max_tokens, 29, None, 100, 128, "max_completion_tokens") == (
        400, "this model's maximum context length is 128 tokens, but 100 prompt tokens plus "
             "max_completion_tokens=29 would need 129; reduce the prompt or 'max_completion_tokens'",
        "max_completion_tokens")


def test_sampling_params_defaults_and_mapping() -> None:
    assert sampling_params(completion(), 16, None, vocab_size=100) == SamplingParams(max_tokens=16)
    body = completion(temperature=0.0, top_k=-1, top_p=0.5, seed=7, stop="END", stop_token_ids=[3], n=2,
                      ignore_eos=True, include_stop_str_in_output=True)
    assert sampling_params(body, 4, 2, vocab_size=100) == SamplingParams(
        max_tokens=4, temperature=0.0, top_p=0.5, top_k=0, seed=7, stop=("END",), stop_token_ids=(3,),
        ignore_eos=True, n=2, logprobs=2, include_stop_str_in_output=True)


def test_logits_processor_fields_map_as_vllm_reads_them() -> None:
    body = completion(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.3, min_tokens=3,
                      logit_bias={"7": 250.0, "2": -1.5, "+7": -300})
    assert sampling_params(body, 4, None, vocab_size=100, bad_words=((5, 6),)) == SamplingParams(
        max_tokens=4, presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.3, min_tokens=3,
        logit_bias=((2, -1.5), (7, -100.0)), bad_words=((5, 6),))


@pytest.mark.parametrize(("fields", "max_tokens", "message", "param"), [
    ({"logit_bias": {"100": 1.0}}, 4, "logit_bias names token id 100, outside the vocabulary [0, 100)",
     "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, 4, "logit_bias names token id -1, outside the vocabulary [0, 100)", "logit_bias"),
    ({"logit_bias": {"the": 1.0}}, 4, "logit_bias key 'the' is not a token id", "logit_bias"),
    ({"logit_bias": {str(i % 100): 1.0 for i in range(1025)} | {f"+{i}": 1.0 for i in range(1025)}}, 4,
     "logit_bias names 1125 tokens; at most 1024", "logit_bias"),  # vLLM's bound, counted as sent
    ({"min_tokens": 5}, 4, "min_tokens (5) must be less than or equal to max_tokens (4)", "min_tokens"),
])
def test_bad_logits_processor_values_are_refused(fields: dict[str, object], max_tokens: int, message: str,
                                                 param: str) -> None:
    assert refusal(sampling_params, completion(**fields), max_tokens, None, 100) == (400, message, param)


def test_stop_token_ids_outside_the_vocabulary_are_refused() -> None:
    assert refusal(sampling_params, completion(stop_token_ids=[1, 100]), 4, None, 100) == (
        400, "token id 100 at stop_token_ids[1] is outside the vocabulary [0, 100)", "stop_token_ids")


def test_stop_strings_are_bounded() -> None:
    assert stop_strings(None) == ()
    assert stop_strings("a") == ("a",)
    assert refusal(stop_strings, ["s"] * 17) == (400, "at most 16 stop strings are allowed, got 17", "stop")
    assert refusal(stop_strings, ["s" * 257]) == (400, "each stop string must have 1 to 256 characters", "stop")


def test_priority_ranges_sorted_and_defaulting_to_the_prompt_end() -> None:
    body = completion(priority=[{"start": 8, "priority": 10, "duration_s": 5.0}, {"end": 8, "priority": 90}])
    assert priority_ranges(body, 20) == (PriorityRange(0, 8, 90), PriorityRange(8, 20, 10, 5.0))
    assert priority_ranges(completion(), 20) == ()


def test_overlapping_priority_ranges_are_refused() -> None:
    body = completion(priority=[{"start": 0, "end": 9, "priority": 10}, {"start": 8, "priority": 20}])
    assert refusal(priority_ranges, body, 20) == (400, "priority ranges overlap at token 8", "priority")


@pytest.mark.parametrize(("fields", "param"), [
    ({"best_of": 3}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),  # without echo: nothing to answer
    ({"suffix": "x"}, "suffix"),
])
def test_unimplemented_completion_fields_are_refused(fields: dict[str, object], param: str) -> None:
    assert refusal(check_completion_supported, completion(**fields))[2] == param


def test_neutral_values_of_unimplemented_fields_pass() -> None:
    check_completion_supported(completion(best_of=1))


def test_echo_with_logprobs_asks_the_worker_for_prompt_logprobs_and_detokenization_options_pass_on() -> None:
    body = completion(echo=True, logprobs=2, max_tokens=0, skip_special_tokens=False,
                      spaces_between_special_tokens=False)
    check_completion_supported(body)
    params = sampling_params(body, 1, body.logprobs, 100)
    assert (params.prompt_logprobs, params.logprobs, params.max_tokens) == (2, 2, 1)
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)
    assert sampling_params(completion(logprobs=2), 1, 2, 100).prompt_logprobs is None  # no echo
    assert sampling_params(completion(echo=True), 1, None, 100).prompt_logprobs is None  # no logprobs
    defaults = sampling_params(completion(), 1, None, 100)
    assert (defaults.skip_special_tokens, defaults.spaces_between_special_tokens) == (True, True)
