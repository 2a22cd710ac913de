"""Production 4P1D (SPEC 12.4, P126-P127): mean TPOT and TTFT at the highest sustainable rate.

Deployment: ``production-4p1d`` (16 servers; 4 Prefill TEs of DP8/EP32 with TP4 attention;
1 Decode TE of DP128/EP128). Workload: the synthetic SPEC 12.4 mix (:mod:`xds.trace.production`:
inputs 1-64K, mean 13K; outputs mean 2.1K; Poisson arrivals), with the multi-turn prefix
structure measured on Mooncake's production chat trace (follow-up turns repeat an earlier
prompt); whether they hit is up to the prefill TEs' finite HBM prefix caches.
The paper does not publish the arrival rate, so xds searches for it: the highest rate at which
the deployment meets the production SLA on average, mean TPOT <= 35 ms **and** mean TTFT
<= 2 s (without the TTFT bound a finite trace "meets" any rate: requests just queue in
prefill). Each rate replays ``window_s`` seconds of arrivals; means are taken over the
requests that arrive in the middle half of the window (steady state). The window is several
times a request's mean decode lifetime (2.1K tokens at 20-35 ms: 40-75 s; the log-normal
tail decodes for minutes), so the decode TE has filled up before the measured arrivals and is
still fed while they decode. The prefix caches start cold: a follow-up whose earlier turn came
before the replay's first request cannot hit (at 8 req/s about a fifth of the measured
follow-ups), so the hit column is a lower bound.
The search (:func:`xds.serve.capacity.search_capacity`) doubles the rate until it fails, then
bisects.
"""

from __future__ import annotations

import msgspec

from ..serve.capacity import CapacityResult, search_capacity
from ..serve.presets import pd_config
from ..serve.replay import PDConfig
from ..serve.speculative import default_jobs
from ..trace.metrics import SLA
from ..trace.production import production_workload
from ..trace.workload import Workload
from . import Row, TableData

TPOT_SLA_MS = 35.0
TTFT_SLA_MS = 2000.0
MAX_RATE = 256.0
"""Requests/s where the search stops doubling."""


def measure(
    *,
    window_s: float = 600.0,
    bisections: int = 4,
    seed: int = 0,
    config: PDConfig | None = None,
    jobs: int | None = None,
) -> CapacityResult:
    """The rate search on ``config`` (default ``production-4p1d``) with the SLA above."""
    cfg = config or pd_config("production-4p1d")
    cfg = msgspec.structs.replace(cfg, sla=SLA(ttft_ms=TTFT_SLA_MS, tpot_ms=TPOT_SLA_MS))

    def workload(rate: float) -> Workload:
        return production_workload(max(20, round(rate * window_s)), rate_per_s=rate, seed=seed)

    return search_capacity(
        workload,
        cfg,
        start=1.0,
        max_scale=MAX_RATE,
        min_scale=1.0,  # below 1 req/s the question is moot: report that 1 req/s missed
        bisections=bisections,
        seed=seed,
        jobs=default_jobs() if jobs is None else jobs,  # the result does not depend on it
    )


def reproduce(*, quick: bool = False) -> tuple[list[Row], list[TableData]]:
    res = measure(window_s=240.0 if quick else 600.0, bisections=2 if quick else 4)
    found = res.found or res.points[0]  # even 1 request/s (the only point) missed
    rows = [
        Row("mean_tpot_ms", 34.8, round(found.tpot_ms, 2), "ms", "approx", 0.05),
        Row("mean_ttft_ms", 900.0, round(found.ttft_ms, 1), "ms", "approx", 0.30),
    ]
    binding = "nothing below the search cap" if res.capped else res.binding
    table = TableData(
        "rate search (SLA: mean TPOT <= 35 ms and mean TTFT <= 2 s)",
        [
            "rate (req/s)",
            "mean TPOT (ms)",
            "mean TTFT (ms)",
            "decode seqs per die",
            "prefix hits",
            "prefill busy",
            "meets SLA",
        ],
        [
            [
                f"{p.scale:g}",
                f"{p.tpot_ms:.2f}",
                f"{p.ttft_ms:,.0f}",
                f"{p.decode_seqs_per_die:.1f}",
                f"{p.prefix_hits:.1%}",
                f"{p.prefill_busy:.0%}",
                "yes" if p.meets else "no",
            ]
            for p in res.points
        ],
        notes=[
            f"rate found: {found.scale:g} requests/s"
            + ("" if res.found else " (missed the SLA)")
            + "; the paper does not publish its rate",
            f"what the next rate up missed: {binding}",
        ],
    )
    return rows, [table]
