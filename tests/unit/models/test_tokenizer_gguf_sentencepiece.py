"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model` = "llama": Mixtral, Phi-3, Gemma 3),
against transformers' tokenizer for the same file and against llama.cpp's rules (llama_cpp_spm)."""
import pytest

from pdserve.common.errors import ConfigError
from pdserve.models.gguf_file import read_gguf
from pdserve.models.tokenizer import load_tokenizer
from tests.unit.models.gguf_vocab_builders import (
    CONTROL, GGUF_NAME, LEADING_SPACE_TEXTS, NORMAL, TEXTS, UNKNOWN, USER_DEFINED, sentencepiece_pieces,
    write_sentencepiece_gguf, write_tokenizer_gguf,
)
from tests.unit.models.llama_cpp_spm import llama_cpp_encode

LAYOUTS = ["mixtral", "phi3", "gemma3"]
SPECIAL_TEXTS = {  # text around each layout's own special tokens, as chat templates render it
    "mixtral": ["<s>[INST] What is 2+2? [/INST] 4.</s>", "a</s>b<unk>c"],
    "phi3": ["<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4.<|end|>", "x<|endoftext|> y"],
    "gemma3": ["<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
               "a  b   c    d     e", "tab\t  and  \n  spaces"],
}


@pytest.fixture(scope="module")
def pieces():
    return sentencepiece_pieces()


@pytest.fixture(scope="module", params=LAYOUTS)
def family(request, pieces, tmp_path_factory):
    """(layout, path, pdserve's tokenizer, transformers' tokenizer, metadata) for one layout."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp(request.param)
    path = write_sentencepiece_gguf(folder, request.param, pieces)
    reference = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    return request.param, path, load_tokenizer(str(path)), reference, read_gguf(str(path)).metadata


def llama_cpp_ids(metadata, text):
    return llama_cpp_encode(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"],
                            metadata["tokenizer.ggml.token_type"], text,
                            metadata.get("tokenizer.ggml.add_space_prefix", True))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers_and_llama_cpp(family, text):
    layout, _, tokenizer, reference, metadata = family
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert ids[1:] == llama_cpp_ids(metadata, text)  # after BOS, which both add by default
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_texts_use_byte_fallback_and_several_pieces(family):
    """The comparisons above mean something: emoji fall back to bytes, words merge."""
    _, _, tokenizer, _, _ = family
    emoji = tokenizer.encode("🎉", add_special_tokens=False)
    assert [tokenizer.id_to_token(i) for i in emoji][-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    assert len(tokenizer.encode("Hello world", add_special_tokens=False)) <= 3


@pytest.mark.parametrize("text", [t for texts in SPECIAL_TEXTS.values() for t in texts] + LEADING_SPACE_TEXTS)
def test_special_tokens_and_leading_spaces_follow_llama_cpp(family, text):
    """After a special token llama.cpp starts the text anew, with its space prefix, as SentencePiece
    did in training (and the HF tokenizer.json of Mixtral and Phi-3, whose normalizer prepends ▁ to
    each stretch between added tokens). transformers' Phi-3 and Gemma conversions agree; its Llama
    conversion (Metaspace, prepend_scheme "first") prefixes only the very start, and not a text
    that already starts with a space: for those files only llama.cpp is the reference."""
    layout, _, tokenizer, reference, metadata = family
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == llama_cpp_ids(metadata, text)
    if layout != "mixtral":
        assert ids == reference.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_special_tokens_in_text_match_whole(family):
    layout, _, tokenizer, _, _ = family
    markers = {"mixtral": ["<s>", "</s>", "<unk>"], "phi3": ["<|user|>", "<|end|>", "<|endoftext|>"],
               "gemma3": ["<start_of_turn>", "<end_of_turn>", "<bos>"]}[layout]
    for marker in markers:
        ids = tokenizer.encode(f"a{marker}b", add_special_tokens=False)
        assert [tokenizer.id_to_token(i) for i in ids].count(marker) == 1
        assert tokenizer.decode(ids) == ("a b" if layout != "gemma3" else "ab")


def test_bos_eos_and_end_of_turn_ids(family):
    """llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise, and ends a
    generation on the end-of-turn markers it knows by name (<|end|>, <end_of_turn>, ...) besides
    the file's eos: its converter writes one eos id, the tokenizer's, not the chat turn's."""
    layout, _, tokenizer, _, metadata = family
    bos, eos = metadata["tokenizer.ggml.bos_token_id"], metadata["tokenizer.ggml.eos_token_id"]
    assert tokenizer.bos_token_id == bos
    assert tokenizer.encode("x")[0] == bos
    names = [tokenizer.id_to_token(i) for i in tokenizer.eos_token_ids]
    assert names == {"mixtral": ["</s>"], "phi3": ["</s>", "<|endoftext|>", "<|end|>"],
                     "gemma3": ["<eos>", "<end_of_turn>"]}[layout]
    assert tokenizer.eos_token_ids[0] == eos


def test_vocab_size_is_the_files(family):
    _, _, tokenizer, _, metadata = family
    assert tokenizer.vocab_size == len(metadata["tokenizer.ggml.tokens"])


CHAT_TEMPLATES = {  # the shape of each family's template, as its GGUF carries it
    "phi3": ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + message['content'] + "
             "'<|end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
    "gemma3": ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' + "
               "message['content'] + '<end_of_turn>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
}


@pytest.mark.parametrize("layout", sorted(CHAT_TEMPLATES))
def test_chat_prompt_matches_transformers(tmp_path, pieces, layout):
    from transformers import AutoTokenizer

    path = write_sentencepiece_gguf(tmp_path, layout, pieces, **{"tokenizer.chat_template": CHAT_TEMPLATES[layout]})
    tokenizer, reference = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=GGUF_NAME)
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3? Answer in 世界 style 🎉"}]
    text = tokenizer.apply_chat_template(chat)
    assert text == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


# Exact ids on a hand-written vocabulary: <unk> <s> </s>, bytes 3..258, then pieces by score.
HAND_PIECES = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("ab", -4.0), ("▁ab", -5.0), ("▁a", -6.0), ("ba", -7.0)]


def write_hand_gguf(tmp_path, extra=(), **metadata):
    vocab = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    vocab += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    vocab += [(piece, score, NORMAL) for piece, score in HAND_PIECES]
    vocab += list(extra)
    keys = {"tokenizer.ggml.pre": "default", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    keys.update(metadata)
    return str(write_tokenizer_gguf(tmp_path, "llama", "llama", vocab, keys))


def test_merges_follow_scores_not_lengths(tmp_path):
    tokenizer = load_tokenizer(write_hand_gguf(tmp_path))
    ids = {piece: 259 + i for i, (piece, _) in enumerate(HAND_PIECES)}
    # "▁ab" would need ▁+ab (score -5) but ▁+a (-6) is worse than a+b (-4): a+b, then ▁+ab.
    assert tokenizer.encode("ab", add_special_tokens=False) == [ids["▁ab"]]
    assert tokenizer.encode("ba", add_special_tokens=False) == [ids["▁"], ids["ba"]]
    assert tokenizer.encode("c", add_special_tokens=False) == [ids["▁"], 3 + ord("c")]  # byte fallback
    assert tokenizer.encode("ab ab") == [1, ids["▁ab"], ids["▁ab"]]
    assert tokenizer.decode([1, ids["▁ab"], ids["▁ab"], 3 + ord("!")]) == "ab ab!"


def test_add_space_prefix_false_and_add_bos_false_and_add_eos(tmp_path):
    path = write_hand_gguf(tmp_path, **{"tokenizer.ggml.add_space_prefix": False,
                                        "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("ab") == [259 + 3, 2]  # "ab", then </s>
    assert tokenizer.encode("ab", add_special_tokens=False) == [259 + 3]
    assert tokenizer.decode([259 + 3, 259, 259 + 1]) == "ab a"


def test_user_defined_tokens_match_whole_and_stay_text(tmp_path):
    tokenizer = load_tokenizer(write_hand_gguf(tmp_path, extra=[("<think>", -1000.0, USER_DEFINED)]))
    think = 259 + len(HAND_PIECES)
    assert tokenizer.encode("a<think>b", add_special_tokens=False) == [259 + 5, think, 259, 259 + 2]
    assert tokenizer.decode([think]) == "<think>"  # not special: kept when specials are skipped


def test_padding_token_is_special_and_an_id_past_the_end_is_ignored(tmp_path):
    pad = 259 + len(HAND_PIECES)
    tokenizer = load_tokenizer(write_hand_gguf(tmp_path / "in", extra=[("<pad>", 0.0, NORMAL)],
                                               **{"tokenizer.ggml.padding_token_id": pad}))
    assert tokenizer.encode("a<pad>", add_special_tokens=False) == [259 + 5, pad]
    assert tokenizer.decode([259 + 5, pad]) == "a"
    past_the_end = load_tokenizer(write_hand_gguf(tmp_path / "past", **{"tokenizer.ggml.padding_token_id": 9999}))
    assert past_the_end.encode("ab") == [1, 259 + 4]


def test_a_cached_conversion_gives_the_same_ids(tmp_path, pieces):
    path = str(write_sentencepiece_gguf(tmp_path / "phi3", "phi3", pieces))
    first = load_tokenizer(path, cache_dir=str(tmp_path / "cache"))
    second = load_tokenizer(path, cache_dir=str(tmp_path / "cache"))
    for text in TEXTS + SPECIAL_TEXTS["phi3"]:
        assert first.encode(text) == second.encode(text)
    assert second.eos_token_ids == first.eos_token_ids


@pytest.mark.parametrize(("metadata", "field"), [
    ({"tokenizer.ggml.pre": "llama-bpe"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.remove_extra_whitespaces": True}, "tokenizer.ggml.remove_extra_whitespaces"),
    ({"tokenizer.ggml.precompiled_charsmap": [1, 2, 3]}, "tokenizer.ggml.precompiled_charsmap"),
    ({"tokenizer.ggml.add_sep_token": True}, "tokenizer.ggml.add_sep_token"),
    ({"tokenizer.ggml.bos_token_id": 9999}, "tokenizer.ggml.bos_token_id"),
    ({"tokenizer.ggml.eos_token_id": 9999}, "tokenizer.ggml.eos_token_id"),
])
def test_what_is_not_served_raises_config_error_naming_the_key(tmp_path, metadata, field):
    path = write_hand_gguf(tmp_path, **metadata)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(path)
    assert err.value.field == field

