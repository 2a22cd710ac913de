"""Capacity search: the highest arrival rate at which a PD deployment meets its SLA.

A deployment's capacity is not one replay's output: TTFT and TPOT at a given rate say little
until you know how far that rate is from the knee. :func:`search_capacity` replays a workload
at a sequence of arrival rates and brackets the knee: from ``start`` it doubles the rate while
the SLA holds (or halves it while it does not), then bisects between the last rate that met the
SLA and the first that missed it. Each rate is a full replay in virtual time (same seed, same
decode communication grid), so the search is deterministic.

The knob is whatever ``workload_at(x)`` makes of ``x``: an absolute rate in requests/s for a
generated workload (:func:`~xds.trace.production.production_workload`), or a rate scale for a
recorded trace (``trace.scaled(x)``).

Each rate is judged on its **steady window**: the requests that arrive in the middle half of
its arrivals, so that neither the empty start nor the drain at the end counts. Two criteria:

* ``"mean"`` (SPEC 12.4's reading of "TTFT < 2 s, TPOT 35 ms"): mean TPOT <= the SLA's TPOT
  and mean TTFT <= the SLA's TTFT over the window's completed requests, and none of the
  window's requests failed (except for being longer than the model's context: every
  deployment fails those);
* ``"goodput"``: the share of the window's requests (failed ones included) with TTFT and TPOT
  both under the SLA is at least ``goodput_target``.

Under either, a rate the deployment does not keep up with is not sustained
(:func:`backlog_ratio`): a trace compressed far enough arrives in a burst that the deployment
only works off after the last arrival, and its means would otherwise look fine.

A finite replay "meets" any mean-TPOT target at any rate if prefill is the bottleneck (requests
just queue in front of prefill, and decode sees a trickle), which is why the TTFT bound is part
of both criteria.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import msgspec
import numpy as np

from ..docfields import document_fields
from ..errors import ConfigError
from ..trace.metrics import SLA, RequestRecord, prefix_hit_ratio
from ..trace.workload import Workload
from .compare import Spread, seed_list
from .decode_te import comm_grid
from .distflow import KVMover
from .job_executor import (
    DecodeTESelection,
    PrefillTESelection,
    earliest_first_token,
    fewest_sequences,
)
from .policies import require_callable
from .prefill import PrefillPlacement, least_work
from .replay import (
    CONTEXT_FAILURE,
    MAX_ARRIVAL_NS,
    MODEL_CONTEXT_TOKENS,
    PDConfig,
    check_pd_config,
    replay,
)
from .routing import DecodeRouting, lowest_kv
from .speculative import Speculator

Criterion = Literal["mean", "goodput"]
CRITERIA: tuple[str, ...] = get_args(Criterion)


class CapacityPoint(msgspec.Struct, frozen=True):
    """One rate the search replayed, measured over its steady window."""

    scale: float
    """The searched knob: requests/s of a generated workload, or a trace's rate scale."""
    rate_per_s: float
    """Arrivals per second of the replayed workload: (requests - 1) / (last - first arrival)."""
    requests: int
    steady_requests: int
    """Requests arriving in the middle half of the arrival window (the ones judged)."""
    failed: int
    """Failed requests in the steady window (they count against goodput)."""
    tpot_ms: float
    ttft_ms: float
    goodput: float
    decode_seqs_per_die: float
    prefix_hits: float
    prefill_busy: float
    """Mean over Prefill TEs of their busy share of the prefill phase (the whole replay)."""
    misses: tuple[str, ...]
    """What this rate missed, e.g. ``("mean TTFT 4,260 ms > 2,000 ms",)``; empty if it met."""
    lead_in_s: float = 0.0
    """From the first arrival to the steady window's first: the time decode had to fill up."""
    mean_decode_s: float = 0.0
    """Mean decode lifetime (joining a decode batch to the last token) of the steady window's
    completed requests."""
    backlog_ratio: float = float("nan")
    """How many times the span of the steady window's arrivals its first tokens took
    (:func:`backlog_ratio`): about 1 when prefill keeps up."""
    backlog_excess_ms: float = 0.0
    """By how much the first tokens' span exceeded the arrivals'."""

    @property
    def meets(self) -> bool:
        return not self.misses

    @property
    def warm(self) -> bool:
        """The steady window opened at least one mean decode lifetime after the first arrival,
        so the decode TE had filled up: otherwise its TPOT is optimistic (a short window, e.g.
        a trace compressed by a large rate scale)."""
        return self.lead_in_s >= self.mean_decode_s


class CapacityResult(msgspec.Struct, frozen=True):
    found: CapacityPoint | None
    """The highest rate that met the SLA; None if even the lowest rate tried missed."""
    points: tuple[CapacityPoint, ...]
    """Every rate tried, by increasing scale."""
    capped: bool
    """Every rate up to ``max_scale`` met the SLA (``found`` is the cap)."""
    binding: str
    """What the first rate above ``found`` missed (the lowest rate's misses when ``found`` is
    None; empty when ``capped``)."""
    criterion: str
    sla: SLA
    goodput_target: float


def _middle_half(records: list[RequestRecord]) -> tuple[float, float]:
    lo, hi = np.percentile(np.array([r.arrival_ns for r in records]), [25, 75])
    return float(lo), float(hi)


def steady_window(records: list[RequestRecord]) -> list[RequestRecord]:
    """The requests (completed or failed) arriving in the middle half of the arrival window."""
    if not records:
        return []
    lo, hi = _middle_half(records)
    return [r for r in records if lo <= r.arrival_ns <= hi]


def decode_start_ns(r: RequestRecord) -> int:
    """When ``r`` joined a decode batch: its first token, the decode admission wait and the KV
    transfer after it."""
    return r.first_token_ns + r.decode_wait_ns + r.kv_transfer_ns


def decoding_per_die(records: list[RequestRecord], dies: int) -> float:
    """Mean sequences in decode per decode die over the middle half of the arrival window
    (each request counts from joining a decode batch to its last token; never more than the
    batch limit)."""
    if not records:
        return 0.0
    lo, hi = _middle_half(records)
    busy = sum(
        max(0.0, min(hi, r.finish_ns) - max(lo, decode_start_ns(r)))
        for r in records
        if r.outcome == "completed" and r.output_tokens > 1
    )
    return busy / max(1.0, hi - lo) / dies


KEEP_UP = 1.25
"""[emulator choice] Beyond this :func:`backlog_ratio` (and by more than a quarter of the SLA's
TTFT), arrivals outpace the deployment: the rate is not sustained."""

FAR_BEHIND = 2.0
"""[emulator choice] Beyond this :func:`backlog_ratio`, and by more than a tenth of the SLA's
TTFT, the rate is not sustained however short the window: first tokens come at half the
arrival rate or slower, so a longer run at that rate would only queue more (a short trace
compressed into a burst otherwise slips under the quarter-TTFT excess bound of
:data:`KEEP_UP`; the tenth keeps a few requests whose prompts grow from failing it)."""


def backlog_ratio(window: list[RequestRecord]) -> tuple[float, float]:
    """(ratio, excess in ms): the span of the window's first tokens over the span of its
    arrivals (completed requests, 10th to 90th percentile, so that one long prompt does not
    decide it), and by how much the first exceeds the second. A deployment that keeps up gives
    first tokens as fast as requests arrive (ratio about 1); one that does not builds a backlog
    and gives them over a longer span."""
    done = [r for r in window if r.outcome == "completed"]
    if len(done) < 4:
        return float("nan"), 0.0
    arrivals = np.percentile([r.arrival_ns for r in done], [10, 90])
    firsts = np.percentile([r.first_token_ns for r in done], [10, 90])
    arrive, first = float(arrivals[1] - arrivals[0]), float(firsts[1] - firsts[0])
    return first / max(arrive, 1.0), (first - arrive) / 1e6


def _arrival_rate(workload: Workload) -> float:
    span = workload.duration_ns / 1e9
    return (len(workload) - 1) / span if span > 0 else 0.0


def _beyond_the_model(record: RequestRecord) -> bool:
    """Failed for a context longer than the model's own (every deployment fails it); one a
    deployment refuses under a lower ``max_context_tokens`` is that deployment's failure."""
    return (
        CONTEXT_FAILURE in record.reason
        and record.input_tokens + record.output_tokens > MODEL_CONTEXT_TOKENS
    )


def measure_point(
    workload: Workload,
    scale: float,
    records: list[RequestRecord],
    config: PDConfig,
    prefill_busy: list[float],
    *,
    criterion: Criterion = "mean",
    goodput_target: float = 0.9,
) -> CapacityPoint:
    """Judge one replay's records against ``config.sla`` (see the module docstring)."""
    sla = config.sla
    window = steady_window(records)
    done = [r for r in window if r.outcome == "completed"]
    decoded = [r for r in done if r.output_tokens > 1]
    tpot = float(np.mean([r.tpot_ns for r in decoded])) / 1e6 if decoded else float("nan")
    ttft = float(np.mean([r.ttft_ns for r in done])) / 1e6 if done else float("nan")
    good = sum(1 for r in done if sla.met_by(r))
    goodput = good / len(window) if window else 0.0
    misses: list[str] = []
    if not done:
        misses.append("no request of the steady window completed")
    elif criterion == "mean":
        if tpot > sla.tpot_ms:
            misses.append(f"mean TPOT {tpot:,.2f} ms > {sla.tpot_ms:g} ms")
        if ttft > sla.ttft_ms:
            misses.append(f"mean TTFT {ttft:,.0f} ms > {sla.ttft_ms:,.0f} ms")
        lost = [r for r in window if r.outcome == "failed" and not _beyond_the_model(r)]
        if lost:  # the means above cover completed requests only
            misses.append(f"{len(lost)} of {len(window)} requests failed ({lost[0].reason})")
    elif goodput < goodput_target:
        misses.append(f"goodput {goodput:.1%} < {goodput_target:.1%}")
    ratio, excess_ms = backlog_ratio(window)
    if (ratio > KEEP_UP and excess_ms > sla.ttft_ms / 4) or (
        ratio > FAR_BEHIND and excess_ms > sla.ttft_ms / 10
    ):
        misses.append(
            f"arrivals outpace the deployment (the window's first tokens took {ratio:.2f}x the "
            "span of its arrivals)"
        )
    return CapacityPoint(
        scale=scale,
        rate_per_s=_arrival_rate(workload),
        requests=len(records),
        steady_requests=len(window),
        failed=len(window) - len(done),
        tpot_ms=tpot,
        ttft_ms=ttft,
        goodput=goodput,
        decode_seqs_per_die=decoding_per_die(records, config.decode_tes * config.decode.dies),
        prefix_hits=prefix_hit_ratio(done),
        prefill_busy=float(np.mean(prefill_busy)) if prefill_busy else 0.0,
        misses=tuple(misses),
        lead_in_s=(_middle_half(records)[0] - min(r.arrival_ns for r in records)) / 1e9
        if records
        else 0.0,
        mean_decode_s=float(np.mean([r.finish_ns - decode_start_ns(r) for r in decoded])) / 1e9
        if decoded
        else 0.0,
        backlog_ratio=ratio,
        backlog_excess_ms=excess_ms,
    )


def _check(
    start: float, max_scale: float, min_scale: float, bisections: int, criterion: str, target: float
) -> None:
    if not 0 < start < math.inf:
        raise ConfigError(f"start must be positive and finite, got {start}", field="start")
    if not start <= max_scale < math.inf:
        raise ConfigError(
            f"max_scale must be finite and >= start ({start}), got {max_scale}", field="max_scale"
        )
    if not 0 < min_scale <= start:
        raise ConfigError(
            f"min_scale must be in (0, start={start}], got {min_scale}", field="min_scale"
        )
    if bisections < 0:
        raise ConfigError(f"bisections must be >= 0, got {bisections}", field="bisections")
    if criterion not in CRITERIA:
        raise ConfigError(
            f"unknown criterion {criterion!r}: one of {', '.join(CRITERIA)}", field="criterion"
        )
    if not 0 < target <= 1:
        raise ConfigError(f"goodput_target must be in (0, 1], got {target}", field="goodput_target")


def _check_workload_at(workload_at: object, and_seed: str, instead: str) -> None:
    """``workload_at`` must be a function of the searched rate (``and_seed``: and the seed),
    not a Workload (``instead``: what to pass)."""
    if isinstance(workload_at, Workload):
        raise ConfigError(
            f"must be a function of the searched rate{and_seed} returning a Workload, got a "
            f"Workload: pass {instead} (the search then varies the trace's rate scale)",
            field="workload_at",
        )
    require_callable(workload_at, "workload_at", arity=2 if and_seed else 1, kind="function")


def search_capacity(
    workload_at: Callable[[float], Workload],
    config: PDConfig | None = None,
    *,
    start: float = 1.0,
    max_scale: float | None = None,
    min_scale: float | None = None,
    bisections: int = 4,
    criterion: Criterion = "mean",
    goodput_target: float = 0.9,
    seed: int = 0,
    on_point: Callable[[CapacityPoint], None] | None = None,
    prefill_placement: PrefillPlacement = least_work,
    decode_routing: DecodeRouting = lowest_kv,
    prefill_te_selection: PrefillTESelection = earliest_first_token,
    decode_te_selection: DecodeTESelection = fewest_sequences,
    jobs: int = 1,
    kv_mover: KVMover | None = None,
) -> CapacityResult:
    """The highest ``x`` (within the search's resolution) at which replaying ``workload_at(x)``
    on ``config`` meets ``config.sla`` by ``criterion``.

    Doubles ``x`` from ``start`` while the SLA holds, up to ``max_scale`` (default
    ``256 * start``; the last step lands on it, and if it meets too the result is ``capped``),
    or halves it while it does not, down to ``min_scale`` (default ``start / 256``; if that
    misses too, ``found`` is None). Then ``bisections`` midpoints between the last rate that
    met and the first that missed; a rate is never replayed twice. ``on_point`` sees every
    point as it is measured (a progress hook). The policy keywords plug your own policies into
    every replay, as in :func:`~xds.serve.replay.replay`: the capacity of your router (or,
    with ``kv_mover``, of your KV-transfer protocol).

    ``jobs > 1`` replays the rates the search may try next in that many worker processes while
    it waits for the current one (:class:`~xds.serve.speculative.Speculator`); the points
    tried and the result are the same for any ``jobs``, only the wall time changes."""
    _check_workload_at(workload_at, "", "its `scaled` method")
    if on_point is not None:
        require_callable(on_point, "on_point", arity=1, kind="callback")
    cfg = check_pd_config(config)
    cfg = msgspec.structs.replace(cfg, record_token_times=False)  # no ITL here: save the memory
    cap = 256 * start if max_scale is None else max_scale
    floor = start / 256 if min_scale is None else min_scale
    _check(start, cap, floor, bisections, criterion, goodput_target)
    built: dict[float, Workload] = {}  # the floor's workload, built to check its reach

    def workload_of(x: float) -> Workload:
        w = built.pop(x, None)
        return workload_at(x) if w is None else w

    floor = _horizon_floor(workload_at, start, floor, built)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a positive integer, got {jobs!r}", field="jobs")
    grid = comm_grid(cfg.decode, seed=seed)
    seen: dict[float, CapacityPoint] = {}

    def measure(x: float) -> CapacityPoint:
        workload = workload_of(x)
        if not isinstance(workload, Workload) or len(workload) < 2 or not workload.duration_ns:
            raise ConfigError(
                f"workload_at({x:g}) must return a Workload of at least two requests whose "
                "arrivals span some time (the rate cannot change a workload that arrives at once)",
                field="workload_at",
            )
        res = replay(
            workload,
            cfg,
            seed=seed,
            grid=grid,
            prefill_placement=prefill_placement,
            decode_routing=decode_routing,
            prefill_te_selection=prefill_te_selection,
            decode_te_selection=decode_te_selection,
            kv_mover=kv_mover,
        )
        return measure_point(
            workload,
            x,
            res.records,
            cfg,
            res.prefill_busy,
            criterion=criterion,
            goodput_target=goodput_target,
        )

    with Speculator(measure, jobs) as points:
        return _search(
            points, seen, on_point, start, cap, floor, bisections, criterion, goodput_target, cfg
        )


def _horizon_floor(
    workload_at: Callable[[float], Workload],
    start: float,
    floor: float,
    built: dict[float, Workload],
) -> float:
    """``floor``, raised if need be so that the slowest workload the search may replay still
    arrives within a replay's reach (:data:`~xds.serve.replay.MAX_ARRIVAL_NS`): a long trace
    scaled down far enough would otherwise stop the search with an error. The workload built
    for the floor it returns is left in ``built`` (the search reuses it)."""

    def last(x: float) -> float:
        """The last arrival at ``x``; infinite if a trace cannot even be slowed that far (its
        arrivals would leave the int64 nanosecond clock: Workload.scaled refuses)."""
        try:
            w = built[x] = workload_at(x)
        except ConfigError as exc:
            if exc.field != "rate_scale":
                raise
            return math.inf
        return max((r.arrival_ns for r in w.requests), default=0) if isinstance(w, Workload) else 0

    span = last(floor)
    if span <= MAX_ARRIVAL_NS:
        return floor
    built.clear()
    # a scaled trace's arrivals stretch like 1 / x; beyond the clock, double until back
    x = floor * span / MAX_ARRIVAL_NS if span < math.inf else 2 * floor
    for _ in range(2_100):  # 2**2100 spans any float
        if x >= start:
            if last(start) > MAX_ARRIVAL_NS:
                raise ConfigError(
                    f"at {start:g}x its rate the workload arrives over more than "
                    f"{MAX_ARRIVAL_NS / 86_400e9:.1f} days, beyond what a replay reaches: start "
                    "the search at a higher rate",
                    field="start",
                )
            return start
        span = last(x)
        if span <= MAX_ARRIVAL_NS:
            return x
        built.clear()
        # a trace slowed by 1 / x stretches like 1 / x: jump there (a little past, for rounding)
        x *= max(1.01 * span / MAX_ARRIVAL_NS, 1.01) if span < math.inf else 2
    return start


def _search(
    points: Speculator[CapacityPoint],
    seen: dict[float, CapacityPoint],
    on_point: Callable[[CapacityPoint], None] | None,
    start: float,
    cap: float,
    floor: float,
    bisections: int,
    criterion: Criterion,
    goodput_target: float,
    cfg: PDConfig,
) -> CapacityResult:
    """The search itself: double or halve from ``start``, then bisect; ``points`` evaluates
    each rate, and ``probe(x, *then)`` names the rates the search may try next, for workers to
    start on (computed with the same arithmetic as the path itself)."""

    def probe(x: float, *then: float) -> bool:
        if x in seen:
            return seen[x].meets
        points.ahead([x, *sorted(then)])  # the lower guess first: a lower rate replays faster
        point = seen[x] = points.get(x)
        if on_point is not None:
            on_point(point)
        return point.meets

    def result(found: float | None, capped: bool = False) -> CapacityResult:
        measured = tuple(seen[x] for x in sorted(seen))
        above = [p for p in measured if found is None or p.scale > found]
        return CapacityResult(
            found=None if found is None else seen[found],
            points=measured,
            capped=capped,
            binding="" if capped else "; ".join(above[0].misses),
            criterion=criterion,
            sla=cfg.sla,
            goodput_target=goodput_target,
        )

    if probe(start, min(2 * start, cap), max(start / 2, floor)):
        lo = start  # up: lo met; stop at the first rate that misses, or at the cap
        while True:
            if lo >= cap:
                return result(lo, capped=True)
            hi = min(2 * lo, cap)
            if not probe(hi, min(2 * hi, cap), (lo + hi) / 2):
                break
            lo = hi
    else:  # down: hi missed; stop at the first rate that meets, or at the floor
        hi = start
        while True:
            if hi <= floor:
                return result(None)
            lo = max(hi / 2, floor)
            if probe(lo, (lo + hi) / 2, max(lo / 2, floor)):
                break
            hi = lo
    for _ in range(bisections):
        mid = (lo + hi) / 2
        if not lo < mid < hi:  # floating-point resolution reached
            break
        lo, hi = (mid, hi) if probe(mid, (mid + hi) / 2, (lo + mid) / 2) else (lo, mid)
    return result(lo)


document_fields(CapacityPoint, CapacityResult)


class SeededCapacity(msgspec.Struct, frozen=True):
    """A capacity search repeated over seeds (:func:`search_capacity_over_seeds`)."""

    seeds: list[int]
    results: list[CapacityResult]
    """One search per seed, in :attr:`seeds` order."""
    capacity: Spread
    """The capacity found (the searched knob: req/s, or a trace's rate scale) over the seeds
    whose search found one below its cap (``capacity.n`` of them): a seed at the cap (its
    capacity is at least the cap) or with none found (below the lowest rate) is left out, so
    with either the mean is censored (:attr:`capped`, :attr:`missed`)."""
    rate_per_s: Spread
    """The arrivals per second at the capacity, over the same seeds."""
    capped: int = 0
    """Seeds whose every rate up to the cap met the SLA."""
    missed: int = 0
    """Seeds whose lowest rate tried missed the SLA."""

    @classmethod
    def of(cls, seeds: list[int], results: list[CapacityResult]) -> SeededCapacity:
        """The spread of one search per seed."""
        return cls(
            seeds,
            results,
            Spread.of([found_value(r, lambda p: p.scale) for r in results]),
            Spread.of([found_value(r, lambda p: p.rate_per_s) for r in results]),
            capped=sum(1 for r in results if r.capped),
            missed=sum(1 for r in results if r.found is None),
        )

    def difference(self, baseline: SeededCapacity) -> Spread:
        """The paired difference of the capacity from ``baseline``'s, seed by seed (over the
        seeds where both found one below the cap): searches of the same seeds."""
        if baseline.seeds != self.seeds:
            raise ConfigError(
                f"seeds differ ({baseline.seeds} and {self.seeds}): the difference pairs the "
                "searches of the same seeds",
                field="baseline",
            )
        return Spread.of(
            [
                found_value(r, lambda p: p.scale) - found_value(b, lambda p: p.scale)
                for r, b in zip(self.results, baseline.results, strict=True)
            ]
        )


def found_value(res: CapacityResult, of: Callable[[CapacityPoint], float]) -> float:
    """``of(res.found)``; NaN when nothing met the SLA or everything did (up to the cap)."""
    return math.nan if res.found is None or res.capped else of(res.found)


def search_capacity_over_seeds(
    workload_at: Callable[[float, int], Workload],
    config: PDConfig | None = None,
    *,
    seeds: int | Sequence[int] = 5,
    on_result: Callable[[int, CapacityResult], None] | None = None,
    **search: Any,
) -> SeededCapacity:
    """:func:`search_capacity` once per seed (``workload_at(x, seed)`` the workload at rate or
    scale ``x`` under that seed; ``search``: the other keywords of :func:`search_capacity`),
    and the capacity's mean over seeds with its 95 % confidence interval: a capacity is found
    by bisecting replays that each move with their seed, so comparing two designs' capacities
    within a few per cent needs the interval. ``on_result(seed, result)`` sees each search as
    it ends."""
    chosen = seed_list(seeds)
    _check_workload_at(workload_at, " and the seed", "`lambda x, seed: trace.scaled(x)`")
    if on_result is not None:
        require_callable(on_result, "on_result", arity=2, kind="callback")
    if "seed" in search:
        raise ConfigError("give the seeds as seeds=, not seed=", field="seed")
    results = []
    for seed in chosen:

        def at(x: float, seed: int = seed) -> Workload:
            return workload_at(x, seed)

        res = search_capacity(at, config, seed=seed, **search)
        results.append(res)
        if on_result is not None:
            on_result(seed, res)
    return SeededCapacity.of(chosen, results)


document_fields(SeededCapacity)
