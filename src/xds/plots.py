"""Figures of a replay, a capacity search and a decode run (``--plot`` on ``xds replay``,
``xds capacity`` and ``xds decode``).

:func:`replay_figure` shows where a replay's latency went: the TTFT and TPOT distributions
against the SLA, each request's TTFT by arrival time (a queue building up in front of prefill
shows as a ramp), and how many requests wait for prefill and decode over time.
:func:`capacity_figure` shows a capacity search: mean TPOT, mean TTFT and goodput at every
rate tried, what was judged and the rate found. :func:`decode_figure` shows a colocated decode
run: each kernel's time per iteration (Figure 20 style) and the iteration time over the run.
:func:`save` writes any of them as PNG, SVG or PDF, the same bytes for the same figure (no
dates, fixed SVG ids), so a plot can sit beside results under version control.

Needs matplotlib (``pip install 'xds-sim[plot]'``); everything else in xds runs without it.
Figures are built with matplotlib's object API (no pyplot, no global figure state), so they can
be made from any thread or notebook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError
from .outputs import check_output_path
from .trace.metrics import SLA, RequestRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .serve.capacity import CapacityResult
    from .serve.decode import DecodeResult

FORMATS = (".png", ".svg", ".pdf")
"""File types :func:`save` writes, by suffix."""

_MET, _MISSED = "tab:blue", "tab:red"


def require_matplotlib() -> None:
    """ConfigError naming the extra to install unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "plots need matplotlib: pip install 'xds-sim[plot]' (or pip install matplotlib)",
            field="plot",
        ) from None


def check_path(path: str | Path, *, folder_made_later: bool = False) -> Path:
    """``path`` as a Path :func:`save` can write: a suffix it knows, in an existing folder,
    not a directory, and writable (tried by creating and removing a probe file there), so a
    long run does not end in a failed save; else ConfigError. ``folder_made_later``: only the
    suffix (the folder is an ``--out`` directory the run creates first)."""
    return check_output_path(
        path, FORMATS, field="plot", what="a plot", folder_made_later=folder_made_later
    )


def _figure(rows: int, cols: int, title: str) -> tuple[Figure, np.ndarray]:
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * cols, 3.8 * rows), layout="constrained")
    axes = np.asarray(fig.subplots(rows, cols), dtype=object).reshape(rows, cols)
    if title:
        fig.suptitle(title)
    return fig, axes


def _cdf(ax: Axes, values: np.ndarray, under: int, total: int, limit: float, unit: str, what: str):
    """Empirical CDF of the completed requests' ``values`` with the SLA ``limit`` (skipped
    when infinite), labelled with the share of all ``total`` requests under it (``under``:
    failed requests count as over, as goodput counts them)."""
    if values.size:  # from 0 at the smallest value (so a lone request shows as a rise)
        x = np.sort(values)
        y = np.arange(0, x.size + 1) / x.size
        ax.step(np.r_[x[0], x], y, where="post", color=_MET)
    else:
        ax.text(0.5, 0.5, "no completed request", transform=ax.transAxes, ha="center")
    if np.isfinite(limit) and total:
        ax.axvline(
            limit,
            color=_MISSED,
            linestyle="--",
            label=f"SLA {limit:g} {unit}: {under / total:.1%} of the {total:,} requests under",
        )
        ax.legend(loc="lower right")
    ax.set_xlabel(f"{what} ({unit})")
    ax.set_ylabel("share of completed requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def in_system(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Requests waiting for or in prefill (arrival to first token) and in decode (first token
    to finish), over time: ``(times_s, prefill, decode)``, each count holding from its time to
    the next. A failed request counts until it failed (its finish), in prefill if it had no
    first token."""
    changes: list[tuple[int, int, int]] = []  # (ns, prefill delta, decode delta)
    for r in records:
        end = r.finish_ns if r.finish_ns >= 0 else r.first_token_ns
        if r.first_token_ns >= 0:
            changes += [(r.arrival_ns, 1, 0), (r.first_token_ns, -1, 1)]
            if end >= 0:
                changes.append((end, 0, -1))
        elif end >= 0:
            changes += [(r.arrival_ns, 1, 0), (end, -1, 0)]
    if not changes:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
    changes.sort()
    t = np.array([c[0] for c in changes], dtype=np.int64)
    prefill = np.cumsum([c[1] for c in changes])
    decode = np.cumsum([c[2] for c in changes])
    last = np.append(t[1:] != t[:-1], True)  # one point per instant: the count after it
    return t[last] / 1e9, prefill[last], decode[last]


def replay_figure(
    records: Sequence[RequestRecord], *, sla: SLA | None = None, title: str = ""
) -> Figure:
    """Four panels of a replay's per-request records: TTFT and TPOT CDFs against ``sla``
    (default: SPEC 12.4's), TTFT by arrival time (failed requests marked at their arrival),
    and the requests in prefill and in decode over time."""
    sla = sla or SLA()
    done = [r for r in records if r.outcome == "completed"]
    failed = [r for r in records if r.outcome != "completed"]
    fig, ax = _figure(2, 2, title)
    ttft = np.array([r.ttft_ns / 1e9 for r in done])
    tpot = np.array([r.tpot_ns / 1e6 for r in done if r.output_tokens > 1])
    n = len(records)  # the shares under the SLA are of every request, as goodput's are
    fast = sum(map(sla.ttft_met_by, done))
    steady = sum(map(sla.tpot_met_by, done))
    _cdf(ax[0, 0], ttft, fast, n, sla.ttft_ms / 1e3, "s", "TTFT")
    _cdf(ax[0, 1], tpot, steady, n, sla.tpot_ms, "ms", "TPOT")
    over = ax[1, 0]
    over.scatter([r.arrival_ns / 1e9 for r in done], ttft, s=6, color=_MET, label="completed")
    if failed:  # above every TTFT drawn and the SLA: a failure never looks fast
        drawn = [*ttft.tolist(), *([sla.ttft_ms / 1e3] if np.isfinite(sla.ttft_ms) else [])]
        top = 1.1 * max(drawn) if drawn and max(drawn) > 0 else 1.0
        over.scatter(
            [r.arrival_ns / 1e9 for r in failed],
            np.full(len(failed), top),
            marker="x",
            color=_MISSED,
            label=f"failed ({len(failed):,}; drawn at the top)",
        )
    if np.isfinite(sla.ttft_ms):
        over.axhline(sla.ttft_ms / 1e3, color=_MISSED, linestyle="--", label="TTFT SLA")
    over.set_xlabel("arrival (s)")
    over.set_ylabel("TTFT (s)")
    over.legend(loc="upper left")
    over.grid(alpha=0.3)
    load = ax[1, 1]
    t, prefill, decode = in_system(records)
    load.step(t, prefill, where="post", label="waiting for or in prefill")
    load.step(t, decode, where="post", label="in decode")
    load.set_xlabel("time (s)")
    load.set_ylabel("requests")
    load.legend(loc="upper left")
    load.grid(alpha=0.3)
    return fig


def capacity_figure(
    results: CapacityResult | Mapping[str, CapacityResult],
    *,
    title: str = "",
    knob: str = "rate (req/s)",
) -> Figure:
    """Mean TPOT, mean TTFT and goodput over the steady window at every rate a search tried
    (filled: met its criterion; hollow: missed it; a star: the rate found), against ``knob``
    (what the search varied: a rate, or a trace's rate scale), with what was judged: the SLA's
    bounds on the means (criterion ``"mean"``) or the goodput target (``"goodput"``). Several
    searches by name (e.g. deployments compared on one workload) share the axes."""
    from .serve.capacity import CapacityResult

    named = {"": results} if isinstance(results, CapacityResult) else dict(results)
    fig, ax = _figure(1, 3, title)
    panels = (
        (ax[0, 0], "tpot_ms", "mean TPOT (ms)"),
        (ax[0, 1], "ttft_ms", "mean TTFT (ms)"),
        (ax[0, 2], "goodput", "goodput (share of requests within the SLA)"),
    )
    for i, (name, res) in enumerate(named.items()):
        color = f"C{i}"
        points = sorted(res.points, key=lambda p: p.scale)
        scale = np.array([p.scale for p in points])
        met = np.array([p.meets for p in points], dtype=bool)
        for a, key, _ in panels:
            value = np.array([getattr(p, key) for p in points], dtype=np.float64)
            a.plot(scale, value, color=color, label=name or None, zorder=1)
            a.scatter(scale[met], value[met], color=color, zorder=2)
            a.scatter(scale[~met], value[~met], facecolors="none", edgecolors=color, zorder=2)
            if res.found is not None:
                star = [getattr(res.found, key)]
                a.scatter([res.found.scale], star, marker="*", s=160, color=color, zorder=3)
    mean = [r for r in named.values() if r.criterion == "mean"]
    bounds = (
        {r.sla.tpot_ms for r in mean},
        {r.sla.ttft_ms for r in mean},
        {r.goodput_target for r in named.values() if r.criterion == "goodput"},
    )
    for (a, key, what), limits in zip(panels, bounds, strict=True):
        for limit in sorted(x for x in limits if np.isfinite(x)):
            label = f"target {limit:.0%}" if key == "goodput" else f"SLA {limit:g} ms"
            a.axhline(limit, color="0.3", linestyle="--", label=label)
        a.set_xlabel(knob)
        a.set_ylabel(what)
        if a.get_legend_handles_labels()[1]:
            a.legend(loc="best")
        a.grid(alpha=0.3)
    ttft = [p.ttft_ms for r in named.values() for p in r.points]
    if any(np.isfinite(t) and t > 0 for t in ttft):  # (a log axis needs a positive value)
        ax[0, 1].set_yscale("log")
    return fig


def decode_figure(result: DecodeResult, *, title: str = "", attention: str = "mla") -> Figure:
    """A colocated decode run (``xds decode``): each kernel's time per iteration, Figure 20
    style (the kernels of the slowest die as the iteration charges them), and every
    iteration's time over the run (its tail shows sequences finishing; online EPLB shows as
    steps down). ``attention``: the model's family (a GQA model's projections read
    ``gqa_other``)."""
    fig, ax = _figure(1, 2, title)
    bd, n = result.breakdown, max(result.iterations, 1)
    names = list(bd.__struct_fields__)
    per_iteration = [getattr(bd, k) / n / 1e6 for k in names]
    total = sum(per_iteration) or 1.0
    kernels = ax[0, 0]
    labels = [f"{attention}_other" if k == "mla_other" else k for k in names]
    kernels.barh(labels, per_iteration, color=_MET)
    for y, ms in enumerate(per_iteration):
        kernels.text(ms, y, f" {ms:.2f} ms ({ms / total:.0%})", va="center", fontsize=8)
    kernels.invert_yaxis()  # in the breakdown's order, top down
    kernels.set_xlabel("ms per iteration")
    kernels.set_xlim(0, max(per_iteration, default=0) * 1.35 or 1)
    kernels.grid(alpha=0.3, axis="x")
    over = ax[0, 1]
    over.plot(np.arange(1, len(result.iteration_ns) + 1), np.array(result.iteration_ns) / 1e6)
    over.set_xlabel("iteration")
    over.set_ylabel("iteration time (ms)")
    over.grid(alpha=0.3)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (PNG, SVG or PDF by suffix), the same bytes every time."""
    import matplotlib

    p = check_path(path)
    kind = p.suffix.lower()
    metadata = {".png": {"Software": None}, ".svg": {"Date": None}, ".pdf": {"CreationDate": None}}
    with matplotlib.rc_context({"svg.hashsalt": "xds", "pdf.compression": 6}):
        fig.savefig(p, format=kind[1:], metadata=metadata[kind], dpi=110)
    return p
