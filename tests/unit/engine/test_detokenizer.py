"""Incremental detokenization on the real SmolLM2 tokenizer, and stop strings across deltas."""
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.core.detokenizer import IncrementalDetokenizer, StopChecker, StopPiece

MULTIBYTE = "Party 🎉 世界, naïve café 👩‍💻 ½ — Привет 你好!"


def stream(tokenizer, ids, prompt=(), per_step=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens)
    deltas = [detok.add(ids[i:i + per_step]) for i in range(0, len(ids), per_step)]
    return deltas, detok.flush()


def test_emoji_and_cjk_are_never_split(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Party 🎉 世界")
    deltas, tail = stream(smollm_tokenizer, ids)
    # 🎉 spans three tokens, 世 and 界 two or three each: nothing shows until a character is whole.
    assert deltas == ["Part", "y", "", "", " 🎉", " ", "", "世", "", "", "界"]
    assert tail == ""


def test_streamed_text_equals_full_decode(smollm_tokenizer):
    ids = smollm_tokenizer.encode(MULTIBYTE)
    prompt = smollm_tokenizer.encode("Say something:")
    for per_step in (1, 2, 3):
        deltas, tail = stream(smollm_tokenizer, ids, prompt, per_step)
        assert "".join(deltas) + tail == smollm_tokenizer.decode(ids) == MULTIBYTE
        assert not any("\ufffd" in delta for delta in deltas)


def test_flush_releases_an_unfinished_character(smollm_tokenizer):
    ids = smollm_tokenizer.encode("ok 🎉")[:-1]  # generation stopped inside the emoji's bytes
    deltas, tail = stream(smollm_tokenizer, ids)
    assert deltas == ["ok", "", ""]
    assert tail == " \ufffd"
    assert "".join(deltas) + tail == smollm_tokenizer.decode(ids)


def test_special_tokens_skipped_or_kept(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hi<|im_end|> there")
    skipped, _ = stream(smollm_tokenizer, ids)
    kept, _ = stream(smollm_tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi<|im_end|> there"


def test_stop_string_spanning_deltas_is_cut():
    checker = StopChecker(["STOP"])
    assert checker.feed("Hello S") == StopPiece("Hello ", False)  # "S" may start "STOP"
    assert checker.feed("T") == StopPiece("", False)
    assert checker.feed("OP and more") == StopPiece("", True)
    assert checker.feed("ignored") == StopPiece("", True)
    assert checker.flush() == ""


def test_include_stop_str_in_output():
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert checker.feed("Hello ST") == StopPiece("Hello ", False)
    assert checker.feed("OP and more") == StopPiece("STOP", True)


def test_false_start_is_released_and_flush_returns_held_text():
    checker = StopChecker(["\n\nUser:"])
    assert checker.feed("a\n") == StopPiece("a", False)
    assert checker.feed("\nUs") == StopPiece("", False)
    assert checker.feed("e") == StopPiece("", False)
    assert checker.feed("d") == StopPiece("\n\nUsed", False)
    assert checker.feed("\n") == StopPiece("", False)
    assert checker.flush() == "\n"


def test_first_completed_stop_wins_then_longest():
    assert StopChecker(["cd", "b"]).feed("abcd") == StopPiece("a", True)
    assert StopChecker(["ab", "abc"], True).feed("xabcd") == StopPiece("xab", True)  # "ab" completes first
    assert StopChecker(["c", "abc"], True).feed("xabcd") == StopPiece("xabc", True)  # tie: the longer


def test_stop_string_across_real_tokens(smollm_tokenizer):
    ids = smollm_tokenizer.encode("The answer is 42. 世界 Done.")
    detok = IncrementalDetokenizer(smollm_tokenizer, [])
    checker = StopChecker(["界 Do"])
    sent = []
    for token_id in ids:
        piece = checker.feed(detok.add([token_id]))
        sent.append(piece.text)
        if piece.stopped:
            break
    assert "".join(sent) == "The answer is 42. 世"


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
    include=st.booleans(),
)
def test_streaming_equals_one_shot_truncation(text, stops, cuts, include):
    """However the text is cut into deltas, what is sent equals cutting the whole text once."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if found:
        _, start, stop = min(found)
        expected = text[: start + len(stop)] if include else text[:start]
    else:
        expected = text
    checker = StopChecker(stops, include)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    sent = "".join(checker.feed(text[a:b]).text for a, b in zip(bounds, bounds[1:]))
    sent += checker.flush()
    assert sent == expected
    assert checker.stopped == bool(found)
