"""Logits processors (penalties, logit_bias, min_tokens, bad_words) against a plain reference.

The reference walks every row and token in Python with float32 scalars, in vLLM's order and
formulas; the batched tensor code must give the very same float32 values.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import SamplingParams
from pdserve.engine.model.logits_processors import TokenHistory, apply_logits_processors, check_processor_params
from pdserve.engine.model.sampler import Sampler, SamplingRow, make_generator

VOCAB = 40
EOS = (0, 1)
NEG_INF = np.float32(-math.inf)


def reference_row(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
                  eos: tuple[int, ...]) -> list[np.float32]:
    """One row as vLLM's sampler processes it, written out token by token."""
    row = [np.float32(x) for x in logits]
    for word in params.bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            row[word[-1]] = NEG_INF
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | set(eos):
            row[token] = NEG_INF
    for token, bias in params.logit_bias:
        row[token] = row[token] + np.float32(bias)
    repetition = np.float32(params.repetition_penalty)
    for token in range(len(row)):
        count = output.count(token)
        if token in prompt or count:
            row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
        row[token] = row[token] - np.float32(params.frequency_penalty) * np.float32(count)
        row[token] = row[token] - np.float32(params.presence_penalty) * np.float32(count > 0)
    return row


tokens = st.integers(0, VOCAB - 1)
penalty = st.just(0.0) | st.floats(-2.0, 2.0)
params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    presence_penalty=penalty,
    frequency_penalty=penalty,
    repetition_penalty=st.just(1.0) | st.floats(0.05, 5.0),
    logit_bias=st.dictionaries(tokens, st.floats(-100.0, 100.0), max_size=5).map(
        lambda d: tuple(sorted(d.items()))),
    min_tokens=st.integers(0, 6),
    stop_token_ids=st.lists(tokens, max_size=3).map(tuple),
    bad_words=st.lists(st.lists(tokens, min_size=1, max_size=3).map(tuple), max_size=4).map(tuple),
)
row_strategy = st.tuples(params_strategy, st.lists(tokens, min_size=1, max_size=12),
                         st.lists(st.integers(0, 7), max_size=12))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_batched_processors_equal_the_reference_exactly(rows, seed) -> None:
    """Outputs drawn from a few tokens, so repeats, bad-word prefixes and counts > 1 are common."""
    logits = torch.randn((len(rows), VOCAB), generator=torch.Generator().manual_seed(seed)) * 4  # (B, V)
    batch = [(params, TokenHistory(prompt + output, len(prompt))) for params, prompt, output in rows]
    got = apply_logits_processors(logits, batch, EOS)
    want = torch.tensor(np.array([reference_row(logits[i].tolist(), params, prompt, output, EOS)
                                  for i, (params, prompt, output) in enumerate(rows)], dtype=np.float32))
    assert torch.equal(got, want)


def test_rows_without_processors_are_not_copied_or_changed() -> None:
    logits = torch.randn((3, VOCAB))
    history = TokenHistory([3, 4, 3], 1)
    assert apply_logits_processors(logits, [(SamplingParams(), history)] * 3, EOS) is logits
    before = logits.clone()
    got = apply_logits_processors(logits, [(SamplingParams(), history), (SamplingParams(presence_penalty=1.0),
                                                                         history)], EOS)
    assert torch.equal(got[0], before[0]) and torch.equal(logits, before)
    assert not torch.equal(got[1], before[1])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -3.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0)
    got = apply_logits_processors(logits, [(params, TokenHistory([0, 1, 2, 3], 2))], ())
    assert got.tolist() == [[1.0, -4.0, 1.5, -6.0, 1.0]]


def test_a_tiny_repetition_penalty_keeps_logits_finite_and_draws_only_the_largest() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0, 1.0]])
    params = SamplingParams(repetition_penalty=5e-324, temperature=1.0, seed=4)  # 0.0 in float32
    got = apply_logits_processors(logits.clone(), [(params, TokenHistory([0, 1, 2, 3], 2))], ())
    largest = torch.finfo(torch.float32).max
    assert got.tolist() == [[largest, -0.0, 0.0, largest, 1.0]]
    rows = [SamplingRow(params, make_generator(4), history=TokenHistory([0, 1, 2, 3], 2))]
    drawn = {Sampler(seed=1).sample(logits.clone(), rows)[0].token_id for _ in range(20)}
    assert drawn == {0, 3}  # the two largest, each half the time; NaN probabilities would draw anything


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros((1, 4))
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_logits_processors(logits, [(params, TokenHistory([3, 3, 1, 1, 1, 2], 2))], ())
    assert got.tolist() == [[0.0, -1.75, -0.75, 0.0]]  # token 3 only in the prompt


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros((3, 6))
    params = SamplingParams(min_tokens=2, stop_token_ids=(4,))
    histories = [TokenHistory([5], 1), TokenHistory([5, 3], 1), TokenHistory([5, 3, 3], 1)]
    got = apply_logits_processors(logits, [(params, h) for h in histories], (0,))
    inf = -math.inf
    assert got.tolist() == [[inf, 0, 0, 0, inf, 0], [inf, 0, 0, 0, inf, 0], [0] * 6]


def test_bad_words_ban_a_last_token_only_after_its_prefix_was_generated() -> None:
    logits = torch.zeros((3, 6))
    params = SamplingParams(bad_words=((2,), (3, 4), (1, 3, 5)))
    histories = [TokenHistory([3, 1, 3], 3),  # prompt only: a prompt never starts a bad word
                 TokenHistory([0, 3], 1),
                 TokenHistory([0, 1, 3], 1)]
    got = apply_logits_processors(logits, [(params, h) for h in histories], ())
    inf = -math.inf
    assert got.tolist() == [[0, 0, inf, 0, 0, 0], [0, 0, inf, 0, inf, 0], [0, 0, inf, 0, inf, inf]]


def test_greedy_follows_the_processed_logits_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, logit_bias=((2, 10.0),), logprobs=1)
    (token,) = Sampler(seed=0).sample(logits, [SamplingRow(params)])
    raw = logits.log_softmax(dim=-1)[0]
    assert token.token_id == 2
    assert token.logprob.logprob == pytest.approx(raw[2].item())
    assert token.logprob.top[0] == (0, pytest.approx(raw[0].item()))


def test_min_tokens_uses_the_samplers_eos_ids() -> None:
    logits = torch.tensor([[9.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert Sampler(seed=0, eos_token_ids=(0,)).sample(logits, [SamplingRow(params)])[0].token_id == 1
    assert Sampler(seed=0).sample(logits, [SamplingRow(params)])[0].token_id == 0


def test_a_seeded_penalised_row_draws_the_same_alone_and_in_a_crowd() -> None:
    params = SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.5, logit_bias=((3, 2.0),))
    other = SamplingParams(temperature=0.8, presence_penalty=2.0, bad_words=((7,),))
    alone, crowded = Sampler(seed=1), Sampler(seed=2)
    gen_alone, gen_crowded = make_generator(5), make_generator(5)
    out_alone: list[int] = []
    out_crowded: list[int] = []
    for step in range(12):
        logits = torch.randn((3, VOCAB), generator=torch.Generator().manual_seed(step))  # (3, V)
        history = TokenHistory([1, 2] + out_alone, 2)
        out_alone += [alone.sample(logits[1:2], [SamplingRow(params, gen_alone, history=history)])[0].token_id]
        rows = [SamplingRow(other, None, history=TokenHistory([4, 7, 7], 1)),
                SamplingRow(params, gen_crowded, history=TokenHistory([1, 2] + out_crowded, 2)),
                SamplingRow(SamplingParams(temperature=0.0))]
        out_crowded += [crowded.sample(logits, rows)[1].token_id]
    assert out_alone == out_crowded


@pytest.mark.parametrize(("params", "param"), [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=math.nan), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(max_tokens=3, min_tokens=4), "min_tokens"),
    (SamplingParams(logit_bias=((VOCAB, 1.0),)), "logit_bias"),
    (SamplingParams(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
    (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
    (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(1025))), "logit_bias"),  # vLLM's bound
    (SamplingParams(bad_words=((),)), "bad_words"),
    (SamplingParams(bad_words=((1, -1),)), "bad_words"),
])
def test_bad_processor_params_are_invalid_requests(params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_processor_params(params, VOCAB)
    assert caught.value.param == param
    with pytest.raises(InvalidRequestError):
        Sampler(seed=0).sample(torch.zeros((1, VOCAB)), [SamplingRow(params)])
