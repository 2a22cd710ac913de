"""Comparing deployments or policies across seeds: is a difference real, or the seed's noise?

One replay's numbers move with its seed: the MTP acceptance draws, the experts each token
picks, routing ties and (for a generated workload) the requests themselves all come from
seeded streams, and a decode iteration runs at its widest DP group, so a small change of timing
can shift one replay's mean TPOT by a few per cent either way. :func:`compare` replays one
workload on every variant with the same seeds and reports, per metric:

* per variant, the mean over seeds with a 95 % confidence interval (Student's t on the
  seeds' values), and the range;
* per variant after the first (the baseline), the **paired difference** from the baseline:
  the mean over seeds of (variant - baseline), with its 95 % interval. Seed ``s`` gives every
  variant the same arrivals, lengths and random streams (common random numbers), so the
  noise the seeds share cancels in each seed's difference and a smaller true difference
  shows. A difference whose interval excludes zero is ``significant``.

The variants' replays are independent: with ``jobs > 1`` they run in that many worker
processes (:class:`~xds.serve.speculative.Speculator`); the numbers do not depend on ``jobs``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

from ..docfields import document_fields
from ..errors import ConfigError
from ..trace.metrics import SLA, Summary
from ..trace.workload import Workload
from .policies import require_callable
from .replay import PDConfig, check_pd_config, check_replay, replay
from .speculative import Speculator

POLICY_KEYWORDS = (
    "decode_routing",
    "prefill_placement",
    "prefill_te_selection",
    "decode_te_selection",
    "kv_mover",
)
"""The :func:`~xds.serve.replay.replay` keywords a :class:`Variant` may plug a policy into."""


class Variant(msgspec.Struct, frozen=True):
    """One design to compare: a deployment and the policies plugged into it."""

    config: PDConfig
    policies: dict[str, Any] = {}
    """Keyword -> function, for :func:`~xds.serve.replay.replay`'s policy keywords
    (:data:`POLICY_KEYWORDS`); the defaults where absent."""


class Metric(msgspec.Struct, frozen=True):
    """One figure compared: ``key`` in the results, how it reads, and which way is better."""

    key: str
    label: str
    unit: str
    lower_is_better: bool


METRICS: tuple[Metric, ...] = (
    Metric("ttft_mean_ms", "TTFT mean", "ms", True),
    Metric("ttft_p99_ms", "TTFT p99", "ms", True),
    Metric("tpot_mean_ms", "TPOT mean", "ms", True),
    Metric("tpot_p99_ms", "TPOT p99", "ms", True),
    Metric("e2e_mean_s", "E2E mean", "s", True),
    Metric("queue_mean_ms", "prefill queueing mean", "ms", True),
    Metric("tokens_per_s_per_chip", "output tokens/s per chip", "tok/s", False),
    Metric("goodput", "SLA goodput", "share", False),
    Metric("failed", "failed requests", "requests", True),
)
"""What :func:`compare` reports, in order."""


def metric_values(s: Summary) -> dict[str, float]:
    """The :data:`METRICS` of one replay's summary (NaN where undefined, e.g. TPOT when no
    request was decoded)."""
    return {
        "ttft_mean_ms": s.ttft_ms.mean,
        "ttft_p99_ms": s.ttft_ms.p99,
        "tpot_mean_ms": s.tpot_ms.mean,
        "tpot_p99_ms": s.tpot_ms.p99,
        "e2e_mean_s": s.e2e_s.mean,
        "queue_mean_ms": s.queue_ms.mean,
        "tokens_per_s_per_chip": s.output_tokens_per_s_per_chip,
        "goodput": s.goodput,
        "failed": float(s.failed),
    }


class Spread(msgspec.Struct, frozen=True):
    """One metric of one variant over the seeds (the seeds where it is defined)."""

    mean: float
    ci95: float
    """Half-width of the 95 % confidence interval of the mean (Student's t); NaN with fewer
    than two values."""
    stdev: float
    """Sample standard deviation; NaN with fewer than two values."""
    min: float
    max: float
    n: int = 0
    """Seeds the metric is defined for (TPOT is not where no request was decoded, say): the
    others are left out."""

    @property
    def excludes_zero(self) -> bool:
        """Its interval excludes 0 (never without an interval): a difference this is the
        spread of is significant."""
        return not math.isnan(self.ci95) and abs(self.mean) > self.ci95

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of one value per seed, NaN values left out (all NaN: NaN)."""
        v = [x for x in values if not math.isnan(x)]
        n = len(v)
        if n == 0:
            nan = math.nan
            return cls(nan, nan, nan, nan, nan, 0)
        lo, hi = min(v), max(v)
        mean = min(max(math.fsum(v) / n, lo), hi)  # rounding never puts it outside the values
        if n < 2:
            return cls(mean, math.nan, math.nan, lo, hi, 1)
        stdev = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (n - 1))
        return cls(mean, t95(n - 1) * stdev / math.sqrt(n), stdev, lo, hi, n)


class Difference(msgspec.Struct, frozen=True):
    """A variant's paired difference from the baseline on one metric."""

    metric: str
    variant: str
    baseline: str
    mean: float
    """Mean over seeds of (variant - baseline), in the metric's unit (over the seeds where
    both are defined)."""
    ci95: float
    """Half-width of its 95 % confidence interval; NaN with fewer than two such seeds."""
    relative: float
    """``mean`` over the baseline's mean (NaN if that is 0 or undefined)."""
    significant: bool
    """The interval excludes zero (never without an interval)."""
    better: bool | None
    """Whether the variant is better on this metric, if ``significant``; else None."""


class VariantResult(msgspec.Struct, frozen=True):
    """One variant's replays, one per seed."""

    name: str
    chips: int
    summaries: list[Summary]
    """One per seed, in :attr:`Comparison.seeds` order."""
    metrics: dict[str, Spread]
    """:data:`METRICS` key -> its spread over the seeds."""
    unfired_faults: list[int] = []
    """Per seed, how many of the faults never struck (every request had ended before)."""


class Comparison(msgspec.Struct, frozen=True):
    """The result of :func:`compare`."""

    seeds: list[int]
    workload: str
    """The workload compared, as its first seed's :attr:`Workload.source` describes it."""
    metrics: list[Metric]
    variants: list[VariantResult]
    """The baseline first."""
    differences: list[Difference]
    """Every later variant against the baseline, metric by metric."""

    def difference(self, variant: str, metric: str) -> Difference:
        """``variant``'s difference from the baseline on ``metric`` (a :data:`METRICS` key)."""
        for d in self.differences:
            if d.variant == variant and d.metric == metric:
                return d
        raise KeyError(f"no difference of {variant!r} on {metric!r}")


document_fields(Spread, Difference, VariantResult, Comparison)

_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""Student's t, two-sided 95 % (the 0.975 quantile), for 1..30 degrees of freedom."""


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom: tabulated to
    30, then the Cornish-Fisher expansion to second order, z + (z^3 + z) / (4 df) +
    (5 z^5 + 16 z^3 + 3 z) / (96 df^2) (within 0.0001 beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def variant_field(name: str) -> str:
    """How errors name the variant ``name``: ``variants['name']``."""
    return f"variants[{name!r}]"


@contextlib.contextmanager
def _naming_variant(name: str, several: bool) -> Iterator[None]:
    """A ConfigError raised for variant ``name`` names it: a deployment field as
    ``variants['name'].config.<field>``; any other (a fault the deployment has no place for,
    a policy's signature) says which variant in its message, when there are ``several``."""
    try:
        yield
    except ConfigError as exc:
        if exc.source is not None:
            raise
        top = re.split(r"[.\[]", exc.field or "")[0]
        if top in PDConfig.__struct_fields__:
            field = f"{variant_field(name)}.config.{exc.field}"
            raise ConfigError(exc.message, field=field) from None
        if not several:
            raise
        raise ConfigError(f"{exc.message} (variant {name!r})", field=exc.field) from None


def _warn_if_roles_differ(chosen: Mapping[str, Variant], faults: Sequence[object]) -> None:
    """A node fault names a server by number, and the numbering follows each deployment's
    layout (Prefill TEs first): one that strikes different roles in different variants
    compares unlike outages, which the comparison alone would not show."""
    import warnings

    from .recovery import NodeFault

    for fault in faults:
        if not isinstance(fault, NodeFault):
            continue
        roles = {name: v.config.server_role(fault.server) for name, v in chosen.items()}
        if len(set(roles.values())) > 1:
            where = ", ".join(f"{role} in {name}" for name, role in roles.items())
            warnings.warn(
                f"the node fault on server {fault.server} strikes {where}: the variants lose "
                "different parts (servers are numbered Prefill TEs first)",
                stacklevel=3,
            )


def _variants(variants: Mapping[str, PDConfig | Variant]) -> dict[str, Variant]:
    if not isinstance(variants, Mapping) or not variants:
        raise ConfigError(
            "variants must be a non-empty mapping of name -> PDConfig or Variant "
            f"(the first is the baseline), got {variants!r:.80}",
            field="variants",
        )
    out: dict[str, Variant] = {}
    for name, v in variants.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"variant names must be non-empty strings, got {name!r}", field="variants"
            )
        field = variant_field(name)
        if isinstance(v, PDConfig):
            v = Variant(v)
        if not isinstance(v, Variant):
            raise ConfigError(
                f"must be a PDConfig or a Variant, got {type(v).__name__}", field=field
            )
        if not isinstance(v.policies, dict):
            raise ConfigError("must be a dict", field=f"{field}.policies")
        for key, fn in v.policies.items():
            if key not in POLICY_KEYWORDS:
                raise ConfigError(
                    f"unknown policy {key!r}; one of " + ", ".join(POLICY_KEYWORDS),
                    field=f"{field}.policies",
                )
            require_callable(fn, f"{field}.policies[{key!r}]")
        out[name] = Variant(check_pd_config(v.config), dict(v.policies))
    return out


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    """``seeds`` as a list: a count n gives 0 .. n - 1."""
    if isinstance(seeds, numbers.Integral) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ConfigError(f"seeds must be at least 1, got {seeds}", field="seeds")
        return list(range(int(seeds)))
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Iterable):
        raise ConfigError(
            f"seeds must be a count or a list of seeds, got {seeds!r:.80}", field="seeds"
        )
    out = list(seeds)
    if not out or any(
        isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0 for s in out
    ):
        raise ConfigError(
            f"seeds must be non-negative integers, at least one, got {seeds!r:.80}", field="seeds"
        )
    out = [int(s) for s in out]
    if len(set(out)) != len(out):
        raise ConfigError(f"seeds must be distinct, got {out!r:.80}", field="seeds")
    return out


def compare(
    workload: Workload | Callable[[int], Workload],
    variants: Mapping[str, PDConfig | Variant],
    *,
    seeds: int | Sequence[int] = 5,
    sla: SLA | None = None,
    jobs: int = 1,
    on_replay: Callable[[str, int, Summary], None] | None = None,
    faults: Sequence[object] = (),
    serve_grace_ns: int | None = None,
) -> Comparison:
    """Replay ``workload`` on every variant with each of ``seeds`` and compare them.

    ``workload`` is a :class:`~xds.trace.workload.Workload` (the same requests under every
    seed: only the serving's random streams change) or a function of the seed returning one
    (a generated workload: each seed its own requests, the same for every variant; called
    once per seed, before any replay). ``variants`` maps a name to a
    :class:`~xds.serve.replay.PDConfig` or a :class:`Variant` (a deployment with policies
    plugged in); the first is the baseline. ``seeds``: how many (0, 1, ...) or which.
    ``sla``: the targets goodput is judged by for every variant (default: the variants' own,
    which must then agree: goodput under different targets does not compare).
    ``on_replay(name, seed, summary)`` sees each replay as it ends (a progress hook; in
    variant then seed order). ``faults`` strike every replay alike (the faults of
    :func:`~xds.serve.replay.replay`: compare recovery modes, say, as variants differing in
    ``recovery``); ``serve_grace_ns`` as in :func:`~xds.serve.replay.replay`. Every variant
    is checked against the workload and the faults (:func:`~xds.serve.replay.check_replay`)
    before anything is replayed.

    Policies should decide from what they are shown: a policy keeping state across calls
    carries it from one replay into the next, and with ``jobs > 1`` each worker process
    starts from its own copy, so its results would depend on ``jobs`` and on the order of the
    replays."""
    chosen = _variants(variants)
    chosen_seeds = seed_list(seeds)
    if isinstance(jobs, bool) or not isinstance(jobs, numbers.Integral) or jobs < 1:
        raise ConfigError(f"jobs must be a positive integer, got {jobs!r}", field="jobs")
    if not isinstance(workload, Workload):
        require_callable(workload, "workload", arity=1, kind="function")
    if on_replay is not None:
        require_callable(on_replay, "on_replay", arity=3, kind="callback")
    chosen = _judged_by(chosen, sla)
    workloads = {seed: _workload_at(workload, seed) for seed in chosen_seeds}  # before any fork
    runs = [(name, seed) for name in chosen for seed in chosen_seeds]
    faults = list(faults)
    several = len(chosen) > 1
    for name, v in chosen.items():  # a mismatch found before any replay, not after some
        with _naming_variant(name, several):
            check_replay(workloads[chosen_seeds[0]], v.config, faults=faults, **v.policies)
    _warn_if_roles_differ(chosen, faults)

    def run(i: float) -> tuple[Summary, int]:
        name, seed = runs[int(i)]
        v, w = chosen[name], workloads[seed]
        with _naming_variant(name, several):
            res = replay(
                w,
                v.config,
                seed=seed,
                faults=faults,  # type: ignore[arg-type]
                serve_grace_ns=serve_grace_ns,
                **v.policies,
            )
        summary = msgspec.structs.replace(
            res.summary, chips=res.chips, deployment=name, seed=seed, workload=w.source
        )
        return summary, len(res.unfired_faults)

    summaries: dict[str, list[Summary]] = {name: [] for name in chosen}
    unfired: dict[str, list[int]] = {name: [] for name in chosen}
    with Speculator(run, int(jobs)) as pool:
        for i, (name, seed) in enumerate(runs):
            pool.ahead([float(j) for j in range(i, len(runs))])
            s, missed = pool.get(float(i))
            summaries[name].append(s)
            unfired[name].append(missed)
            if on_replay is not None:
                on_replay(name, seed, s)
    return _compared(chosen_seeds, workloads[chosen_seeds[0]].source, chosen, summaries, unfired)


def _workload_at(workload: Workload | Callable[[int], Workload], seed: int) -> Workload:
    if isinstance(workload, Workload):
        return workload
    w = workload(seed)
    if not isinstance(w, Workload):
        raise ConfigError(
            f"workload({seed}) must return a Workload, got {type(w).__name__}", field="workload"
        )
    return w


def _judged_by(chosen: dict[str, Variant], sla: SLA | None) -> dict[str, Variant]:
    """The variants, each judging goodput by ``sla`` (None: their own, which must agree)."""
    if sla is not None:
        if not isinstance(sla, SLA):
            raise ConfigError(f"must be an SLA, got {type(sla).__name__}", field="sla")
        return {
            name: Variant(msgspec.structs.replace(v.config, sla=sla), v.policies)
            for name, v in chosen.items()
        }
    targets = {name: v.config.sla for name, v in chosen.items()}
    first, base = next(iter(targets.items()))
    for name, target in targets.items():
        if target != base:
            raise ConfigError(
                f"variants {first!r} and {name!r} judge goodput by different SLAs (TTFT "
                f"{base.ttft_ms:g} / {target.ttft_ms:g} ms, TPOT {base.tpot_ms:g} / "
                f"{target.tpot_ms:g} ms): give one sla for all",
                field="sla",
            )
    return chosen


def _compared(
    seeds: list[int],
    source: str,
    chosen: Mapping[str, Variant],
    summaries: dict[str, list[Summary]],
    unfired: dict[str, list[int]],
) -> Comparison:
    values = {name: [metric_values(s) for s in per_seed] for name, per_seed in summaries.items()}
    results = [
        VariantResult(
            name,
            summaries[name][0].chips,
            summaries[name],
            {m.key: Spread.of([v[m.key] for v in values[name]]) for m in METRICS},
            unfired[name],
        )
        for name in chosen
    ]
    base = results[0]
    differences = []
    for r in results[1:]:
        for m in METRICS:
            deltas = [
                v[m.key] - b[m.key] for v, b in zip(values[r.name], values[base.name], strict=True)
            ]
            spread = Spread.of(deltas)
            significant = spread.excludes_zero
            ref = base.metrics[m.key].mean
            differences.append(
                Difference(
                    metric=m.key,
                    variant=r.name,
                    baseline=base.name,
                    mean=spread.mean,
                    ci95=spread.ci95,
                    relative=spread.mean / ref if ref and not math.isnan(ref) else math.nan,
                    significant=significant,
                    better=(spread.mean < 0) == m.lower_is_better if significant else None,
                )
            )
    return Comparison(seeds, source, list(METRICS), results, differences)
