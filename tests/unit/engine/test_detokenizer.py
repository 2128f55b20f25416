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


def word_piece_tokenizer():
    """A tokenizer whose decoder puts a space between tokens (WordPiece, as BERT's), with two
    special tokens and one plain added token: where vLLM's special-token options show."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from pdserve.models.tokenizer import Tokenizer
    from pdserve.models.tokenizer_files import TokenizerSpec

    backend = Backend(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["<a>", "<b>"])  # ids 3, 4
    backend.add_tokens(["<c>"])  # id 5
    return Tokenizer(backend, TokenizerSpec(None, (), None))


def detokenized(ids, per_step=1, **options):
    tokenizer = word_piece_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, [1], added_token_ids=tokenizer.added_token_ids, **options)
    return "".join(detok.add(ids[i:i + per_step]) for i in range(0, len(ids), per_step)) + detok.flush()


def test_added_token_ids_are_every_added_token_special_or_not():
    assert word_piece_tokenizer().added_token_ids == {3, 4, 5}


def test_special_tokens_are_skipped_by_default_and_kept_on_request():
    ids = [3, 1, 4, 5, 2]  # <a> hello <b> <c> world
    assert detokenized(ids) == " hello <c> world"
    assert detokenized(ids, skip_special_tokens=False) == " <a> hello <b> <c> world"


def test_without_spaces_between_special_tokens_adjacent_added_tokens_are_joined_bare():
    ids = [3, 4, 1, 4, 5, 3, 2]  # <a> <b> hello <b> <c> <a> world
    for per_step in (1, 2, 7):
        kept = detokenized(ids, per_step, skip_special_tokens=False)
        joined = detokenized(ids, per_step, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert kept == " <a> <b> hello <b> <c> <a> world"
        assert joined == " <a><b> hello <b><c><a> world"
    # skipping special tokens makes the option moot, as in vLLM
    assert detokenized(ids, skip_special_tokens=True, spaces_between_special_tokens=False) == detokenized(ids)


def test_byte_level_tokenizers_read_the_same_either_way(smollm_tokenizer):
    ids = smollm_tokenizer.encode("<|im_start|><|im_end|>hi<|im_end|>", add_special_tokens=False)
    added = smollm_tokenizer.added_token_ids
    texts = {spaces: "".join(
        IncrementalDetokenizer(smollm_tokenizer, [], False, spaces, added).add([t]) for t in ids)
        for spaces in (True, False)}
    assert texts[True] == texts[False] == "<|im_start|><|im_end|>hi<|im_end|>"
