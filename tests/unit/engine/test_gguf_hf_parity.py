"""The real SmolLM2 GGUF in pdserve against Hugging Face transformers' own GGUF loading.

transformers dequantizes and un-permutes the same file independently; every tensor must
match bit for bit in float32, and greedy generation (ModelRunner + Sampler, float32) must
give transformers' tokens. Loading the model there takes ~15 s, so it happens once.
"""
import os

import pytest
import torch
import transformers

from pdserve.engine.core.detokenizer import IncrementalDetokenizer
from pdserve.common.ids import RequestId
from pdserve.common.model_source import default_model_path
from pdserve.common.request import SamplingParams
from pdserve.models.tokenizer import load_tokenizer
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.loading.gguf_loader import load_gguf
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.model.sampler import Sampler, SamplingRow

pytestmark = pytest.mark.slow  # loads the 135M model twice (~60 s on two CPU cores)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path, dtype=torch.float32)


def test_every_tensor_equals_transformers_state_dict(ours, hf_model):
    _, tensors = ours
    state = hf_model.state_dict()
    assert hf_model.config.tie_word_embeddings is True
    assert sorted(tensors) == sorted(set(state) - {"lm_head.weight"})  # tied: no separate lm_head
    mismatched = [name for name, tensor in tensors.items() if not torch.equal(tensor, state[name])]
    assert mismatched == []
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_config_matches_transformers_config(ours, hf_model):
    config, _ = ours
    hf = hf_model.config
    assert config["hidden_size"] == hf.hidden_size == 576
    assert config["num_hidden_layers"] == hf.num_hidden_layers == 30
    assert config["num_attention_heads"] == hf.num_attention_heads == 9
    assert config["num_key_value_heads"] == hf.num_key_value_heads == 3
    assert config["intermediate_size"] == hf.intermediate_size == 1536
    assert config["head_dim"] == hf.head_dim == 64
    assert config["vocab_size"] == hf.vocab_size == 49152
    assert config["max_position_embeddings"] == hf.max_position_embeddings == 8192
    # The file's float32; transformers gives it as is (9.9999997e-06), pdserve as the decimal the
    # converter was given (gguf_config), the config.json's own 1e-05.
    assert config["rms_norm_eps"] == 1e-05
    assert torch.tensor(config["rms_norm_eps"]).item() == hf.rms_norm_eps  # the same float32
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, 3 little pigs"]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_NEW_TOKENS = 16
TOKENS_PER_BLOCK = 16
BLOCKS_PER_SEQ = 8  # 128 positions: every prompt plus MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_tokenizer(gguf_path)


def pdserve_greedy(runner, prompts: list[list[int]], eos_ids: tuple[int, ...]) -> list[list[int]]:
    """Greedy decoding of all prompts as one batch: one prefill step, then one token per step."""
    sampler, greedy = Sampler(seed=0), SamplingRow(SamplingParams(temperature=0.0))
    tables = [tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = [(i, tuple(p), 0) for i, p in enumerate(prompts)]  # (seq, new tokens, start_pos)
    while pending:
        batch = ForwardBatch(tuple(SeqChunk(RequestId(str(i)), toks, start, tables[i]) for i, toks, start in pending))
        logits = torch.cat(runner.forward(batch).logits)  # (len(pending), vocab)
        sampled = sampler.sample(logits, [greedy] * len(pending))
        following = []
        for (i, toks, start), token in zip(pending, sampled):
            outputs[i].append(token.token_id)
            if token.token_id not in eos_ids and len(outputs[i]) < MAX_NEW_TOKENS:
                following.append((i, (token.token_id,), start + len(toks)))
        pending = following
    return outputs


def test_greedy_generation_equals_transformers(gguf_path, hf_model, tokenizer):
    runner = ModelRunner.load(gguf_path, dtype="float32", num_blocks=BLOCKS_PER_SEQ * 4,
                              tokens_per_block=TOKENS_PER_BLOCK)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    prompts.append(tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False))
    ours = pdserve_greedy(runner, prompts, tokenizer.eos_token_ids)
    for prompt, generated in zip(prompts, ours):
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                      eos_token_id=list(tokenizer.eos_token_ids), pad_token_id=2)
        assert generated == reference[0, len(prompt):].tolist()
        detok = IncrementalDetokenizer(tokenizer, prompt)
        text = "".join(detok.add([t]) for t in generated) + detok.flush()
        assert text == tokenizer.decode(generated)
    assert any(len(g) == MAX_NEW_TOKENS for g in ours)  # at least one ran the full length
