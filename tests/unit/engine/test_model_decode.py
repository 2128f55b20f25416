"""Greedy decoding of several sequences in one batch is token-identical to transformers' generate."""
import pytest
import torch

from pdserve.engine.model import decode_attention

from model_builders import TOKENS_PER_BLOCK, chunk, load_runner, prompt, run

NEW_TOKENS = 12
PROMPT_LENS = [3, 11, 6, 17]


def hf_greedy(checkpoint, token_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = checkpoint.hf_model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                           eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


class GreedyLoop:
    """What a scheduler does, reduced to the minimum: each sequence owns a fixed block range."""

    def __init__(self, runner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        max_len = max(len(p) for p in prompts) + NEW_TOKENS
        per_seq = -(-max_len // TOKENS_PER_BLOCK)
        # Interleaved ids: sequence i owns blocks i, i + n, i + 2n, ...
        self.tables = [list(range(i, per_seq * len(prompts), len(prompts))) for i in range(len(prompts))]

    def step(self, active: list[int]) -> None:
        """One forward over every active sequence's uncomputed tokens; append each argmax."""
        chunks = [chunk(str(i), self.tokens[i][self.computed[i]:], self.computed[i], self.tables[i])
                  for i in active]
        for i, logits in zip(active, run(self.runner, *chunks)):
            self.computed[i] = len(self.tokens[i])
            self.tokens[i].append(int(logits[-1].argmax()))

    def generated(self, i: int, prompt_len: int) -> list[int]:
        return self.tokens[i][prompt_len:]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3"])
def test_batched_greedy_decode_matches_generate(checkpoints, kind, kernels):
    prompts = [prompt(n, seed=10 + n) for n in PROMPT_LENS]
    loop = GreedyLoop(load_runner(checkpoints[kind], kernels=kernels), prompts)
    everyone = list(range(len(prompts)))
    for _ in range(NEW_TOKENS):
        loop.step(everyone)  # first step: every prefill in one batch; then one token each
    for i, p in enumerate(prompts):
        assert loop.generated(i, len(p)) == hf_greedy(checkpoints[kind], p), f"sequence {i}"


def test_late_prefill_joins_running_decodes(checkpoints, kernels):
    """A prompt prefilled in the same batch as other sequences' decode tokens (a mixed step)."""
    prompts = [prompt(n, seed=20 + n) for n in PROMPT_LENS]
    loop = GreedyLoop(load_runner(checkpoints["llama"], kernels=kernels), prompts)
    for step in range(NEW_TOKENS + 3):
        active = [0, 1, 2] if step < 3 else [0, 1, 2, 3]  # sequence 3 starts at step 3
        loop.step([i for i in active if len(loop.tokens[i]) < len(prompts[i]) + NEW_TOKENS])
    for i, p in enumerate(prompts):
        assert loop.generated(i, len(p)) == hf_greedy(checkpoints["llama"], p), f"sequence {i}"


@pytest.mark.parametrize("max_wide_kv_heads, group_bytes", [(0, decode_attention.GROUP_BYTES), (16, 1), (0, 1)])
def test_other_decode_paths_match_too(checkpoints, monkeypatch, max_wide_kv_heads, group_bytes):
    """Head-major (models with many KV heads) and one sequence per group, forced on the tiny model."""
    monkeypatch.setattr(decode_attention, "WIDE_QUERY_MAX_KV_HEADS", max_wide_kv_heads)
    monkeypatch.setattr(decode_attention, "GROUP_BYTES", group_bytes)
    prompts = [prompt(n, seed=30 + n) for n in PROMPT_LENS]
    loop = GreedyLoop(load_runner(checkpoints["qwen2"], kernels="torch"), prompts)  # the paths patched above
    for _ in range(NEW_TOKENS):
        loop.step(list(range(len(prompts))))
    for i, p in enumerate(prompts):
        assert loop.generated(i, len(p)) == hf_greedy(checkpoints["qwen2"], p), f"sequence {i}"
