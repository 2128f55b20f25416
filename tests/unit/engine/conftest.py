"""Fixtures: one set of tiny checkpoints per test session, built with model_builders."""
import pytest

from model_builders import ARCHITECTURES, TinyCheckpoint, make_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_checkpoint(root / kind, kind) for kind in ARCHITECTURES}
