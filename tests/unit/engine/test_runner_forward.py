"""ModelRunner.forward refuses malformed batches without touching the KV tensor; copy_blocks works."""
import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.model.batch import ForwardBatch

from model_builders import chunk, load_runner, prompt, run


@pytest.fixture(scope="module")
def runner(checkpoints):
    return load_runner(checkpoints["llama"], num_blocks=8)


@pytest.mark.parametrize("bad, param", [
    (chunk("x", [], 0, [0]), "token_ids"),
    (chunk("x", [1, 300], 0, [0]), "token_ids"),
    (chunk("x", [1, -1], 0, [0]), "token_ids"),
    (chunk("x", [1, 2], 255, [0] * 64 + [1]), "start_pos"),
    (chunk("x", [1, 2], -1, [0]), "start_pos"),
    (chunk("x", [1, 2, 3], 2, [0]), "block_table"),
    (chunk("x", [1, 2], 0, [8]), "block_table"),
])
def test_bad_chunk_is_refused_and_changes_nothing(runner, bad, param):
    good = chunk("ok", [5, 6, 7], 0, [1])
    before = runner.kv_tensor.clone()
    with pytest.raises(InvalidRequestError) as err:
        runner.forward(ForwardBatch((good, bad)))
    assert err.value.param == param
    assert torch.equal(runner.kv_tensor, before)


def test_empty_batch_is_refused(runner):
    with pytest.raises(InvalidRequestError, match="at least one chunk"):
        runner.forward(ForwardBatch(()))


def test_logit_rows_per_chunk(runner):
    out = run(runner, chunk("a", [5, 6, 7], 0, [0], all_logits=True), chunk("b", [8, 9], 0, [1], needs_logits=False),
              chunk("c", [10], 0, [2]))
    assert [tuple(t.shape) for t in out] == [(3, 300), (0, 300), (1, 300)]


def test_copied_block_serves_as_the_prefix(runner, checkpoints):
    """Copy-on-write: after copy_blocks, decoding from the copy equals decoding from the original."""
    ids = prompt(7, seed=3)
    run(runner, chunk("a", ids[:6], 0, [4, 5], needs_logits=False))
    runner.copy_blocks([5], [6])
    [from_copy] = run(runner, chunk("b", ids[6:], 6, [4, 6]))
    torch.testing.assert_close(from_copy[0], checkpoints["llama"].hf_logits(ids)[-1], atol=1e-4, rtol=0)
    assert torch.equal(runner.kv_tensor[6, :, :, :2], runner.kv_tensor[5, :, :, :2])
