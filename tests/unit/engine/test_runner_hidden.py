"""The target's hidden states out of a step (`ModelRunner.capture_hidden`), on every forward path:
the final normed state and the inputs of asked layers equal transformers' `hidden_states`, a
step's logits are the same bits with or without them, and nothing comes back unasked."""
import pytest
import torch

from pdserve.common.errors import ConfigError
from pdserve.engine.model.batch import ForwardBatch, HiddenCapture

from model_builders import blocks_for, chunk, load_runner, prompt

KINDS = ["llama", "qwen3", "gemma3"]


def _hf_hidden(checkpoint, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden_states: [i] enters layer i, the last is after the final norm."""
    with torch.no_grad():
        return checkpoint.hf_model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prompt_hidden_states_match_transformers(checkpoints, kernels, kind):
    runner = load_runner(checkpoints[kind], kernels=kernels)
    runner.capture_hidden(HiddenCapture(final=True, layers=(1, 0)))
    ids = prompt(13, seed=5)
    blocks = blocks_for(0, len(ids))
    finals, inputs = [], []
    for start, end in ((0, 6), (6, 7), (7, 13)):
        out = runner.forward(ForwardBatch((chunk("a", ids[start:end], start, blocks, is_prompt=True),)))
        finals.append(out.hidden.final)
        inputs.append(out.hidden.layers)
    hf = _hf_hidden(checkpoints[kind], ids)
    hidden = checkpoints[kind].hf_model.config.hidden_size
    torch.testing.assert_close(torch.cat(finals), hf[-1][0], atol=2e-4, rtol=1e-4)
    layers = torch.cat(inputs)
    assert layers.shape == (len(ids), 2 * hidden)
    torch.testing.assert_close(layers[:, :hidden], hf[1][0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(layers[:, hidden:], hf[0][0], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_the_same_bits_with_hidden_states(checkpoints, kernels, dtype):
    runner = load_runner(checkpoints["llama"], kernels=kernels, dtype=dtype)
    ids = prompt(9, seed=6)
    batch = ForwardBatch((chunk("a", ids[:5], 0, [0, 1], is_prompt=True), chunk("b", ids, 0, [2, 3, 4], all_logits=True)))
    plain = runner.forward(batch)
    assert plain.hidden is None
    runner.capture_hidden(HiddenCapture(final=True, layers=(1,)))
    captured = runner.forward(batch)
    assert [torch.equal(a, b) for a, b in zip(plain.logits, captured.logits)] == [True, True]
    assert captured.hidden.final.shape == (14, 128) and captured.hidden.layers.shape == (14, 128)
    assert captured.hidden.final.dtype == runner.dtype
    runner.capture_hidden(HiddenCapture())
    assert runner.forward(batch).hidden is None


def test_only_the_final_state_when_no_layer_is_asked(checkpoints, kernels):
    runner = load_runner(checkpoints["llama"], kernels=kernels)
    runner.capture_hidden(HiddenCapture(final=True))
    out = runner.forward(ForwardBatch((chunk("a", [5, 6, 7], 0, [0]),)))
    assert out.hidden.layers is None and out.hidden.final.shape == (3, 128)
    runner.capture_hidden(HiddenCapture(layers=(0,)))
    out = runner.forward(ForwardBatch((chunk("a", [5, 6, 7], 0, [0]),)))
    assert out.hidden.final is None and out.hidden.layers.shape == (3, 128)


def test_lm_head_logits_equal_the_steps_own(checkpoints, kernels):
    """A head drafting with the target's LM head gets the target's arithmetic for it."""
    runner = load_runner(checkpoints["llama"], kernels=kernels)
    runner.capture_hidden(HiddenCapture(final=True))
    out = runner.forward(ForwardBatch((chunk("a", prompt(6, seed=7), 0, [0, 1], all_logits=True),)))
    assert torch.equal(runner.lm_head_logits(out.hidden.final), out.logits[0])


def test_a_layer_the_model_lacks_is_refused(checkpoints):
    runner = load_runner(checkpoints["llama"], kernels="torch")
    with pytest.raises(ConfigError, match="layers 0..1"):
        runner.capture_hidden(HiddenCapture(layers=(2,)))
