"""Serving metrics of a replay (SPEC 12.4): per-request records and their summary.

Every request of a workload ends as exactly one :class:`RequestRecord`: completed (with its
first-token and per-token times) or failed with a reason. The summary reports TTFT, TPOT,
inter-token latency and end-to-end latency (mean, p50, p90, p99), output tokens per second per
chip, SLA goodput (share of requests meeting both TTFT and TPOT targets; defaults TTFT < 2 s
and TPOT < 35 ms, P126) and queueing / KV-transfer times. Requests with one output token have no
decode: TPOT, decode admission wait and KV transfer are over the requests with two or more.
"""

from __future__ import annotations

import csv as csv_module
import itertools
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..errors import ConfigError

Outcome = Literal["completed", "failed"]


class RequestRecord(msgspec.Struct):
    request_id: int
    arrival_ns: int
    input_tokens: int
    output_tokens: int
    outcome: Outcome = "completed"
    reason: str = ""
    first_token_ns: int = -1
    finish_ns: int = -1
    token_ns: list[int] = []
    """Time of every output token after the first (for ITL); may be empty if not tracked."""
    prefill_placement: str = ""
    decode_placement: str = ""
    queue_ns: int = 0
    """Prefill queueing: from arrival until the prefill step holding the prompt started (for a
    request that failed before its first token, until it failed if no step had started)."""
    kv_transfer_ns: int = 0
    """From the Decode DP's RECV until the KV landed (for a request that failed with its KV
    in transfer, until it failed)."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefill prefix cache (not recomputed)."""
    decode_wait_ns: int = 0
    """Decode admission: from the first token (prefill done) until the Decode DP posted the
    RECV. The KV waits on the Prefill side meanwhile: for a Decode TE in service, for a DP
    group below its batch limit (TE-shell backpressure) and for its KV blocks (deferred
    RECV)."""
    source_line: int = 0
    """Line of the trace file the request came from (0 if generated): find it in the input
    after ``--sort``."""

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ns - self.arrival_ns

    @property
    def tpot_ns(self) -> float:
        """Mean time per output token after the first."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_ns - self.first_token_ns) / (self.output_tokens - 1)

    @property
    def e2e_ns(self) -> int:
        return self.finish_ns - self.arrival_ns


class Stat(msgspec.Struct):
    """Statistics of one metric's values (percentiles by linear interpolation); NaN where
    there are none."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float = math.nan
    count: int = 0
    """How many values (requests, or gaps for ITL) they are over."""

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Stat:
        v = np.asarray(values, dtype=np.float64)
        if not v.size:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, 0)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        return cls(float(v.mean()), float(p50), float(p90), float(p99), float(v.max()), v.size)


class SLA(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request latency targets (default: SPEC 12.4's production SLA). ``inf`` means no
    target on that metric."""

    ttft_ms: Annotated[float, Meta(gt=0)] = 2000.0
    tpot_ms: Annotated[float, Meta(gt=0)] = 35.0

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("ttft_ms", "tpot_ms"):
            if math.isnan(getattr(self, name)):
                raise ConfigError("must be a number > 0, got nan", field=name)

    def met_by(self, record: RequestRecord) -> bool:
        """A completed request's TTFT and TPOT are both under the targets (goodput counts it)."""
        return self.ttft_met_by(record) and self.tpot_met_by(record)

    def ttft_met_by(self, record: RequestRecord) -> bool:
        """A completed request's TTFT is under the target."""
        return record.ttft_ns / 1e6 < self.ttft_ms

    def tpot_met_by(self, record: RequestRecord) -> bool:
        """A completed request's TPOT is under the target (one output token: no TPOT to miss)."""
        return record.tpot_ns / 1e6 < self.tpot_ms


class DecodeStats(msgspec.Struct):
    """What the Decode TEs' iteration loops did over a PD replay (all TEs together; the means
    are weighted by iteration time). It explains a TPOT: how long an iteration took, how full
    the dies were, and how unevenly their context was spread, which lockstep charges every
    die for (each MoE layer's dispatch waits for the die with the most attention work)."""

    iterations: int
    mean_iteration_ms: float
    """Iteration time, scheduler gap and host jitter included."""
    busy: float
    """Share of the decode phase (the first request's first token to the last finish) the
    TEs spent iterating, mean over TEs: near 1 means some sequence was always decoding."""
    sequences_per_die: float
    """Sequences decoding per die in service."""
    context_max_over_mean: float
    """Context tokens on the die holding the most / the mean over the dies holding sequences,
    as each iteration was priced: 1 is perfectly even among them. The decode router balances
    KV at admission; sequences then grow and finish unevenly, and one long prompt can outweigh
    a die's other sequences. It does not see dies left empty: a router packing every sequence
    onto a few dies scores 1 here (:attr:`context_max_over_ideal` sees it). NaN (null in
    JSON) when nothing was decoded."""
    context_max_over_ideal: float = 1.0
    """Context tokens on the die holding the most / the least the busiest die could hold:
    the contexts spread evenly over every die in service, or the longest sequence if that is
    more (a sequence is not split). 1 is a perfect spread; packing sequences onto a few dies
    raises it, as it raises every iteration's time (lockstep waits for the busiest die)."""


class Summary(msgspec.Struct):
    requests: int
    completed: int
    failed: int
    failures: dict[str, int]
    """Failed requests by kind of reason (their own token counts written ``<n> tokens``)."""
    ttft_ms: Stat
    """First token - arrival, over the completed requests (as every latency here: a failed
    request's partial times are in its record, not in these statistics)."""
    tpot_ms: Stat
    """(finish - first token) / (output tokens - 1), one value per completed request with two
    or more output tokens (the mean is over requests, not tokens)."""
    itl_ms: Stat
    """Gaps between successive deliveries of tokens (:func:`inter_token_ms`), over the
    completed requests' tokens; NaN when per-token times are not kept."""
    e2e_s: Stat
    """Finish - arrival, over the completed requests."""
    queue_ms: Stat
    """Prefill queueing (:attr:`RequestRecord.queue_ns`), over the completed requests."""
    kv_transfer_ms: Stat
    """KV transfer (:attr:`RequestRecord.kv_transfer_ns`), over the requests with two or more
    output tokens (one token needs no decode, so no KV moves)."""
    decode_wait_ms: Stat
    """Decode admission wait (:attr:`RequestRecord.decode_wait_ns`)."""
    output_tokens_per_s: float
    """Output tokens of the completed requests / :attr:`duration_s` (tokens a failed request
    had streamed before it failed are not counted)."""
    output_tokens_per_s_per_chip: float
    goodput: float
    """Share of all requests (failed ones count as misses) that completed with TTFT and TPOT
    both under the :attr:`sla` (a one-token request has no TPOT to miss)."""
    sla: SLA
    duration_s: float
    """From the first arrival to the last completed request's finish (the last failure's when
    nothing completed): the span the tokens/s figures divide by, so a late failure does not
    dilute them."""
    prefill_busy: list[float] = []
    """Per Prefill TE of a PD replay, the share of the prefill phase it spent in steps."""
    prefix_hit_ratio: float = 0.0
    """Prompt tokens served from prefix caches / prompt tokens, over completed requests."""
    chips: int = 0
    """Chips of the deployment (the divisor of the per-chip throughput)."""
    deployment: str = ""
    """The deployment replayed: a preset name or the file given (``xds replay`` fills it)."""
    seed: int | None = None
    """The seed of the workload and the replay (``xds replay`` fills it)."""
    trace: str | None = None
    """The trace file or ServeGen directory replayed; None: a built-in or generated workload."""
    trace_format: str | None = None
    """The trace's format, given or guessed (``mooncake``, ``azure``, ``request-csv``,
    ``lengths``, ``servegen``)."""
    workload: str = ""
    """The workload as :attr:`Workload.source` describes it (limit and rate scale included)."""
    dropped_rows: int = 0
    """Rows of a lengths-only CSV left out on request (``--drop-invalid``) among those read."""
    decode: DecodeStats | None = None
    """The Decode TEs' iteration loops (a PD replay fills it)."""
    faults: list[str] = []
    """The faults injected, as ``--fault`` specs (``xds replay`` fills it)."""
    policies: list[str] = []
    """The policies plugged in, as ``--policy`` specs (``xds replay`` fills it)."""
    config: dict[str, Any] | None = None
    """The deployment replayed, every field resolved (``msgspec.to_builtins`` of its
    ``PDConfig``; a PD replay fills it): ``msgspec.convert(config, PDConfig)`` rebuilds it."""


def prefix_hit_ratio(records: Sequence[RequestRecord]) -> float:
    """Prompt tokens of ``records`` served from prefix caches / their prompt tokens."""
    return sum(r.cached_tokens for r in records) / max(1, sum(r.input_tokens for r in records))


def inter_token_ms(records: Sequence[RequestRecord]) -> np.ndarray:
    """The inter-token latencies of ``records`` (ms), record by record: the gaps between
    successive deliveries of tokens, each one's from its first token to its first later token
    time, then between consecutive distinct token times. Tokens delivered together (an MTP
    step's verified tokens share one time) make one gap, as a streaming client sees them and
    as vLLM's serving benchmark counts its streamed chunks; counting a 0 for each would put
    the median at 0 once acceptance is high. Computed on one array of every token time (a
    replay holds millions), with the values ``(b - a) / 1e6`` of each pair would give."""
    counts = np.fromiter((len(r.token_ns) for r in records), dtype=np.int64, count=len(records))
    times = np.fromiter(
        itertools.chain.from_iterable(r.token_ns for r in records),
        dtype=np.int64,
        count=int(counts.sum()),
    )
    before = np.empty_like(times)  # each token's predecessor: the token before it ...
    before[1:] = times[:-1]
    firsts = np.fromiter((r.first_token_ns for r in records), dtype=np.int64, count=len(records))
    some = counts > 0  # ... or, for a record's first token time, the record's first token
    before[(np.cumsum(counts) - counts)[some]] = firsts[some]
    apart = times != before  # delivered with the token before it: no gap of its own
    return (times[apart] - before[apart]) / 1e6


def summarize(records: Sequence[RequestRecord], *, chips: int, sla: SLA | None = None) -> Summary:
    """The summary of a finished replay (``chips`` for the per-chip throughput)."""
    if chips < 1:
        raise ConfigError("chips must be >= 1", field="chips")
    sla = sla or SLA()
    done = [r for r in records if r.outcome == "completed"]
    failures: dict[str, int] = {}
    for r in records:
        if r.outcome == "failed":
            kind = failure_kind(r.reason)
            failures[kind] = failures.get(kind, 0) + 1
    itl = inter_token_ms(done)
    start = min((r.arrival_ns for r in records), default=0)
    ended = done or [r for r in records if r.finish_ns >= 0]  # nothing completed: the failures
    end = max((r.finish_ns for r in ended), default=start)
    duration = max(end - start, 1) / 1e9
    tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if sla.met_by(r))
    return Summary(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        failures=failures,
        ttft_ms=Stat.of([r.ttft_ns / 1e6 for r in done]),
        tpot_ms=Stat.of([r.tpot_ns / 1e6 for r in done if r.output_tokens > 1]),
        itl_ms=Stat.of(itl),
        e2e_s=Stat.of([r.e2e_ns / 1e9 for r in done]),
        queue_ms=Stat.of([r.queue_ns / 1e6 for r in done]),
        kv_transfer_ms=Stat.of([r.kv_transfer_ns / 1e6 for r in done if r.output_tokens > 1]),
        decode_wait_ms=Stat.of([r.decode_wait_ns / 1e6 for r in done if r.output_tokens > 1]),
        output_tokens_per_s=tokens / duration,
        output_tokens_per_s_per_chip=tokens / duration / chips,
        goodput=good / len(records) if records else 0.0,
        prefix_hit_ratio=prefix_hit_ratio(done),
        sla=sla,
        duration_s=(end - start) / 1e9,
        chips=chips,
    )


def failure_kind(reason: str) -> str:
    """A failure reason with its request's own token counts (``N tokens``) replaced by
    ``<n> tokens``, so that the summary counts failures of one kind together (each record keeps
    the full reason)."""
    return re.sub(r"\b\d[\d,]* tokens\b", "<n> tokens", reason) if reason else "unknown"


def check_complete(records: Sequence[RequestRecord], n_requests: int) -> None:
    """Every request of the workload appears exactly once."""
    ids = sorted(r.request_id for r in records)
    if ids != list(range(n_requests)):
        missing = sorted(set(range(n_requests)) - set(ids))
        raise AssertionError(f"replay lost or duplicated requests (missing: {missing[:10]})")


CSV_COLUMNS = (
    "request_id",
    "source_line",
    "arrival_ns",
    "input_tokens",
    "output_tokens",
    "outcome",
    "reason",
    "first_token_ns",
    "finish_ns",
    "prefill_placement",
    "decode_placement",
    "queue_ns",
    "kv_transfer_ns",
    "cached_tokens",
    "decode_wait_ns",
)
"""The columns of ``requests.csv``: a record's fields but its per-token times."""


def write(
    out_dir: str | Path, records: Sequence[RequestRecord], summary: Summary, *, csv: bool = False
) -> None:
    """``requests.jsonl`` (one line per request), ``summary.json``, optionally
    ``requests.csv`` (without it, a ``requests.csv`` of an earlier run there is removed, so the
    directory holds one run's results). Other files are left alone."""
    enc = msgspec.json.Encoder()
    ordered = sorted(records, key=lambda r: r.request_id)
    lines = b"".join(enc.encode(r) + b"\n" for r in ordered)  # encoded before any file is
    summary_json = msgspec.json.format(enc.encode(summary))  # touched: all or nothing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").write_bytes(lines)
    (out / "summary.json").write_bytes(summary_json)
    if not csv:
        (out / "requests.csv").unlink(missing_ok=True)
        return
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv_module.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in ordered:
            writer.writerow([getattr(r, c) for c in CSV_COLUMNS])


document_fields(RequestRecord, SLA, DecodeStats, Summary)
