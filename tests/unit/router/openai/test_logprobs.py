from pdserve.common.request import TokenLogprob
from pdserve.models.tokenizer import Tokenizer
from pdserve.router.openai.logprobs import LogprobFormatter
from pdserve.router.openai.responses import ChatTokenLogprob, CompletionLogprobs, TopLogprob


def test_completion_format_includes_the_sampled_token_and_offsets(tokenizer: Tokenizer) -> None:
    red, cat = tokenizer.encode(" red")[0], tokenizer.encode(" cat")[0]
    entries = [TokenLogprob(red, -0.5, ((cat, -0.25), (red, -0.5))), TokenLogprob(cat, float("-inf"), ())]
    out, offset = LogprobFormatter(tokenizer).completion(entries, num_top=1, text_offset=3)
    assert out == CompletionLogprobs(
        tokens=[" red", " cat"], token_logprobs=[-0.5, -9999.0],
        top_logprobs=[{" cat": -0.25, " red": -0.5}, {" cat": -9999.0}], text_offset=[3, 7])
    assert offset == 11


def test_chat_format_lists_top_n_with_bytes(tokenizer: Tokenizer) -> None:
    red, cat = tokenizer.encode(" red")[0], tokenizer.encode(" cat")[0]
    (entry,) = LogprobFormatter(tokenizer).chat([TokenLogprob(red, -0.5, ((cat, -0.25), (red, -0.5)))], num_top=1)
    assert entry == ChatTokenLogprob(token=" red", logprob=-0.5, bytes=[32, 114, 101, 100],
                                     top_logprobs=[TopLogprob(token=" cat", logprob=-0.25, bytes=[32, 99, 97, 116])])


def test_an_echoed_prompt_starts_at_offset_0_with_a_null_first_entry(tokenizer: Tokenizer) -> None:
    the, red, cat = (tokenizer.encode(word)[0] for word in ("The", " red", " cat"))
    entries = [TokenLogprob(red, -3.0, ((cat, -1.0), (red, -3.0))), TokenLogprob(cat, -0.5, ((cat, -0.5),))]
    out, offset = LogprobFormatter(tokenizer).echoed_prompt([the, red, cat], entries, num_top=1)
    assert out == CompletionLogprobs(
        tokens=["The", " red", " cat"], token_logprobs=[None, -3.0, -0.5],
        top_logprobs=[None, {" cat": -1.0, " red": -3.0}, {" cat": -0.5}], text_offset=[0, 3, 7])
    assert offset == 11
    assert out.model_dump()["token_logprobs"][0] is None  # JSON null, as OpenAI writes it
