"""Fixtures every test folder may use: the bundled SmolLM2 GGUF, its tokenizer, and a cache
directory for the `pdserve serve` processes tests start."""
import os
from pathlib import Path

import pytest

from pdserve.common.model_source import default_model_path
from pdserve.models.tokenizer import Tokenizer, load_tokenizer

# The process tests size their prompts and cached-token counts in 16-token KV blocks; a CPU
# worker's default is 64 (worker/__main__.py). Workers and servers the tests start read this
# environment variable unless they pass --block-size; unit tests resolve settings without the
# environment, and the compose test's containers run on the real default.
os.environ.setdefault("PDSERVE_BLOCK_SIZE", "16")


@pytest.fixture(scope="session")
def smollm_gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf_path) -> Tokenizer:
    """Ours, converted from the GGUF metadata (no cache: the conversion itself is under test)."""
    return load_tokenizer(smollm_gguf_path)


@pytest.fixture(scope="session")
def serve_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `--cache-dir` for the session's `pdserve serve` processes: the bundled model is
    converted once, not once per test."""
    return tmp_path_factory.mktemp("serve-cache")
