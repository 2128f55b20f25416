"""The tokenizer of a Hugging Face checkpoint directory (written here by transformers' save_pretrained)."""
import json

import pytest

from pdserve.common.errors import ConfigError
from pdserve.models.tokenizer import load_tokenizer

TEXTS = ["Hello world", "héllo 世界 🎉", "<|im_start|>user\nHi<|im_end|>", " 12 ½"]
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}]


@pytest.fixture
def hf_dir(tmp_path, hf_gguf_tokenizer):
    """An HF checkpoint dir: tokenizer files from transformers, config.json naming one more eos."""
    hf_gguf_tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 0}))
    return tmp_path


def test_hf_dir_tokenizer_matches_transformers(hf_dir, hf_gguf_tokenizer):
    tokenizer = load_tokenizer(str(hf_dir))
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_gguf_tokenizer.encode(text)
    expected = hf_gguf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(CHAT) == expected
    assert tokenizer.bos_token_id == 1  # tokenizer_config's bos_token "<|im_start|>"
    assert tokenizer.eos_token_ids == (2, 0)  # tokenizer_config's eos first, then config.json's


def test_generation_config_adds_end_of_turn_ids(hf_dir):
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert load_tokenizer(str(hf_dir)).eos_token_ids == (2, 5, 0)


def test_chat_template_jinja_file_wins_over_config(hf_dir):
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "from config"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(str(hf_dir)).apply_chat_template(CHAT) == "Hi!"


@pytest.mark.parametrize("template", [
    "{{ bos_token }}{{ messages | length }}",
    [{"name": "tool_use", "template": "tools"},
     {"name": "default", "template": "{{ bos_token }}{{ messages | length }}"}],
])
def test_chat_template_from_tokenizer_config(hf_dir, template):
    (hf_dir / "chat_template.jinja").unlink()
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(hf_dir)).apply_chat_template(CHAT) == "<|im_start|>3"


def test_missing_tokenizer_json_raises_config_error(hf_dir):
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(hf_dir))
    assert (err.value.field, err.value.value) == ("model", str(hf_dir))


def test_broken_tokenizer_config_raises_config_error(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(hf_dir))
    assert err.value.field == "tokenizer_config.json"
