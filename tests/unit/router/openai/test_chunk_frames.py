"""A completion stream's plain chunks are written without models: byte for byte what
`sse_frame(CompletionResponse(...))` writes, whatever the text."""
import re

from hypothesis import given
from hypothesis import strategies as st

from pdserve.router.openai.completions import ChunkFrames
from pdserve.router.openai.responses import CompletionChoice, CompletionResponse
from pdserve.router.openai.streaming import sse_frame

CREATED = re.compile(rb'"created":\d+')


def _without_created(frame: bytes) -> bytes:
    return CREATED.sub(b'"created":0', frame)


@given(text=st.text(), index=st.integers(0, 1 << 20), finish=st.sampled_from([None, "stop", "length", "abort"]),
       response_id=st.text(min_size=1), model=st.text(min_size=1))
def test_a_plain_chunk_is_the_models_frame(text, index, finish, response_id, model) -> None:
    fast = ChunkFrames(response_id, model).chunk(index, text, finish)
    chunk = CompletionResponse(id=response_id, model=model,
                               choices=[CompletionChoice(index=index, text=text, finish_reason=finish)])
    assert _without_created(fast) == _without_created(sse_frame(chunk))
    assert CREATED.search(fast)


def test_the_hard_characters_are_escaped_as_the_model_escapes_them() -> None:
    for text in ['"', "\\", "\n\r\t", "\x00\x1f\x7f", "\u2028\u2029", "é😀", "</script>"]:
        test_a_plain_chunk_is_the_models_frame.hypothesis.inner_test(text, 0, None, "cmpl-x", "m")  # type: ignore[attr-defined]
