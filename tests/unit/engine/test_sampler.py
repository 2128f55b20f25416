"""Sampler: greedy, temperature / top-k / top-p, per-request seeds, logprobs, bad params."""
import math

import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import SamplingParams
from pdserve.engine.model.sampler import (CANDIDATES, Sampler, SamplingRow, _filter_sorted, _filter_top_k_top_p,
                                          logit_batch, make_generator)

VOCAB = 1000


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((num_rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3  # (B, V)


def tokens(results) -> list[int]:
    return [r.token_id for r in results]


def test_greedy_is_argmax():
    logits = random_logits(6)
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 6
    assert tokens(Sampler(seed=0).sample(logits, rows)) == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(4)
    rows = [SamplingRow(SamplingParams(temperature=t, top_k=1)) for t in (0.5, 1.0, 2.0, 10.0)]
    assert tokens(Sampler(seed=0).sample(logits, rows)) == logits.argmax(dim=-1).tolist()


def test_seeded_request_is_reproducible_across_runs_and_batch_positions():
    steps = [random_logits(4, seed=s) for s in range(8)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    alone, crowded = Sampler(seed=1), Sampler(seed=2)
    gen_alone, gen_crowded = make_generator(7), make_generator(7)
    got_alone, got_crowded = [], []
    for logits in steps:
        got_alone += tokens(alone.sample(logits[2:3], [SamplingRow(params, gen_alone)]))
        neighbours = [SamplingRow(SamplingParams(temperature=0.7)), SamplingRow(params, make_generator(99)),
                      SamplingRow(params, gen_crowded), SamplingRow(SamplingParams(temperature=0.0))]
        got_crowded.append(tokens(crowded.sample(logits, neighbours))[2])
    assert got_alone == got_crowded
    other = make_generator(8)
    got_other = [tokens(alone.sample(lg[2:3], [SamplingRow(params, other)]))[0] for lg in steps]
    assert got_other != got_alone  # a different seed gives a different stream


def test_skipping_a_step_leaves_the_stream_where_sampling_it_would():
    steps = [random_logits(1, seed=s) for s in range(6)]
    params = SamplingParams(temperature=1.0, seed=3)
    sampled, skipped = make_generator(3), make_generator(3)
    sampler = Sampler(seed=0)
    tokens(sampler.sample(steps[0], [SamplingRow(params, sampled)]))
    sampler.skip(SamplingRow(params, skipped), VOCAB)  # step 0 sampled elsewhere
    after_sampled = [tokens(sampler.sample(lg, [SamplingRow(params, sampled)]))[0] for lg in steps[1:]]
    after_skipped = [tokens(sampler.sample(lg, [SamplingRow(params, skipped)]))[0] for lg in steps[1:]]
    assert after_skipped == after_sampled
    unskipped = make_generator(3)
    assert [tokens(sampler.sample(lg, [SamplingRow(params, unskipped)]))[0] for lg in steps[1:]] != after_sampled


def test_greedy_and_unseeded_rows_skip_nothing():
    greedy = make_generator(3)
    Sampler(seed=0).skip(SamplingRow(SamplingParams(temperature=0.0, seed=3), greedy), VOCAB)
    assert torch.rand(4, generator=greedy).tolist() == torch.rand(4, generator=make_generator(3)).tolist()
    shared = Sampler(seed=0)
    shared.skip(SamplingRow(SamplingParams(temperature=1.0)), VOCAB)
    assert tokens(shared.sample(random_logits(2), [SamplingRow(SamplingParams(temperature=1.0))] * 2)) == \
        tokens(Sampler(seed=0).sample(random_logits(2), [SamplingRow(SamplingParams(temperature=1.0))] * 2))


def test_generators_differ_per_completion_index():
    draws = [torch.rand(4, generator=make_generator(5, index)).tolist() for index in (0, 1)]
    assert draws[0] != draws[1]
    assert torch.rand(4, generator=make_generator(5, 1)).tolist() == draws[1]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3)  # (4000, 3)
    rows = [SamplingRow(SamplingParams(temperature=1.0))] * 4000
    counts = torch.bincount(torch.tensor(tokens(Sampler(seed=0).sample(logits, rows))), minlength=3)
    assert (counts / 4000 - probs).abs().max().item() < 0.03


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(4000, 3)
    rows = [SamplingRow(SamplingParams(temperature=0.25))] * 4000
    counts = torch.bincount(torch.tensor(tokens(Sampler(seed=0).sample(logits, rows))), minlength=3)
    expected = torch.softmax(torch.tensor([8.0, 4.0, 0.0]), dim=0)
    assert (counts / 4000 - expected).abs().max().item() < 0.03


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(4, 4)  # (4, 4), sorted best first
    filtered = _filter_top_k_top_p(logits, top_k=[0, 2, 0, 3], top_p=[0.7, 1.0, 0.5, 0.9])
    kept = torch.isfinite(filtered)  # (4, 4)
    assert kept.tolist() == [
        [True, True, False, False],  # top_p 0.7: 0.5 + 0.3 reaches it
        [True, True, False, False],  # top_k 2
        [True, False, False, False],  # top_p 0.5: the best token alone reaches it
        [True, True, True, False],  # top_k 3, then top_p 0.9 of the renormalised 0.95 mass
    ]
    assert torch.equal(filtered[kept], logits[kept])


def test_sampled_tokens_stay_inside_top_k():
    logits = random_logits(1).expand(500, VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=5.0, top_k=3))] * 500
    allowed = set(logits[0].topk(3).indices.tolist())
    chosen = set(tokens(Sampler(seed=0).sample(logits, rows)))
    assert chosen == allowed


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(3)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=5)),
            SamplingRow(SamplingParams(temperature=2.0)),
            SamplingRow(SamplingParams(temperature=0.8, logprobs=0), make_generator(3))]
    results = Sampler(seed=0).sample(logits, rows)
    reference = logits.log_softmax(dim=-1)
    first, second, third = results
    assert second.logprob is None
    assert first.logprob.token_id == first.token_id
    assert first.logprob.logprob == reference[0, first.token_id].item()
    top_lp, top_ids = reference[0].topk(5)
    assert first.logprob.top == tuple(zip(top_ids.tolist(), top_lp.tolist()))
    assert third.logprob.logprob == reference[2, third.token_id].item()
    assert third.logprob.top == ()


@pytest.mark.parametrize(("params", "param"), [
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(temperature=math.nan), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(logprobs=-2), "logprobs"),
    (SamplingParams(logprobs=21), "logprobs"),  # each output would grow by up to the vocabulary
])
def test_nonsense_params_raise_before_any_draw(params, param):
    generator = make_generator(1)
    state = generator.get_state()
    rows = [SamplingRow(SamplingParams(temperature=1.0), generator), SamplingRow(params)]
    with pytest.raises(InvalidRequestError) as err:
        Sampler(seed=0).sample(random_logits(2), rows)
    assert err.value.param == param
    assert torch.equal(generator.get_state(), state)


def test_row_count_must_match_logits():
    with pytest.raises(ValueError):
        Sampler(seed=0).sample(random_logits(2), [SamplingRow(SamplingParams())])


@pytest.mark.parametrize("case", range(40))
def test_the_candidate_filter_keeps_exactly_what_a_full_sort_keeps(case: int) -> None:
    """Top-k / top-p among each row's best tokens equals the full sort, ties, -inf rows and
    nuclei that reach past the candidates (the fallback) included."""
    gen = torch.Generator().manual_seed(case)
    vocab = 6 * CANDIDATES
    scale = [0.5, 3.0, 8.0][case % 3]  # flat rows put the nucleus past the candidates
    logits = torch.randn((6, vocab), generator=gen) * scale
    if case % 4 == 1:
        logits = (logits * 2).round() / 2  # many equal logits
    if case % 5 == 2:
        logits[0, torch.randperm(vocab, generator=gen)[: vocab - 10]] = float("-inf")  # a guided row
    top_k = [0, 50, 0, CANDIDATES + 7, 1, 0]
    top_p = [0.9, 0.8, 0.99, 1.0, 0.5, 5e-324]
    fast, full = _filter_top_k_top_p(logits, top_k, top_p), _filter_sorted(logits, top_k, top_p)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(full))
    assert torch.equal(fast[torch.isfinite(fast)], full[torch.isfinite(full)])


def test_logit_rows_of_a_step_are_batched_as_a_view_when_consecutive_else_copied():
    logits = torch.randn(5, 11)
    rows = [chunk[-1] for chunk in torch.split(logits, [1, 1, 1, 1, 1])]
    batch = logit_batch(rows)
    assert torch.equal(batch, logits) and batch.data_ptr() == logits.data_ptr()  # every decode row: no copy
    prompt_rows = [chunk[-1] for chunk in torch.split(logits, [2, 3])]  # last rows of two 2- and 3-row chunks
    siblings = [rows[0], rows[0], rows[2]]  # a forked request samples its prompt's row twice
    for picked in (prompt_rows, siblings, [rows[1], rows[0]]):
        copied = logit_batch(picked)
        assert torch.equal(copied, torch.stack(picked)) and copied.data_ptr() != logits.data_ptr()


def test_argmax_rows_is_torchs_argmax_ties_nans_infinities_and_views_included():
    from pdserve.engine.model.sampler import argmax_rows
    scores = torch.tensor([[1.0, float("nan"), 3.0], [float("-inf")] * 3, [2.0, 5.0, 5.0],
                           [float("nan"), 1.0, float("nan")], [0.0, 0.0, 0.0]])
    assert argmax_rows(scores).tolist() == scores.argmax(dim=-1).tolist() == [1, 0, 1, 0, 0]
    wide = torch.randn(7, 4099)
    for view in (wide, wide[torch.tensor([0, 3, 6])], wide[:, 5:], wide.t().contiguous().t()):
        assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(wide).dtype == torch.int64
