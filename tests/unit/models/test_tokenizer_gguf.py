"""The tokenizer rebuilt from the SmolLM2 GGUF, against transformers' tokenizer for the same file."""
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pdserve.common.errors import ConfigError
from pdserve.models.gguf_byte_level import pre_tokenizer
from pdserve.models.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "héllo wörld, café crème brûlée",
    "世界你好，今天天气很好。",
    "Emoji: 🎉🤖👍🏽 and ZWJ 👩‍💻",
    "Привет, мир! مرحبا بالعالم",
    "  two  spaces\n\n\tnew line and tab  ",
    "I'm sure they'll've done it, don't you?",
    "def f(x):\n    return x ** 2  # ok",
    "<|im_start|>user\nHi<|im_end|>\n",
]
CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in 世界 style 🎉"},
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(smollm_tokenizer, hf_gguf_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    assert ids == hf_gguf_tokenizer.encode(text)
    assert smollm_tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == hf_gguf_tokenizer.decode(ids)


@pytest.mark.parametrize("messages", [CHAT, [{"role": "system", "content": "Be terse."}] + CHAT])
def test_chat_template_matches_transformers(smollm_tokenizer, hf_gguf_tokenizer, messages):
    expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm_tokenizer.apply_chat_template(messages) == expected
    without_prompt = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == without_prompt


def test_special_tokens_and_sizes(smollm_tokenizer):
    assert smollm_tokenizer.bos_token_id == 1
    assert smollm_tokenizer.eos_token_ids == (2,)
    assert smollm_tokenizer.vocab_size == 49152
    assert [smollm_tokenizer.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smollm_tokenizer.id_to_token(49152) is None
    assert smollm_tokenizer.encode("a<|im_end|>b") == [81, 2, 82]  # control tokens match whole
    assert smollm_tokenizer.encode("Hi", add_special_tokens=True) == smollm_tokenizer.encode("Hi", False)


def test_numerals_are_split_like_llama_cpp_smollm_pre_tokenizer(smollm_tokenizer):
    """SmolLM2 splits every numeric character alone (its tokenizer.json: Digits(individual)).
    transformers' GGUF conversion omits that step and keeps " ½" whole; llama.cpp does not."""
    assert smollm_tokenizer.encode(" ½") == [216, 16738]  # "Ġ", "½"
    assert smollm_tokenizer.encode(" 42") == [216, 36, 34]  # "Ġ", "4", "2"


def test_cached_conversion_is_reused_and_identical(smollm_gguf_path, smollm_tokenizer, tmp_path):
    first = load_tokenizer(smollm_gguf_path, cache_dir=str(tmp_path))
    files = sorted(p.name.split(".", 1)[1] for p in tmp_path.iterdir())
    assert files == ["spec.json", "tokenizer.json"]
    spec = json.loads(next(tmp_path.glob("*.spec.json")).read_text())
    assert (spec["bos_token_id"], spec["eos_token_ids"]) == (1, [2])
    assert spec["chat_template"].startswith("{% for message in messages %}")
    second = load_tokenizer(smollm_gguf_path, cache_dir=str(tmp_path))
    for text in TEXTS:
        assert first.encode(text) == second.encode(text) == smollm_tokenizer.encode(text)
    assert second.apply_chat_template(CHAT) == smollm_tokenizer.apply_chat_template(CHAT)
    assert (second.bos_token_id, second.eos_token_ids) == (1, (2,))


def test_damaged_cache_entry_is_converted_again(tmp_path):
    write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", "gpt2")
    cache = tmp_path / "cache"
    load_tokenizer(str(tmp_path / "t.gguf"), cache_dir=str(cache))
    cached_json = next(cache.glob("*.tokenizer.json"))
    cached_json.write_text("{damaged")
    assert load_tokenizer(str(tmp_path / "t.gguf"), cache_dir=str(cache)).encode("abab") == [2, 2]
    assert json.loads(cached_json.read_text())["model"]["type"] == "BPE"  # rewritten


def test_importing_and_using_the_tokenizer_never_imports_torch(smollm_gguf_path):
    code = (
        "import sys; from pdserve.models.tokenizer import load_tokenizer; "
        "import pdserve.engine.core.detokenizer; "
        f"t = load_tokenizer({smollm_gguf_path!r}); t.apply_chat_template([{{'role': 'user', 'content': 'x'}}]); "
        "print(t.encode('hi'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[6004] False"


def write_tokenizer_gguf(path, model: str, pre: str, add_bos: bool = False, merges: bool = True) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "<s>"])
    if merges:
        writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1, 3])
    if add_bos:
        writer.add_uint32("tokenizer.ggml.bos_token_id", 3)
        writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_tokenizer_merges(tmp_path):
    write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", "gpt2")
    tokenizer = load_tokenizer(str(tmp_path / "t.gguf"))
    assert tokenizer.encode("abab") == [2, 2]
    assert tokenizer.encode("ba") == [1, 0]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.has_chat_template) == (None, (), False)


def test_add_bos_token_flag_adds_bos_with_special_tokens(tmp_path):
    write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", "gpt2", add_bos=True)
    tokenizer = load_tokenizer(str(tmp_path / "t.gguf"))
    assert tokenizer.encode("ab") == [3, 2]
    assert tokenizer.encode("ab", add_special_tokens=False) == [2]
    assert tokenizer.encode("<s>b", add_special_tokens=False) == [3, 1]
    assert tokenizer.decode([3, 2]) == "ab"
    assert tokenizer.bos_token_id == 3


def test_add_bos_token_without_a_bos_id_raises_config_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tmp_path / "t.gguf"))
    assert err.value.field == "tokenizer.ggml.bos_token_id"


@pytest.mark.parametrize(("name", "pieces"), [
    ("gpt2", ["I", "'m", "Ġ12345", "Ġok"]),
    ("smollm", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),
    ("llama-bpe", ["I", "'m", "Ġ", "123", "45", "Ġok"]),
    ("qwen2", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),
])
def test_pre_tokenizers_split_like_llama_cpp(name, pieces):
    assert [piece for piece, _ in pre_tokenizer(name).pre_tokenize_str("I'm 12345 ok")] == pieces


@pytest.mark.parametrize(("model", "pre", "merges", "field"), [
    ("bert", "default", True, "tokenizer.ggml.model"),
    ("gpt2", "qwen35", True, "tokenizer.ggml.pre"),
    ("gpt2", "gpt2", False, "tokenizer.ggml.merges"),
    ("llama", "default", False, "tokenizer.ggml.scores"),  # SentencePiece merges by score
])
def test_unsupported_gguf_tokenizers_raise_config_error(tmp_path, model, pre, merges, field):
    write_tokenizer_gguf(tmp_path / "t.gguf", model, pre, merges=merges)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tmp_path / "t.gguf"), cache_dir=str(tmp_path / "cache"))
    assert err.value.field == field
    assert not (tmp_path / "cache").exists()  # nothing cached for a failed conversion

