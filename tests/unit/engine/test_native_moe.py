"""The mixtures of experts on the native kernels of every ISA level this CPU runs (native/moe.h),
beyond test_model_parity.py's float32 teacher forcing: bf16 weights, a step of many sequences at
once, the experts' plain copies let go once packed, and what the kernels refuse."""
import copy
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.native_forward import native_unsupported_reason

from model_builders import blocks_for, chunk, load_runner, prompt, run
from native_levels import LEVELS_HERE

KINDS = ["mixtral", "qwen3_moe"]


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_mixtures_stay_close_to_transformers(checkpoints, tmp_path, level, kind):
    """bf16 routers and experts (panels at AVX2, oneDNN's packing at AVX-512) as close to
    transformers' float32 logits as the dense families' bf16 runs; the greedy token the same
    wherever float32's top two differ by more than that tolerance (the tiny Mixtral has near-ties,
    where bf16 may pick either)."""
    copy.deepcopy(checkpoints[kind].hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    runner = load_runner(SimpleNamespace(path=tmp_path), dtype="bfloat16", kernels=level)
    assert runner.native is not None
    ids = prompt(23, seed=7)
    [logits] = run(runner, chunk("r", ids, 0, [3, 2, 1, 0, 4, 5], all_logits=True))
    reference = checkpoints[kind].hf_logits(ids)
    torch.testing.assert_close(logits, reference, atol=0.1, rtol=0.05)
    top2 = reference.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert clear.sum() >= 15
    assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])


@pytest.fixture(params=[1, 2, 8])
def threads(request):
    """2: at least as many chosen experts as threads, so each thread takes whole experts (moe.h),
    on worker threads of their own (1 runs that branch inline, on the caller's thread); 8, more
    than the tiny models' 4 experts: they run one after another, each on every thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("kind", KINDS)
def test_a_step_of_many_sequences_equals_each_alone(checkpoints, level, kind, threads):
    """Six sequences' prompts in one step (every expert sees rows of several sequences), then a
    decode step of all six: each sequence's logits are its own forward's on the torch path."""
    native, reference = load_runner(checkpoints[kind], kernels=level), load_runner(checkpoints[kind], kernels="torch")
    prompts = [prompt(5 + 3 * i, seed=20 + i) for i in range(6)]
    tables = [blocks_for(8 * i, 24) for i in range(6)]
    prefilled = run(native, *(chunk(f"s{i}", p, 0, tables[i], all_logits=True) for i, p in enumerate(prompts)))
    decoded = run(native, *(chunk(f"s{i}", [7 + i], len(p), tables[i]) for i, p in enumerate(prompts)))
    for i, p in enumerate(prompts):
        [expected] = run(reference, chunk("r", p + [7 + i], 0, tables[i], all_logits=True))
        torch.testing.assert_close(torch.cat([prefilled[i], decoded[i]]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_packed_experts_let_go_of_their_plain_copies(checkpoints, tmp_path, level):
    copy.deepcopy(checkpoints["mixtral"].hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    runner = load_runner(SimpleNamespace(path=tmp_path), dtype="bfloat16", kernels=level)
    experts = [e for layer in runner.model.layers for e in layer.mlp.experts]
    assert len(experts) == 8 and all(e.gate_up is None and e.down is None for e in experts)


def test_experts_of_a_width_the_kernels_do_not_run_are_refused(checkpoints):
    config = ModelConfig.from_hf_config(json.loads((checkpoints["qwen3_moe"].path / "config.json").read_text()))
    narrow = dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_intermediate_size=40))
    reason = native_unsupported_reason(SimpleNamespace(config=narrow, embed=torch.zeros(1)),
                                       SimpleNamespace(tensor=torch.zeros(1)))
    assert reason == "a mixture's expert intermediate size must be a multiple of 16"
