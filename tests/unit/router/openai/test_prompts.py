import pytest

from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.prompts import Prompt, chat_prompt, completion_prompts
from pdserve.router.openai.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 49152


def prompts(tokenizer: Tokenizer, prompt: object, max_model_len: int = 64) -> list[Prompt]:
    return completion_prompts(CompletionRequest.model_validate({"prompt": prompt}), tokenizer, VOCAB, max_model_len)


def test_each_prompt_form(tokenizer: Tokenizer) -> None:
    hello = tuple(tokenizer.encode("Hello world"))
    assert prompts(tokenizer, "Hello world") == [Prompt(hello, "prompt", "Hello world")]
    assert prompts(tokenizer, [5, 6]) == [Prompt((5, 6), "prompt")]
    assert prompts(tokenizer, ["Hello world", "Hi"]) == [
        Prompt(hello, "prompt[0]", "Hello world"), Prompt(tuple(tokenizer.encode("Hi")), "prompt[1]", "Hi")]
    assert prompts(tokenizer, [[5], [6, 7]]) == [Prompt((5,), "prompt[0]"), Prompt((6, 7), "prompt[1]")]


def test_bad_prompts_name_the_element(tokenizer: Tokenizer) -> None:
    cases = {
        "[[5], []]": ("'prompt[1]' must contain at least one token", "prompt[1]"),
        "[[5], [-1]]": ("token id -1 at prompt[1][0] is outside the vocabulary [0, 49152)", "prompt[1]"),
        "[1, 2, 3, 4]": ("this model's maximum context length is 4 tokens, but 'prompt' has 4 tokens, "
                         "leaving no room to generate; shorten it", "prompt"),
    }
    for raw, expected in cases.items():
        with pytest.raises(ApiError) as caught:
            completion_prompts(CompletionRequest.model_validate_json('{"prompt": %s}' % raw), tokenizer, VOCAB, 4)
        assert (caught.value.message, caught.value.param) == expected


def test_chat_is_rendered_then_encoded_without_extra_specials(tokenizer: Tokenizer) -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]})
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert chat_prompt(body, tokenizer, 4096) == Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)),
                                                          "messages")


class RecordingTokenizer:
    """Records what the chat template would be given."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, dict]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        self.calls.append((messages, extra))
        return "rendered"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2, 3]


def test_tools_reach_the_template_only_when_given() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]})
    recorder = RecordingTokenizer()
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat_prompt(body, recorder, 64)
    chat_prompt(body, recorder, 64, tools)
    assert recorder.calls == [([{"role": "user", "content": "Hi"}], {}),
                              ([{"role": "user", "content": "Hi"}], {"tools": tools})]
