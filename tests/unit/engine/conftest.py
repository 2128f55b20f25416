"""Fixtures: one set of tiny checkpoints per test session, built with model_builders."""
import pytest

from model_builders import ARCHITECTURES, TinyCheckpoint, make_checkpoint
from native_levels import LEVELS_HERE


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_checkpoint(root / kind, kind) for kind in ARCHITECTURES}


@pytest.fixture(params=[*LEVELS_HERE, "torch"])
def kernels(request) -> str:
    """Each forward path in turn: the native CPU kernels of every ISA level this CPU runs, each
    forced, and plain torch ops."""
    return request.param
