import json
import os

import pytest

from bench_fake_server import Behavior, FakeServer
from pdserve.common.model_source import default_model_path
from pdserve.models.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's real tokenizer (SmolLM2), loaded once."""
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """The default model's tokenizer saved as a Hugging Face directory (fast to load), with the
    config.json that makes pdserve's loader accept it as a checkpoint directory."""
    from transformers import AutoTokenizer

    gguf = default_model_path()
    directory = tmp_path_factory.mktemp("tokenizer")
    hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    hf.save_pretrained(directory)
    config = {"model_type": "llama", "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture
def serve():
    """serve(Behavior(...)) starts a fake OpenAI server for the test and stops it after."""
    servers = []

    def start(behavior: Behavior | None = None) -> FakeServer:
        server = FakeServer(behavior or Behavior()).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
