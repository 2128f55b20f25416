"""The native kernels of every ISA level this CPU runs on the families beyond Llama's (issue 44),
where test_model_parity.py's short prompts do not reach: Phi-3's LongRoPE past its original
context, bf16 weights, and what the kernels refuse. Teacher-forced parity for every family:
test_model_parity.py."""
import copy
import json
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.native_forward import native_unsupported_reason

from model_builders import chunk, load_runner, prompt, run
from native_levels import LEVELS_HERE

LONG_FROM = 64  # the phi3 checkpoint's original context: positions from here take the long factors
LONG_PROMPT = 80


def teacher_forced(runner, ids: list[int], sizes: list[int]) -> torch.Tensor:
    """Every position's logits, the prompt fed in chunks of `sizes`."""
    rows, start, blocks = [], 0, list(range(-(-len(ids) // 4)))
    for size in sizes:
        rows += run(runner, chunk("r", ids[start:start + size], start, blocks, all_logits=True))
        start += size
    return torch.cat(rows)


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("sizes", [[LONG_PROMPT], [60, 5, 15], [LONG_FROM - 1, 1, 1] + [1] * 15])
def test_longrope_positions_past_the_original_context_equal_the_torch_path(checkpoints, level, sizes):
    """Positions from `long_from` on rotate by the long frequencies, scaled by the attention
    factor, as the torch path rotates them (transformers picks one set per forward, so the torch
    path is the reference here), whole, chunked across the boundary or decoded across it."""
    ids = prompt(LONG_PROMPT, seed=12)
    reference = teacher_forced(load_runner(checkpoints["phi3"], kernels="torch"), ids, [LONG_PROMPT])
    native = load_runner(checkpoints["phi3"], kernels=level)
    [rope] = native.model.ropes
    assert rope.long_from == LONG_FROM and rope.long_inv_freq is not None
    torch.testing.assert_close(teacher_forced(native, ids, sizes), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3"])
def test_bf16_families_stay_close_to_transformers(checkpoints, tmp_path, level, kind):
    """bf16 weights (panels at AVX2, oneDNN's packing at AVX-512) through the q/k norms, Gemma's
    norms, GeGLU and scales: as close to transformers' float32 logits as Llama's bf16 run is
    (test_model_parity.py)."""
    copy.deepcopy(checkpoints[kind].hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    runner = load_runner(SimpleNamespace(path=tmp_path), dtype="bfloat16", kernels=level)
    assert runner.native is not None
    ids = prompt(23, seed=7)
    [logits] = run(runner, chunk("r", ids, 0, [3, 2, 1, 0, 4, 5], all_logits=True))
    reference = checkpoints[kind].hf_logits(ids)
    torch.testing.assert_close(logits, reference, atol=0.1, rtol=0.05)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def reason_for(checkpoint) -> str | None:
    """What native_unsupported_reason says of a float32 CPU model of `checkpoint`'s config."""
    config = ModelConfig.from_hf_config(json.loads((checkpoint.path / "config.json").read_text()))
    return native_unsupported_reason(SimpleNamespace(config=config, embed=torch.zeros(1)),
                                     SimpleNamespace(tensor=torch.zeros(1)))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe"])
def test_served_families_are_not_refused(checkpoints, kind):  # the mixtures' refusals: test_native_moe.py
    assert reason_for(checkpoints[kind]) is None


def test_heads_wider_than_the_attention_kernels_read_run_on_torch_ops(checkpoints):
    config = ModelConfig.from_hf_config({**json.loads((checkpoints["llama"].path / "config.json").read_text()),
                                         "head_dim": 288})
    reason = native_unsupported_reason(SimpleNamespace(config=config, embed=torch.zeros(1)),
                                       SimpleNamespace(tensor=torch.zeros(1)))
    assert reason is not None and "head_dim 288" in reason
