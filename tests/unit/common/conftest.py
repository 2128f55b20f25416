"""Fixtures shared by the common/ tests: the bundled SmolLM2 GGUF and its tokenizers."""
import os

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


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_gguf_path):
    """transformers' own tokenizer for the same GGUF file (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_gguf_path), gguf_file=os.path.basename(smollm_gguf_path)
    )
