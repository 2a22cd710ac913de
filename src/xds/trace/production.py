"""The synthetic workload of SPEC 12.4's production deployment (P126-P127).

Inputs 0-64K tokens with mean 13K, outputs with mean 2.1K. The paper gives only these ranges
and means; the shapes are [emulator choice]: log-normal (sigma 1) clipped to the range, the
location chosen so the clipped mean lands on the published one. Arrivals are Poisson.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .workload import Workload, poisson_arrivals, with_arrivals

INPUT_MEAN = 13_000
INPUT_MAX = 65_536
OUTPUT_MEAN = 2_100
OUTPUT_MAX = 32_768


def _clipped_lognormal(
    rng: np.random.Generator, n: int, mean: float, cap: int, sigma: float = 1.0
) -> np.ndarray:
    """Log-normal lengths in [1, cap] whose clipped mean is ``mean`` (location by bisection on
    a fixed reference sample, so the result does not depend on ``n``)."""
    ref = np.random.default_rng(12_4).standard_normal(200_000)
    lo, hi = np.log(1.0), np.log(float(cap))
    for _ in range(60):
        mu = (lo + hi) / 2
        m = np.clip(np.exp(mu + sigma * ref), 1, cap).mean()
        lo, hi = (mu, hi) if m < mean else (lo, mu)
    mu = (lo + hi) / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)


def production_workload(n: int, *, rate_per_s: float, seed: int = 0) -> Workload:
    """``n`` requests of the SPEC 12.4 mix arriving as a Poisson process at ``rate_per_s``."""
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}", field="n")
    if rate_per_s <= 0:
        raise ConfigError(f"rate must be positive, got {rate_per_s}", field="rate_per_s")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 124]))
    arrivals = poisson_arrivals(rng, n, rate_per_s)
    arrivals -= arrivals[0]
    inputs = _clipped_lognormal(rng, n, INPUT_MEAN, INPUT_MAX)
    outputs = _clipped_lognormal(rng, n, OUTPUT_MEAN, OUTPUT_MAX)
    return with_arrivals(
        list(zip(inputs.tolist(), outputs.tolist(), strict=True)),
        arrivals,
        f"production(n={n}, rate={rate_per_s:g}/s)",
    )
