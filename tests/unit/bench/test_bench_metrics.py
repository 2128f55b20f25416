"""Aggregates on synthetic records whose every figure is known by hand."""
import pytest

from pdserve.bench.metrics import RequestRecord, compute_metrics, is_good
from pdserve.bench.slo import Slo


def record(start, chunks, output_len, prompt_len=10, error=None, finish=None):
    return RequestRecord(index=0, start_time=start, queue_time=0.0, prompt_len=prompt_len,
                         output_len=output_len, chunk_times=tuple(chunks),
                         finish_time=chunks[-1] if finish is None else finish, error=error)


# ttft 0.1 s, e2el 0.5 s, 5 tokens -> tpot 0.1 s; gaps 0.1 x4
FAST = record(0.0, [0.1, 0.2, 0.3, 0.4, 0.5], output_len=5)
# ttft 0.4 s, e2el 1.0 s, 4 tokens -> tpot 0.2 s; gaps 0.2, 0.2, 0.2
SLOW = record(0.5, [0.4, 0.6, 0.8, 1.0], output_len=4, prompt_len=20)
# one-token output: no tpot, counts as tpot 0 for goodput
SINGLE = record(1.0, [0.05], output_len=1, prompt_len=30)
FAILED = record(1.2, [0.3], output_len=0, prompt_len=99, error="HTTP 429: refused", finish=0.3)


def test_counts_totals_and_throughput_exclude_failures():
    metrics = compute_metrics([FAST, SLOW, SINGLE, FAILED], duration_s=2.0, slo=None, percentiles=(50.0,))
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (60, 10)
    assert metrics.request_throughput == 1.5
    assert metrics.output_throughput == 5.0
    assert metrics.total_token_throughput == 35.0
    assert metrics.request_goodput is None and metrics.slo_attainment is None


def test_latency_distributions_in_milliseconds():
    metrics = compute_metrics([FAST, SLOW, SINGLE, FAILED], 2.0, None, percentiles=(50.0, 100.0))
    ttft, tpot, itl, e2el = (metrics.latencies[k] for k in ("ttft", "tpot", "itl", "e2el"))
    assert ttft.mean == pytest.approx(550 / 3)
    assert ttft.median == pytest.approx(100.0)
    assert ttft.percentiles == ((50.0, pytest.approx(100.0)), (100.0, pytest.approx(400.0)))
    assert (tpot.mean, tpot.median) == (pytest.approx(150.0), pytest.approx(150.0))
    assert tpot.std == pytest.approx(50.0)
    assert itl.mean == pytest.approx(1000 * (0.4 + 0.6) / 7)
    assert e2el.mean == pytest.approx(1000 * (0.5 + 1.0 + 0.05) / 3)


def test_goodput_counts_requests_meeting_every_bound():
    records = [FAST, SLOW, SINGLE, FAILED]
    slo = Slo(ttft_ms=200.0, tpot_ms=150.0)  # FAST and SINGLE meet it; SLOW misses ttft
    assert [is_good(r, slo) for r in records] == [True, False, True, False]
    metrics = compute_metrics(records, duration_s=4.0, slo=slo, percentiles=(99.0,))
    assert metrics.request_goodput == 0.5
    assert metrics.slo_attainment == 0.5


def test_goodput_with_e2el_and_tpot_bounds():
    records = [FAST, SLOW, SINGLE]
    assert [is_good(r, Slo(e2el_ms=500.0)) for r in records] == [True, False, True]
    assert [is_good(r, Slo(tpot_ms=99.0)) for r in records] == [False, False, True]
    metrics = compute_metrics(records, duration_s=1.0, slo=Slo(tpot_ms=200.0), percentiles=(99.0,))
    assert metrics.request_goodput == 3.0
    assert metrics.slo_attainment == 1.0


def test_peak_concurrency_and_peak_token_rate():
    metrics = compute_metrics([FAST, SLOW, SINGLE, FAILED], 2.0, None, (99.0,))
    # FAST [0, .5], SLOW [.5, 1.5], SINGLE [1, 1.05], FAILED [1.2, 1.5]: FAST's end at .5
    # counts before SLOW's start, and SINGLE ends before FAILED starts
    assert metrics.max_concurrent_requests == 2
    # second [0,1): FAST's 5 tokens + SLOW's first (0.9); second [1,2): SLOW's 3 + SINGLE's 1
    assert metrics.max_output_tokens_per_s == 5.0 + 1.0


def test_no_successful_request_gives_empty_distributions():
    metrics = compute_metrics([FAILED], duration_s=1.0, slo=Slo(ttft_ms=1.0), percentiles=(90.0,))
    assert (metrics.completed, metrics.failed, metrics.request_goodput) == (0, 1, 0.0)
    assert metrics.latencies["ttft"].mean is None
    assert metrics.latencies["itl"].percentiles == ((90.0, None),)
