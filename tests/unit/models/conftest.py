"""Fixtures of the models/ tests: transformers' own tokenizer for the bundled GGUF (the reference)."""
import os

import pytest


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_gguf_path):
    """transformers' own tokenizer for the same GGUF file (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_gguf_path), gguf_file=os.path.basename(smollm_gguf_path)
    )
