"""A checkpoint's generation_config.json gives default sampling parameters as vLLM reads them:
the fields vLLM takes, not those equal to transformers' own defaults; `vllm` turns them off."""
import json
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError
from pdserve.models.generation_config import generation_defaults


def write_config(folder: Path, config: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_model_folder(tmp_path: Path) -> None:
    model = write_config(tmp_path / "model", {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_new_tokens": 300, "do_sample": True, "eos_token_id": [1, 2], "bos_token_id": 1})
    assert generation_defaults("auto", str(model)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 300}


def test_values_equal_to_transformers_defaults_are_not_defaults(tmp_path: Path) -> None:
    model = write_config(tmp_path, {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0})
    assert generation_defaults("auto", str(model)) == {}


def test_vllm_applies_none_and_a_folder_replaces_the_models(tmp_path: Path) -> None:
    model = write_config(tmp_path / "model", {"temperature": 0.6})
    other = write_config(tmp_path / "other", {"top_k": 5})
    assert generation_defaults("vllm", str(model)) == {}
    assert generation_defaults(str(other), str(model)) == {"top_k": 5}


def test_no_file_or_a_gguf_model_has_no_defaults(tmp_path: Path, smollm_gguf_path: str) -> None:
    assert generation_defaults("auto", str(tmp_path)) == {}
    assert generation_defaults("auto", smollm_gguf_path) == {}


def test_a_bad_source_or_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto, vllm or a folder"):
        generation_defaults(str(tmp_path / "missing"), str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        generation_defaults("auto", str(tmp_path))
