"""The two-sample Kolmogorov–Smirnov test, for timing audits (no SciPy needed).

`ks_2samp(a, b)` returns the statistic D (the largest gap between the two empirical
distribution functions) and its asymptotic p-value with Stephens' small-sample correction
(Numerical Recipes' `kstwo`); a small p-value says the samples come from different
distributions, e.g. TTFTs of prefix-cache hits against misses.
"""
import math
from bisect import bisect_right
from collections.abc import Sequence


def ks_2samp(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    if not a or not b:
        raise ValueError("both samples need at least one value")
    xs, ys = sorted(a), sorted(b)
    statistic = max(abs(bisect_right(xs, v) / len(xs) - bisect_right(ys, v) / len(ys)) for v in (*xs, *ys))
    effective = math.sqrt(len(xs) * len(ys) / (len(xs) + len(ys)))
    return statistic, kolmogorov_sf((effective + 0.12 + 0.11 / effective) * statistic)


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution."""
    if x < 0.2:
        return 1.0
    total = sum(2 * (-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))
    return min(max(total, 0.0), 1.0)
