"""Fixtures every test folder may use: the bundled SmolLM2 GGUF and its tokenizer."""
import pytest

from pdserve.common.model_source import default_model_path
from pdserve.models.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def smollm_gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf_path) -> Tokenizer:
    """Ours, converted from the GGUF metadata (no cache: the conversion itself is under test)."""
    return load_tokenizer(smollm_gguf_path)
