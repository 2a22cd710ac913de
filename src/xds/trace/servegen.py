"""Workloads sampled from ServeGen's client-pool characterisation of production traffic.

ServeGen (Xiang et al., arXiv:2505.09999; github.com/alibaba/ServeGen, Apache-2.0 data)
publishes, for one day of DeepSeek-R1 traffic on Alibaba Cloud Model Studio, a per-client
statistical summary rather than a request log: for each client ``i``

* ``chunk-<i>-trace.csv`` (no header, one row per 600 s window of the day): window start (s),
  the client's mean request rate (req/s), the inter-arrival coefficient of variation, the
  fitted inter-arrival family (``Gamma``, ``Weibull``, or empty when idle) and its (shape,
  scale);
* ``chunk-<i>-dataset.json``: per 6 h window (keys ``"0"``, ``"21600"``, ...), empirical
  distributions ``{value: probability}`` of ``input_tokens``, ``output_tokens`` (reasoning +
  answer) and ``reason_ratio``, each written as a Python dict literal.

:func:`load_servegen` turns a span of that day into requests, client by client and window by
window: inter-arrival gaps are drawn from the fitted family's shape (which sets their
coefficient of variation) and rescaled so their mean is 1 / the window's rate; each request's
input and output lengths are drawn from the client's distributions for its 6 h window. Every
client has its own random stream (seeded from ``seed`` and its number), so choosing other
clients does not change a client's requests. The logic follows ServeGen's description of its
generator; the code is xds's own.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import re
from pathlib import Path

import numpy as np

from ..config import is_integer, require_int
from ..errors import ConfigError, TraceError
from .loaders import MAX_TOKENS
from .workload import Request, Workload

WINDOW_S = 600
"""Rate windows of the trace files."""
LENGTH_WINDOW_S = 21_600
"""Length-distribution windows of the dataset files."""
_TRACE = re.compile(r"chunk-(\d+)-trace\.csv")


def servegen_clients(path: str | Path) -> list[int]:
    """The client numbers of a ServeGen directory (those with a trace file), ascending."""
    p = Path(path)
    if not p.is_dir():
        raise TraceError("not a directory of ServeGen chunk-<i>-trace.csv files", path=str(p))
    found = sorted(int(m[1]) for f in p.iterdir() if (m := _TRACE.fullmatch(f.name)))
    if not found:
        raise TraceError("no chunk-<i>-trace.csv files here (not a ServeGen pool)", path=str(p))
    return found


def load_servegen(
    path: str | Path,
    *,
    start_s: float = 0.0,
    duration_s: float = 600.0,
    seed: int = 0,
    clients: list[int] | None = None,
) -> Workload:
    """Requests of the clients in ``path`` (default: all) arriving in ``[start_s, start_s +
    duration_s)`` of ServeGen's day, with arrival times relative to ``start_s``."""
    for name, value in (("start_s", start_s), ("duration_s", duration_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ConfigError(f"must be a number of seconds, got {value!r:.40}", field=name)
    if not (0 <= start_s < 86_400 and duration_s > 0 and start_s + duration_s <= 86_400):
        raise TraceError(
            f"the span [{start_s:g}, {start_s + duration_s:g}) s must lie within the day "
            "[0, 86400) s with a positive duration",
            field="start_s/duration_s",
        )
    seed = require_int(seed, "seed")
    if clients is not None and (
        not isinstance(clients, (list, tuple, np.ndarray))
        or not all(is_integer(c) for c in clients)
    ):
        raise ConfigError(f"must be a list of client numbers, got {clients!r:.40}", field="clients")
    p = Path(path)
    available = servegen_clients(p)
    chosen = available if clients is None else [int(c) for c in clients]
    missing = sorted(set(chosen) - set(available))
    if missing:
        raise TraceError(f"no trace files for clients {missing[:10]}", path=str(p), field="clients")
    end_s = start_s + duration_s
    rows: list[tuple[int, int, int]] = []
    for client in sorted(set(chosen)):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E6E, client]))
        lengths = _Lengths(p / f"chunk-{client}-dataset.json")
        trace = p / f"chunk-{client}-trace.csv"
        for line, t0, rate, family, shape, scale in _windows(trace):
            if rate <= 0 or t0 + WINDOW_S <= start_s or t0 >= end_s:
                continue
            for t in _arrivals(rng, t0, rate, family, shape, scale, where=(trace, line)):
                if start_s <= t < end_s:
                    x, y = lengths.draw(rng, t)
                    rows.append((round((t - start_s) * 1e9), x, y))
    rows.sort()
    if not rows:
        raise TraceError(
            f"no requests in [{start_s:g}, {end_s:g}) s for the chosen clients", path=str(p)
        )
    return Workload(
        tuple(Request(i, a, x, y) for i, (a, x, y) in enumerate(rows)),
        f"servegen({p.name}, {start_s:g}-{end_s:g} s)",
    )


def _windows(path: Path) -> list[tuple[int, float, float, str, float, float]]:
    """(line, start, rate, family, shape, scale) of every window of a client's trace file: one
    row per 600 s window, in order, each starting on a multiple of 600 s."""
    out: list[tuple[int, float, float, str, float, float]] = []
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise TraceError("not UTF-8 text", path=str(path), line=line) from None
    for line, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row:
            continue
        if len(row) != 6:
            raise TraceError(f"expected 6 fields, got {len(row)}", path=str(path), line=line)
        family = row[3].strip()
        if family not in ("", "Gamma", "Weibull"):
            raise TraceError(
                f"unknown inter-arrival family {family!r} (Gamma, Weibull or empty)",
                path=str(path),
                line=line,
                field="family",
            )
        values = []
        for name, raw in zip(
            ("start", "rate", "cv", "shape", "scale"), row[:3] + row[4:], strict=True
        ):
            try:
                if "_" in raw:  # float() takes 1_0; a trace's number does not
                    raise ValueError(raw)
                v = float(raw or 0)
            except ValueError:
                raise TraceError(
                    f"not a number: {raw!r}", path=str(path), line=line, field=name
                ) from None
            if not math.isfinite(v) or v < 0:
                raise TraceError(
                    f"must be a finite number >= 0, got {raw!r}",
                    path=str(path),
                    line=line,
                    field=name,
                )
            values.append(v)
        start, rate, _cv, shape, scale = values
        if rate > 0 and (not family or shape <= 0 or scale <= 0):
            raise TraceError(
                "an active window needs a family and a positive shape and scale",
                path=str(path),
                line=line,
            )
        if start % WINDOW_S:
            raise TraceError(
                f"a window starts on a multiple of {WINDOW_S} s, got {start:g}",
                path=str(path),
                line=line,
                field="start",
            )
        if out and start <= out[-1][1]:
            raise TraceError(
                f"window {start:g} s is not after the previous row's ({out[-1][1]:g} s): one "
                "row per window, in order",
                path=str(path),
                line=line,
                field="start",
            )
        out.append((line, start, rate, family, shape, scale))
    return out


def _arrivals(
    rng: np.random.Generator,
    t0: float,
    rate: float,
    family: str,
    shape: float,
    scale: float,
    *,
    where: tuple[Path, int],
) -> list[float]:
    """Arrival times in ``[t0, t0 + WINDOW_S)``: gaps of the fitted family rescaled to mean
    ``1 / rate`` (the family's shape fixes their coefficient of variation). A fit whose gaps
    have no finite mean, or do not move time on (they underflow to 0), is a TraceError naming
    the row (``where``: file and line)."""

    def bad(why: str) -> TraceError:
        return TraceError(
            f"the {family} fit (shape {shape:g}, scale {scale:g}) {why}",
            path=str(where[0]),
            line=where[1],
            field="shape",
        )

    try:
        mean = shape * scale if family == "Gamma" else scale * math.gamma(1 + 1 / shape)
    except OverflowError:
        mean = math.inf
    stretch = 1.0 / (rate * mean) if mean > 0 else math.inf
    if not (math.isfinite(mean) and 0 < stretch < math.inf):
        raise bad("has no finite, positive mean gap")

    def gaps(n: int) -> np.ndarray:
        if family == "Gamma":
            return rng.gamma(shape, scale, n)
        return scale * rng.weibull(shape, n)

    times: list[float] = []
    t = t0
    expected = rate * WINDOW_S
    batch = max(16, int(2 * expected))
    most = 100 * expected + 10_000  # far beyond any real window's count
    while True:
        for gap in gaps(batch):
            t += float(gap) * stretch
            if t >= t0 + WINDOW_S:
                return times
            times.append(t)
        if len(times) > most:
            raise bad(
                f"gives over {len(times):,} arrivals in a {WINDOW_S} s window at "
                f"{rate:g} req/s: its gaps do not move time on"
            )


def _cdf(probs: np.ndarray) -> np.ndarray:
    """The CDF ``Generator.choice`` searches for ``p=probs``: the cumulative sum over its last
    value (so the draws are bit for bit those of ``choice``)."""
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return cdf


def _number(x: object) -> bool:
    """A plain int or float (``True`` is not a length or a probability)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Lengths:
    """A client's input and output length distributions per 6 h window (parsed on first use)."""

    def __init__(self, path: Path):
        self.path = path
        self._windows: dict[str, tuple[np.ndarray, ...]] | None = None

    def draw(self, rng: np.random.Generator, t: float) -> tuple[int, int]:
        if self._windows is None:
            self._windows = self._parse()
        key = str(int(t // LENGTH_WINDOW_S) * LENGTH_WINDOW_S)
        dists = self._windows.get(key)
        if dists is None:
            raise TraceError(
                f"no length distributions for the window starting at {key} s, where the trace "
                "file has requests",
                path=str(self.path),
                field=key,
            )
        xv, xcdf, yv, ycdf = dists
        # what rng.choice(values, p=probs) draws (one uniform, searched in the normalised
        # CDF), without re-checking the probabilities and summing them on every draw
        x = xv[xcdf.searchsorted(rng.random(), side="right")]
        return int(x), int(yv[ycdf.searchsorted(rng.random(), side="right")])

    def _parse(self) -> dict[str, tuple[np.ndarray, ...]]:
        if not self.path.is_file():
            raise TraceError(
                "file not found (each trace file needs its dataset)", path=str(self.path)
            )
        try:
            data = json.loads(self.path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TraceError(f"not a JSON object ({exc})", path=str(self.path)) from None
        if not isinstance(data, dict):
            raise TraceError("expected a JSON object of 6 h windows", path=str(self.path))
        out = {}
        for key, fields in data.items():
            if not isinstance(fields, dict):
                raise TraceError("expected an object of fields", path=str(self.path), field=key)
            pmfs = [self._pmf(fields, key, name) for name in ("input_tokens", "output_tokens")]
            if all(v.size for v, _ in pmfs):
                (xv, xp), (yv, yp) = pmfs
                out[key] = (xv, _cdf(xp), yv, _cdf(yp))
        return out

    def _pmf(self, fields: dict, key: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``fields[name]``, a dict literal ``{length: probability}``, as (values, probs)."""
        where = f"{key}.{name}"
        try:
            pmf = ast.literal_eval(fields.get(name, "{}"))
        except (ValueError, SyntaxError, TypeError):
            raise TraceError("not a dict literal", path=str(self.path), field=where) from None
        if not isinstance(pmf, dict) or not all(
            _number(v) and _number(q) and 0 <= q <= 1 for v, q in pmf.items()
        ):
            raise TraceError(
                "expected {length: probability in 0..1}", path=str(self.path), field=where
            )
        if not pmf:
            return np.zeros(0, np.int64), np.zeros(0)
        for v in pmf:
            if not (1 <= v <= MAX_TOKENS and v == int(v)):  # (inf, nan and huge ints fail)
                raise TraceError(
                    f"lengths are whole token counts in 1..{MAX_TOKENS:,}, got {v!r}",
                    path=str(self.path),
                    field=where,
                )
        values = np.array(sorted(pmf), dtype=np.int64)
        probs = np.array([pmf[v] for v in sorted(pmf)], dtype=np.float64)
        if abs(probs.sum() - 1.0) > 1e-6:
            raise TraceError(
                f"probabilities sum to {probs.sum():g}, not 1", path=str(self.path), field=where
            )
        return values, probs / probs.sum()  # (exactly 1 for numpy's choice)
