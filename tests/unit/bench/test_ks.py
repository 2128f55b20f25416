"""The two-sample Kolmogorov–Smirnov test against values worked out by hand."""
import math
import random

import pytest

from pdserve.bench.ks import kolmogorov_sf, ks_2samp


def test_identical_samples_differ_by_nothing() -> None:
    assert ks_2samp([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == (0.0, 1.0)


def test_separated_samples_have_statistic_one_and_a_tiny_p_value() -> None:
    statistic, p = ks_2samp([float(i) for i in range(10)], [float(i) for i in range(100, 110)])
    assert statistic == 1.0
    # the exact two-sided p-value is 2 / C(20, 10) = 1.08e-5; the asymptotic one is close
    assert 5e-6 < p < 5e-5


def test_a_half_shifted_sample_has_statistic_one_half() -> None:
    statistic, _ = ks_2samp([1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0])
    assert statistic == 0.5


def test_kolmogorov_tail_at_known_points() -> None:
    assert kolmogorov_sf(0.1) == 1.0
    assert kolmogorov_sf(1.36) == pytest.approx(0.049, abs=0.001)  # the 5 % critical value
    assert kolmogorov_sf(1.63) == pytest.approx(0.0098, abs=0.0005)  # the 1 % critical value


def test_two_samples_of_one_distribution_are_rarely_told_apart() -> None:
    rng = random.Random(0)
    p_values = [ks_2samp([rng.gauss(0, 1) for _ in range(40)], [rng.gauss(0, 1) for _ in range(40)])[1]
                for _ in range(200)]
    assert sum(p < 0.05 for p in p_values) <= 20  # about 5 % by chance (the test is conservative)
    shifted = [ks_2samp([rng.gauss(0, 1) for _ in range(40)], [rng.gauss(1, 1) for _ in range(40)])[1]
               for _ in range(50)]
    assert sum(p < 0.05 for p in shifted) >= 40 and not math.isnan(shifted[0])


def test_an_empty_sample_is_refused() -> None:
    with pytest.raises(ValueError):
        ks_2samp([], [1.0])
