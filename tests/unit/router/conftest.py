import pytest

from pdserve.models.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The default model's real tokenizer, converted once per session."""
    return load_tokenizer(None, cache_dir=str(tmp_path_factory.getbasetemp() / "tokenizer-cache"))
