"""When each request is sent: Poisson or gamma arrivals at a rate, or all at once.

Inter-arrival gaps follow gamma(shape=burstiness, scale=1/(rate*burstiness)), the
parameterisation of `vllm bench serve`: the mean gap is 1/rate for every burstiness;
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular.
"""
import math

import numpy as np

from pdserve.common.errors import ConfigError

ARRIVAL_STREAM = 1  # keeps arrival draws independent of dataset draws made with the same seed


def validate_arrivals(request_rate: float, burstiness: float) -> None:
    """Raise ConfigError unless rate > 0 (inf allowed) and 0 < burstiness < inf."""
    if math.isnan(request_rate) or request_rate <= 0:
        raise ConfigError("--request-rate", request_rate, "must be > 0 (inf sends all at once)")
    if not 0 < burstiness < math.inf:
        raise ConfigError("--burstiness", burstiness, "must be a positive, finite number")


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Send times in seconds after the start: non-decreasing, the first at 0.

    The same (num_requests, rate, burstiness, seed) always yields the same list.
    An infinite rate sends every request at 0.
    """
    validate_arrivals(request_rate, burstiness)
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()
