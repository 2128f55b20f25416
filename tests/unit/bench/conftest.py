import pytest

from bench_fake_server import Behavior, FakeServer
from pdserve.common.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's real tokenizer (SmolLM2), loaded once."""
    return load_tokenizer(None)


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
