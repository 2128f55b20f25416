"""Byte-level GGUF tokenizers split as Qwen2/Qwen3 split (`tokenizer.ggml.pre` = "qwen2"), against
transformers' tokenizer for the same file."""
import pytest

from pdserve.models.tokenizer import load_tokenizer
from tests.unit.models.gguf_vocab_builders import GGUF_NAME, LEADING_SPACE_TEXTS, TEXTS, write_byte_level_gguf

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TEXTS = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>",
    "a<|endoftext|>b",
]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def qwen(request, tmp_path_factory):
    """(pdserve's tokenizer, transformers' tokenizer) for a Qwen-style file of that architecture."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp(request.param)
    path = write_byte_level_gguf(folder, request.param, "qwen2", **{"tokenizer.chat_template": QWEN_CHAT_TEMPLATE})
    return load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)


@pytest.mark.parametrize("text", TEXTS + LEADING_SPACE_TEXTS + SPECIAL_TEXTS)
def test_encode_and_decode_match_transformers(qwen, text):
    tokenizer, reference = qwen
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text


def test_digits_split_one_by_one_and_contractions_any_case(qwen):
    """Qwen2's split: each digit alone (not llama3's runs of three), 's/'T/... in either case."""
    tokenizer, _ = qwen
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("12345")] == ["1", "2", "3", "4", "5"]
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("IT'S")][-1].upper() == "'S"


def test_special_ids_and_chat(qwen):
    tokenizer, reference = qwen
    assert tokenizer.eos_token_ids == (tokenizer.encode("<|im_end|>")[0],)
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id  # add_bos_token is false
    chat = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(chat)
    assert text == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
