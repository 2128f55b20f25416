"""Fixtures: one set of tiny checkpoints per test session, built with model_builders."""
import pytest

from pdserve.engine.model.native import is_supported
from model_builders import ARCHITECTURES, TinyCheckpoint, make_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_checkpoint(root / kind, kind) for kind in ARCHITECTURES}


@pytest.fixture(params=["native", "torch"])
def kernels(request) -> str:
    """Each forward path in turn: the native CPU kernels and plain torch ops."""
    if request.param == "native" and not is_supported():
        pytest.skip("the native kernels need an AVX-512 CPU; this one has none")
    return request.param
