"""Workload records and generators (SPEC 0.4 "Trace replay").

A :class:`Request` is what a trace says about one request: when it arrives (integer ns from
the start of the replay), its prompt length, its output length, and optionally the prefix-cache
block hashes of its prompt (Mooncake's ``hash_ids``). Generators build workloads xds can replay
on a machine without any trace files: fixed lengths, Poisson or Gamma arrivals, lengths from
simple distributions; all randomness from the seeded generator passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from ..config import require_positive
from ..docfields import document_fields
from ..errors import ConfigError
from ..units import S


def hash_problem(hashes: Sequence[int], input_tokens: int, block_tokens: int) -> str:
    """What is wrong with a prompt's prefix block hashes ("" if nothing): each must be >= 0,
    and there is at most one per ``block_tokens`` of its ``input_tokens`` (more would credit
    cache hits the prompts do not share). The loaders and the replay apply this one rule."""
    if any(h < 0 for h in hashes):
        return "block hashes must be >= 0"
    most = -(-input_tokens // block_tokens)
    if len(hashes) > most:
        return (
            f"{len(hashes)} block hashes for {input_tokens} input tokens: a {block_tokens}-token "
            f"block each allows at most {most}"
        )
    return ""


class Request(msgspec.Struct, frozen=True):
    request_id: int
    arrival_ns: int
    input_tokens: int
    output_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    source_line: int = 0
    """Line of the trace file the request came from (0 if generated)."""


class Workload(msgspec.Struct, frozen=True):
    """An ordered list of requests plus where they came from."""

    requests: tuple[Request, ...]
    source: str = "generated"
    dropped: tuple[tuple[int, str], ...] = ()
    """(line, reason) of input rows left out on request (``invalid="drop"``), never silently."""
    hash_block_tokens: int = 0
    """Tokens each of the requests' prefix hashes covers (Mooncake: 512); 0 when they carry
    none. A replay's prefix cache must use the same block (``prefill.prefix_block_tokens``)."""

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_ns(self) -> int:
        return self.requests[-1].arrival_ns - self.requests[0].arrival_ns if self.requests else 0

    def scaled(self, rate_scale: float) -> Workload:
        """Arrivals ``rate_scale`` times as dense (``2`` halves every inter-arrival gap)."""
        require_positive(rate_scale, "rate_scale")
        last = max((r.arrival_ns for r in self.requests), default=0)
        if last / rate_scale > 2**63 - 1:
            raise ConfigError(
                f"rate_scale {rate_scale:g} stretches the last arrival ({last} ns) beyond the "
                "int64 nanosecond clock (about 292 years)",
                field="rate_scale",
            )
        return msgspec.structs.replace(
            self,
            requests=tuple(
                msgspec.structs.replace(r, arrival_ns=round(r.arrival_ns / rate_scale))
                for r in self.requests
            ),
            source=self.source if rate_scale == 1 else f"{self.source} at {rate_scale:g}x its rate",
        )

    def _arrivals(self) -> np.ndarray:
        return np.fromiter((r.arrival_ns for r in self.requests), np.int64, len(self))

    def tied(self) -> int:
        """Requests that arrive at the same nanosecond as the request before them: a trace
        whose timestamps were quantised (the Mooncake conversation trace's ~3 s steps)."""
        return int(np.count_nonzero(np.diff(self._arrivals()) == 0))

    def spread_ties(self, rng: np.random.Generator) -> Workload:
        """Requests sharing a timestamp spread uniformly over their step: from it to the next
        distinct timestamp (the last step is as long as the median step). Arrivals stay in
        request order, as the trace's own order within a timestamp is kept. For a trace with
        quantised timestamps, whose literal replay arrives in bursts. A workload without ties,
        or whose requests all share one timestamp (no step to spread over), is returned as it
        is."""
        arrivals = self._arrivals()
        if not np.any(np.diff(arrivals) == 0):
            return self
        stamps, first, count = np.unique(arrivals, return_index=True, return_counts=True)
        if len(stamps) == 1:
            return self
        steps = np.diff(stamps)
        last = int(np.median(steps))
        widths = np.append(steps, last)
        spread = arrivals.copy()
        for t, i, n, w in zip(stamps, first, count, widths, strict=True):
            if n > 1 and w > 1:
                offsets = np.sort(rng.integers(0, int(w), int(n)))
                spread[i : i + n] = int(t) + offsets
        return msgspec.structs.replace(
            self,
            requests=tuple(
                r if r.arrival_ns == a else msgspec.structs.replace(r, arrival_ns=int(a))
                for r, a in zip(self.requests, spread.tolist(), strict=True)
            ),
            source=f"{self.source}, arrivals sharing a timestamp spread over its step (median "
            f"{_step_text(last)})",
        )

    def limited(self, limit: int | None) -> Workload:
        """The first ``limit`` requests; of :attr:`dropped`, the rows before the last of them
        (those read to get them)."""
        if limit is None:
            return self
        if limit < 0:
            raise ConfigError("limit must be >= 0", field="limit")
        if limit >= len(self.requests):
            return self
        kept = self.requests[:limit]
        read_to = max((r.source_line for r in kept), default=0)  # the rows the kept ones came from
        return msgspec.structs.replace(
            self,
            requests=kept,
            source=f"{self.source}, first {limit}",
            dropped=tuple(d for d in self.dropped if d[0] < read_to),
        )


def _build(
    arrivals: Sequence[int], inputs: Sequence[int], outputs: Sequence[int], source: str
) -> Workload:
    return Workload(
        tuple(
            Request(i, int(a), int(x), int(y))
            for i, (a, x, y) in enumerate(zip(arrivals, inputs, outputs, strict=True))
        ),
        source,
    )


def _check_counts(n: int, *lengths: int) -> None:
    if n < 0:
        raise ConfigError("n must be >= 0", field="n")
    if any(v < 1 for v in lengths):
        raise ConfigError("token lengths must be >= 1", field="length")


def fixed(
    input_tokens: int, output_tokens: int, n: int, *, rate_per_s: float | None = None
) -> Workload:
    """``n`` identical requests, all at time 0 or evenly spaced at ``rate_per_s``."""
    _check_counts(n, input_tokens, output_tokens)
    if rate_per_s is not None:
        require_positive(rate_per_s, "rate_per_s")
    gap = 0 if rate_per_s is None else round(S / rate_per_s)
    return _build(
        [i * gap for i in range(n)],
        [input_tokens] * n,
        [output_tokens] * n,
        f"fixed({input_tokens},{output_tokens},n={n})",
    )


_MAX_ARRIVAL_NS = 2**62
"""Arrival times stay well inside int64 nanoseconds (about 146 years)."""


def arrival_times(gaps_ns: np.ndarray, rate_per_s: float) -> np.ndarray:
    times = np.cumsum(gaps_ns)
    if len(times) and not times[-1] < _MAX_ARRIVAL_NS:
        raise ConfigError(
            f"rate {rate_per_s:g}/s spreads {len(times)} arrivals beyond the clock's range "
            f"(int64 nanoseconds); use a higher rate",
            field="rate_per_s",
        )
    return times.astype(np.int64)


def _step_text(step_ns: int) -> str:
    """A timestamp step as a reader says it: "3 s", "250 ms"."""
    return f"{step_ns / S:.3g} s" if step_ns >= S else f"{step_ns / 1e6:.3g} ms"


def poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    require_positive(rate_per_s, "rate_per_s")
    return arrival_times(rng.exponential(S / rate_per_s, n), rate_per_s)


CV_RANGE = (1e-3, 1e3)
"""The coefficients of variation Gamma arrivals take."""


def gamma_arrivals(rng: np.random.Generator, n: int, rate_per_s: float, cv: float) -> np.ndarray:
    """Gamma inter-arrival times with mean ``1/rate`` and coefficient of variation ``cv``
    (cv = 1 is Poisson; > 1 is bursty)."""
    require_positive(rate_per_s, "rate_per_s")
    require_positive(cv, "cv")
    if not CV_RANGE[0] <= cv <= CV_RANGE[1]:  # the Gamma shape 1/cv**2 stays a usable float
        raise ConfigError(
            f"must be in {CV_RANGE[0]:g}..{CV_RANGE[1]:g} (1 is Poisson), got {cv!r}", field="cv"
        )
    shape = 1.0 / cv**2
    return arrival_times(rng.gamma(shape, S / rate_per_s / shape, n), rate_per_s)


def synthetic(
    rng: np.random.Generator,
    n: int,
    *,
    rate_per_s: float,
    cv: float = 1.0,
    input_mean: int = 2048,
    output_mean: int = 512,
    input_max: int = 65_536,
    output_max: int = 32_768,
) -> Workload:
    """Poisson (cv = 1) or Gamma arrivals; log-normal lengths with the given means."""
    _check_counts(n, input_mean, output_mean)
    arrivals = (
        poisson_arrivals(rng, n, rate_per_s)
        if cv == 1.0
        else gamma_arrivals(rng, n, rate_per_s, cv)
    )
    sigma = 1.0

    def lengths(mean: int, cap: int) -> np.ndarray:
        mu = np.log(mean) - sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)

    return _build(
        arrivals,
        lengths(input_mean, input_max),
        lengths(output_mean, output_max),
        f"synthetic(n={n}, rate={rate_per_s}/s, cv={cv})",
    )


def with_arrivals(
    lengths: Sequence[tuple[int, int]], arrivals: np.ndarray, source: str
) -> Workload:
    """Pair (input, output) lengths with an arrival process."""
    if len(arrivals) != len(lengths):
        raise ConfigError("one arrival per request", field="arrivals")
    return _build(arrivals, [x for x, _ in lengths], [y for _, y in lengths], source)


document_fields(Request)
