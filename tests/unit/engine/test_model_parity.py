"""Teacher-forced logits equal transformers' for every served family, however the prompt is split."""
from dataclasses import replace

import pytest
import torch

from pdserve.engine.model import decode_attention
from pdserve.engine.loading.rope_config import Rope
from pdserve.engine.model.layers import RotaryEmbedding

from model_builders import TOKENS_PER_BLOCK, chunk, load_runner, prompt, run

ARCHS = ["llama", "qwen2", "mistral", "llama3_rope", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe"]
PROMPT_LEN = 23  # odd, spans 6 blocks of 4, and longer than Mistral's window of 8
TOL = 1e-4


class _Runners(dict):
    """A runner per kind, loaded when a test first asks for it."""

    def __init__(self, checkpoints, kernels) -> None:
        super().__init__()
        self._checkpoints, self._kernels = checkpoints, kernels

    def __missing__(self, kind: str):
        self[kind] = load_runner(self._checkpoints[kind], kernels=self._kernels)
        return self[kind]


@pytest.fixture
def runners(checkpoints, kernels):
    return _Runners(checkpoints, kernels)


def scattered(num_blocks: int, seed: int) -> list[int]:
    """Distinct, out-of-order block ids: catches any assumption that a table is contiguous."""
    return torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:num_blocks].tolist()


def in_chunks(runner, token_ids: list[int], size: int, blocks: list[int]) -> torch.Tensor:
    rows = []
    for start in range(0, len(token_ids), size):
        piece = token_ids[start:start + size]
        rows += run(runner, chunk("r", piece, start, blocks, all_logits=True))
    return torch.cat(rows)


@pytest.mark.parametrize("kind", ARCHS)
def test_whole_prompt_matches_transformers(runners, checkpoints, kind):
    ids = prompt(PROMPT_LEN, seed=1)
    [logits] = run(runners[kind], chunk("r", ids, 0, scattered(6, seed=2), all_logits=True))
    assert logits.shape == (PROMPT_LEN, 300)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, checkpoints[kind].hf_logits(ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("size", [TOKENS_PER_BLOCK, 3, 1])
def test_chunked_prompt_matches_transformers(runners, checkpoints, kind, size):
    ids = prompt(PROMPT_LEN, seed=3)
    logits = in_chunks(runners[kind], ids, size, scattered(6, seed=4))
    torch.testing.assert_close(logits, checkpoints[kind].hf_logits(ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ARCHS)
def test_prefill_over_a_cached_prefix_of_another_sequence(runners, checkpoints, kind):
    runner, ids = runners[kind], prompt(PROMPT_LEN, seed=5)
    shared = [40, 7, 22]  # three full blocks: 12 prefix tokens
    [none] = run(runner, chunk("a", ids[:12], 0, shared + [1], needs_logits=False))
    assert none.shape == (0, 300)
    # A second sequence reuses the blocks as its prefix and computes only the rest.
    [rest] = run(runner, chunk("b", ids[12:], 12, shared + [9, 31, 3], all_logits=True))
    torch.testing.assert_close(rest, checkpoints[kind].hf_logits(ids)[12:], atol=TOL, rtol=0)


def test_needs_logits_returns_only_the_last_row(runners, checkpoints):
    ids = prompt(9, seed=6)
    [last] = run(runners["llama"], chunk("r", ids, 0, [5, 6, 7]))
    torch.testing.assert_close(last, checkpoints["llama"].hf_logits(ids)[-1:], atol=TOL, rtol=0)


def test_mistral_window_changes_logits_past_the_window(checkpoints):
    """Guards the window test above against a window that masks nothing."""
    ids = prompt(PROMPT_LEN, seed=1)
    hf = checkpoints["mistral"].hf_model
    with torch.no_grad():
        windowed = hf(torch.tensor([ids])).logits[0]
        hf.config.sliding_window = None
        try:
            full = hf(torch.tensor([ids])).logits[0]
        finally:
            hf.config.sliding_window = 8
    assert torch.equal(windowed[:8], full[:8])
    assert not torch.allclose(windowed[8:], full[8:], atol=TOL)


def test_llama3_scaling_matters_at_these_positions(checkpoints):
    """Guards the llama3 parity test: the same weights with unscaled rope give other logits."""
    runner = load_runner(checkpoints["llama3_rope"], kernels="torch")  # the rope swapped below is torch's
    runner.model.ropes = [RotaryEmbedding(Rope(runner.config.rope_theta), runner.config.head_dim, runner.device)]
    ids = prompt(PROMPT_LEN, seed=1)
    [unscaled] = run(runner, chunk("r", ids, 0, [0, 1, 2, 3, 4, 5], all_logits=True))
    assert not torch.allclose(unscaled, checkpoints["llama3_rope"].hf_logits(ids), atol=TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close(checkpoints, dtype):
    runner = load_runner(checkpoints["llama"], dtype=dtype)
    ids = prompt(PROMPT_LEN, seed=7)
    [logits] = run(runner, chunk("r", ids, 0, [3, 2, 1, 0, 4, 5], all_logits=True))
    reference = checkpoints["llama"].hf_logits(ids)
    assert runner.kv_tensor.dtype == getattr(torch, dtype)
    torch.testing.assert_close(logits, reference, atol=0.1, rtol=0.05)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("size, max_wide_kv_heads", [(5, 16), (1, 16), (1, 0)])
def test_fp8_kv_cache_stays_close(checkpoints, monkeypatch, size, max_wide_kv_heads):
    monkeypatch.setattr(decode_attention, "WIDE_QUERY_MAX_KV_HEADS", max_wide_kv_heads)
    runner = load_runner(checkpoints["llama"], kv_cache_dtype="fp8", kv_scale=0.5)
    ids = prompt(PROMPT_LEN, seed=8)
    logits = in_chunks(runner, ids, size, [8, 9, 10, 11, 12, 13])
    assert runner.kv_tensor.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(logits, checkpoints["llama"].hf_logits(ids), atol=0.25, rtol=0.05)


def test_longrope_positions_past_the_original_context_take_the_long_factors(checkpoints):
    """Phi-3's long frequencies equal transformers' for a sequence past the original context, and
    a position takes them only from there on (cos and sin scaled by the attention factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    runner = load_runner(checkpoints["phi3"], kernels="torch")
    [rope] = runner.model.ropes
    hf_config = checkpoints["phi3"].hf_model.config
    long, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=65)
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None)
    torch.testing.assert_close(rope.long_inv_freq, long, atol=0, rtol=0)
    torch.testing.assert_close(rope.inv_freq, short, atol=0, rtol=0)
    cos, _ = rope.cos_sin(torch.tensor([63, 64]), torch.float32)
    torch.testing.assert_close(cos[0, 0, :16], (63 * short).cos() * factor)
    torch.testing.assert_close(cos[1, 0, :16], (64 * long).cos() * factor)
