import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.common.errors import ConfigError


def test_same_seed_same_schedule_and_other_seed_differs():
    first = arrival_offsets(50, request_rate=4.0, burstiness=1.0, seed=7)
    assert first == arrival_offsets(50, request_rate=4.0, burstiness=1.0, seed=7)
    assert first != arrival_offsets(50, request_rate=4.0, burstiness=1.0, seed=8)


def test_schedule_starts_at_zero_and_never_goes_back():
    offsets = arrival_offsets(100, request_rate=10.0, burstiness=0.5, seed=0)
    assert len(offsets) == 100
    assert offsets[0] == 0.0
    assert all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate_for_every_burstiness(burstiness):
    offsets = arrival_offsets(20001, request_rate=5.0, burstiness=burstiness, seed=3)
    assert abs(np.mean(np.diff(offsets)) - 0.2) < 0.2 * 0.03


def test_burstiness_changes_spread_of_gaps():
    def cv(burstiness):  # coefficient of variation of the gaps = 1/sqrt(shape)
        gaps = np.diff(arrival_offsets(20001, 5.0, burstiness, seed=3))
        return np.std(gaps) / np.mean(gaps)
    assert abs(cv(1.0) - 1.0) < 0.03
    assert abs(cv(4.0) - 0.5) < 0.03


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(0, 2.0, 1.0, seed=0) == []


@pytest.mark.parametrize("rate, burstiness, field", [
    (0.0, 1.0, "--request-rate"), (-1.0, 1.0, "--request-rate"), (math.nan, 1.0, "--request-rate"),
    (1.0, 0.0, "--burstiness"), (1.0, math.inf, "--burstiness"),
])
def test_bad_rate_or_burstiness_names_the_flag(rate, burstiness, field):
    with pytest.raises(ConfigError) as info:
        arrival_offsets(5, rate, burstiness, seed=0)
    assert info.value.field == field
