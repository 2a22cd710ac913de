"""A replay's timeline in the Trace Event Format: open it in Perfetto (ui.perfetto.dev) or
``chrome://tracing`` to see where each request spent its time and how full each TE was.

:func:`chrome_trace` builds it from the per-request records (and optional :class:`Mark`
spans, e.g. a replay's faults and recoveries, :func:`xds.serve.timeline.replay_timeline`);
:func:`save` writes it as JSON, or gzipped JSON for a ``.json.gz`` path, the same bytes for
the same records. Tracks:

* **requests**: one slice per request, from arrival to its end, with the request's numbers
  as arguments (tokens, cached tokens, placements, TTFT, TPOT, outcome and reason), split
  into its phases: ``queued`` (arrival until the prefill step holding it started),
  ``prefill`` (until its first token), ``decode admission`` (until the Decode DP posted the
  RECV: the KV waits on the Prefill side), ``KV transfer`` (until the KV landed) and
  ``decode`` (until the last token). A failed request's slice ends where it failed (at its
  arrival if that is all that is known), with the reason; its last phase runs until then
  (``queued`` or ``prefill`` before its first token; after it ``decode admission``, or ``KV
  transfer`` once the Decode DP had posted the RECV). Requests share lanes: a request
  takes the lowest lane free at its arrival, so there are as many lanes as requests were
  ever in the system at once. A counter tracks the requests in the system.
* **prefill**: per Prefill TE, the requests queued for it and the ones in a prefill step;
* **decode**: per Decode TE, the requests awaiting admission, in KV transfer and decoding;
* **events**: the marks (faults, failovers, restarts), when given.

Times are virtual: the trace's microseconds are the replay's nanoseconds / 1000.
"""

from __future__ import annotations

import gzip
import heapq
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..errors import ConfigError
from ..outputs import check_output_path
from .metrics import RequestRecord

SUFFIXES = (".json", ".json.gz")
"""What :func:`save` writes, by the file's name."""

_REQUESTS, _PREFILL, _DECODE, _EVENTS = 1, 2, 3, 4
_PHASES = ("queued", "prefill", "decode admission", "KV transfer", "decode")


class Series(msgspec.Struct, frozen=True):
    """A counter track of the timeline: at each ``t_ns[i]`` the values ``values[k][i]`` (one
    counter per key), drawn in ``process`` (``"requests"``, ``"prefill"`` or ``"decode"``),
    e.g. a Decode TE's iteration times."""

    name: str
    process: Literal["requests", "prefill", "decode"]
    t_ns: list[int]
    values: dict[str, list[float]]


class Mark(msgspec.Struct, frozen=True):
    """Something that happened to the deployment, drawn on the events track: a span from
    ``start_ns`` to ``end_ns`` (an instant if ``end_ns`` is ``start_ns`` or -1)."""

    name: str
    start_ns: int
    end_ns: int = -1
    args: dict[str, Any] = {}


def _us(ns: int) -> float:
    return ns / 1000


def _te(placement: str) -> str:
    """The TE of a placement (``"P1/DP3x8"`` -> ``"P1"``); empty if not placed."""
    return placement.partition("/")[0]


def _bounds(r: RequestRecord) -> tuple[list[int], int]:
    """The request's phase boundaries (arrival, then the end of each phase it reached, in
    :data:`_PHASES` order) and its end. Boundaries never go backwards and never pass the end.
    A failed request's last phase runs until it failed: ``queued`` or ``prefill`` before its
    first token (by whether a step had started, ``queue_ns``), after it ``decode admission``,
    or ``KV transfer`` once the Decode DP had posted the RECV."""
    a, ft, finish = r.arrival_ns, r.first_token_ns, r.finish_ns
    if ft >= 0:
        ends = [a + r.queue_ns, ft]
        admitted = ft + r.decode_wait_ns
        if r.decode_placement or (r.outcome == "completed" and r.output_tokens > 1):
            ends += [admitted, admitted + r.kv_transfer_ns]
            if finish >= 0:
                ends.append(finish)
        elif finish > ft:  # failed before a Decode DP took it in
            if r.kv_transfer_ns or r.decode_wait_ns:  # the RECV was posted: in transfer
                ends += [admitted, finish]
            else:
                ends.append(finish)  # still waiting for admission
    elif r.queue_ns or r.prefill_placement:  # failed with a Prefill TE: queued, maybe more
        ends = [a + r.queue_ns] + ([finish] if finish > a + r.queue_ns else [])
    else:
        ends = []  # failed on arrival
    known = [a]
    for t in ends:
        known.append(max(known[-1], t))
    end = max(finish, known[-1]) if finish >= 0 else known[-1]
    return [min(t, end) for t in known], end


def _request_args(r: RequestRecord) -> dict[str, Any]:
    args: dict[str, Any] = {
        "request": r.request_id,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "cached_tokens": r.cached_tokens,
        "outcome": r.outcome,
    }
    if r.reason:
        args["reason"] = r.reason
    if r.prefill_placement:
        args["prefill"] = r.prefill_placement
    if r.decode_placement:
        args["decode"] = r.decode_placement
    if r.outcome == "completed":
        args["ttft_ms"] = round(r.ttft_ns / 1e6, 3)
        if r.output_tokens > 1:
            args["tpot_ms"] = round(r.tpot_ns / 1e6, 3)
    if r.source_line:
        args["source_line"] = r.source_line
    return args


def _meta(pid: int, name: str, sort: int, tid: int = 0, thread: str = "") -> list[dict]:
    if thread:
        return [
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}
        ]
    return [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
        {
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "name": "process_sort_index",
            "args": {"sort_index": sort},
        },
    ]


def _slice(pid: int, tid: int, start: int, end: int, name: str, cat: str, **extra) -> dict:
    """A complete ("X") event from ``start`` to ``end`` ns on thread ``tid`` of ``pid``."""
    return {
        "ph": "X", "pid": pid, "tid": tid, "ts": _us(start), "dur": _us(end - start),
        "name": name, "cat": cat, **extra,
    }  # fmt: skip


def _instant(pid: int, tid: int, at: int, name: str, cat: str, scope: str, args: dict) -> dict:
    """An instant ("i") event at ``at`` ns (``scope``: ``"t"`` thread, ``"g"`` global)."""
    return {
        "ph": "i", "s": scope, "pid": pid, "tid": tid, "ts": _us(at), "name": name,
        "cat": cat, "args": args,
    }  # fmt: skip


class _Lanes:
    """Threads of one process for slices that may overlap (X events must nest on a thread):
    each slice takes the lowest lane free at its start; a new lane's name goes to ``out``."""

    def __init__(self, pid: int, out: list[dict]):
        self.pid, self.out = pid, out
        self._free: list[int] = []  # lanes free now, lowest first
        self._busy: list[tuple[int, int]] = []  # (end, lane) of the lanes in use
        self._lanes = 0

    def take(self, start: int, end: int) -> int:
        """The thread id (from 1) for a slice from ``start`` to ``end``, taken in start order."""
        while self._busy and self._busy[0][0] <= start:
            heapq.heappush(self._free, heapq.heappop(self._busy)[1])
        if self._free:
            lane = heapq.heappop(self._free)
        else:
            lane, self._lanes = self._lanes, self._lanes + 1
            self.out += _meta(self.pid, "", 0, tid=lane + 1, thread=f"lane {lane}")
        heapq.heappush(self._busy, (end, lane))
        return lane + 1


class _Counters:
    """Counter tracks from +1/-1 changes: one sample per track and instant, with every series
    of the track as it stands after all of that instant's changes."""

    def __init__(self, pid: int):
        self.pid = pid
        self._changes: list[tuple[int, str, str, int]] = []
        self._series: dict[str, list[str]] = {}

    def track(self, name: str, series: Sequence[str]) -> None:
        self._series.setdefault(name, list(series))

    def span(self, track: str, series: str, start: int, end: int) -> None:
        if end > start:
            self._changes += [(start, track, series, 1), (end, track, series, -1)]

    def events(self) -> list[dict]:
        values = {name: dict.fromkeys(series, 0) for name, series in self._series.items()}
        out: list[dict] = []
        changes = sorted(self._changes, key=lambda c: (c[0], c[1]))
        i = 0
        while i < len(changes):
            t, track = changes[i][:2]
            while i < len(changes) and changes[i][:2] == (t, track):
                values[track][changes[i][2]] += changes[i][3]
                i += 1
            out.append(
                {
                    "ph": "C",
                    "pid": self.pid,
                    "tid": 0,
                    "name": track,
                    "ts": _us(t),
                    "args": dict(values[track]),
                }
            )
        return out


def chrome_trace(
    records: Sequence[RequestRecord],
    *,
    marks: Iterable[Mark] = (),
    series: Iterable[Series] = (),
    title: str = "",
) -> dict[str, Any]:
    """The records (one per request, any order) as a Trace Event Format object (module
    docstring): ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``,
    with ``marks`` on the events track and ``series`` as counter tracks of their own."""
    events: list[dict] = []
    events += _meta(_REQUESTS, "requests", 0)
    events += _meta(_PREFILL, "prefill", 1)
    events += _meta(_DECODE, "decode", 2)
    in_system = _Counters(_REQUESTS)
    in_system.track("requests in system", ["requests"])
    prefill, decode = _Counters(_PREFILL), _Counters(_DECODE)
    lanes = _Lanes(_REQUESTS, events)
    for i, r in enumerate(records):
        if not isinstance(r, RequestRecord):
            raise ConfigError(
                f"records[{i}] is a {type(r).__name__}, not a RequestRecord", field="records"
            )
    for r in sorted(records, key=lambda r: (r.arrival_ns, r.request_id)):
        bounds, end = _bounds(r)
        a = r.arrival_ns
        tid = lanes.take(a, end)
        failed = r.outcome != "completed"
        name = f"request {r.request_id}" + (" (failed)" if failed else "")
        events.append(_slice(_REQUESTS, tid, a, end, name, "request", args=_request_args(r)))
        for phase, start, stop in zip(_PHASES, bounds, bounds[1:], strict=False):
            if stop > start:
                events.append(_slice(_REQUESTS, tid, start, stop, phase, "phase"))
        if failed:
            events.append(
                _instant(_REQUESTS, tid, end, "failed", "request", "t", {"reason": r.reason})
            )
        in_system.span("requests in system", "requests", a, end)
        p_te, d_te = _te(r.prefill_placement), _te(r.decode_placement)
        if p_te and len(bounds) >= 2:
            prefill.track(p_te, ["queued", "prefilling"])
            prefill.span(p_te, "queued", bounds[0], bounds[1])
            if len(bounds) >= 3:
                prefill.span(p_te, "prefilling", bounds[1], bounds[2])
        if d_te and len(bounds) >= 5:
            decode.track(d_te, ["awaiting admission", "KV transfer", "decoding"])
            decode.span(d_te, "awaiting admission", bounds[2], bounds[3])
            decode.span(d_te, "KV transfer", bounds[3], bounds[4])
            if len(bounds) >= 6:
                decode.span(d_te, "decoding", bounds[4], bounds[5])
    mark_events: list[dict] = []
    mark_lanes = _Lanes(_EVENTS, mark_events)  # spans may overlap (two TEs down at once)
    for m in sorted(marks, key=lambda m: (m.start_ns, m.name)):
        if m.end_ns > m.start_ns:
            tid = mark_lanes.take(m.start_ns, m.end_ns)
            mark_events.append(
                _slice(_EVENTS, tid, m.start_ns, m.end_ns, m.name, "event", args=m.args)
            )
        else:
            mark_events.append(_instant(_EVENTS, 1, m.start_ns, m.name, "event", "g", m.args))
    if mark_events:
        events += _meta(_EVENTS, "events", 3)
        events += mark_events
    events += in_system.events() + prefill.events() + decode.events()
    pids = {"requests": _REQUESTS, "prefill": _PREFILL, "decode": _DECODE}
    for s in series:
        if s.process not in pids:
            raise ConfigError(
                f"series {s.name!r}: process must be one of {', '.join(pids)}, got {s.process!r}",
                field="series",
            )
        if any(len(v) != len(s.t_ns) for v in s.values.values()):
            raise ConfigError(
                f"series {s.name!r}: every value list needs one value per time ({len(s.t_ns)})",
                field="series",
            )
        keys = list(s.values)
        for i, t in enumerate(s.t_ns):
            events.append(
                {
                    "ph": "C",
                    "pid": pids[s.process],
                    "tid": 0,
                    "name": s.name,
                    "ts": _us(t),
                    "args": {k: s.values[k][i] for k in keys},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "xds", "title": title, "requests": len(records)},
    }


def save(trace: dict[str, Any], path: str | Path) -> Path:
    """Write ``trace`` (:func:`chrome_trace`) as JSON, gzipped for a ``.json.gz`` path: the
    same bytes for the same trace (the gzip header carries no name and no time)."""
    p = check_output_path(path, SUFFIXES, field="timeline", what="a timeline")
    data = msgspec.json.encode(trace)
    if p.name.lower().endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    p.write_bytes(data)
    return p


def check_path(path: str | Path, *, folder_made_later: bool = False) -> Path:
    """``path`` as :func:`save` can write it (checked before a run, so a long run does not end
    in a failed save); else ConfigError. ``folder_made_later``: only the suffix (the folder is
    an ``--out`` directory the run creates first)."""
    return check_output_path(
        path, SUFFIXES, field="timeline", what="a timeline", folder_made_later=folder_made_later
    )
