"""A replay's timeline (:mod:`xds.trace.timeline`) with what happened to the deployment drawn
beside its requests: the node and DistFlow faults as they struck (when given), restarts of
the world, TE failovers, scale-downs and scale-ups (from their detection), memory faults, and
link probes that did not find the link healthy (``xds replay --timeline``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..trace.timeline import Mark, Series, chrome_trace
from .probe import LinkVerdict
from .recovery import NodeFault
from .replay import DistFlowFault, ReplayResult


def _struck(result: ReplayResult, faults: Sequence[object]) -> list[Mark]:
    """The node and DistFlow faults that struck, as instants at the time they did (the
    recoveries below start at their detection)."""
    marks = []
    for f in faults:
        if any(f is u for u in result.unfired_faults):
            continue
        if isinstance(f, NodeFault):
            marks.append(Mark(f"node fault: server {f.server}", f.at_ns, -1, {}))
        elif isinstance(f, DistFlowFault):
            pair = f"P{f.prefill_te}-D{f.decode_te}"
            end = f.at_ns + f.duration_ns if f.duration_ns else -1
            marks.append(Mark(f"{f.kind.replace('_', ' ')} {pair}", f.at_ns, end, {}))
    return marks


def replay_marks(result: ReplayResult, faults: Sequence[object] = ()) -> list[Mark]:
    """The replay's faults and recoveries as spans (from the fault to the recovery, or an
    instant where the recovery never came), in time order; ``faults`` (the replay's) adds
    the node and DistFlow faults at the time they struck."""
    marks: list[Mark] = _struck(result, faults)
    for r in result.restarts:
        up = max(r.decode_up_ns, r.prefill_up_ns)
        marks.append(
            Mark(
                "restart the world",
                r.started_ns,
                up if min(r.decode_up_ns, r.prefill_up_ns) >= 0 else -1,
                {"reason": r.reason, "failed": r.failed, "attempts": r.attempts},
            )
        )
    for f in result.failovers:
        args: dict[str, Any] = {"te": f.te, "reason": f.reason, "failed": f.failed}
        if f.servers:
            args["servers"] = list(f.servers)
        name = {"restart": "failover", "scale_down": "scale-down", "scale_up": "scale-up"}[f.kind]
        marks.append(Mark(f"{name} {f.te}", f.down_ns, f.back_ns, args))
    for m in result.kv_masks:
        args = {"first_block": m.first_block, "blocks": m.blocks, "failed": m.failed}
        if m.skipped:
            args["skipped"] = m.skipped
        marks.append(Mark(f"memory fault {m.te}/DP{m.dp}", m.at_ns, -1, args))
    for p in result.probes:
        if p.verdict is not LinkVerdict.HEALTHY:
            marks.append(
                Mark(
                    f"probe {p.pair}: {p.verdict.value}",
                    p.sent_ns,
                    -1,
                    {"latency_ns": p.latency_ns, "queued_ns": p.queued_ns},
                )
            )
    marks.sort(key=lambda m: (m.start_ns, m.name))
    return marks


def decode_series(result: ReplayResult) -> list[Series]:
    """Per Decode TE, each iteration's time (ms, scheduler gap and jitter included) and the
    sequences it decoded, at the iteration's start."""
    return [
        Series(
            f"{log.te} iteration",
            "decode",
            log.start_ns,
            {"ms": [t / 1e6 for t in log.time_ns], "sequences": log.sequences},
        )
        for log in result.decode_iterations_log
    ]


def replay_timeline(
    result: ReplayResult, *, title: str = "", faults: Sequence[object] = ()
) -> dict[str, Any]:
    """:func:`xds.trace.timeline.chrome_trace` of the replay's records, with its marks (and
    ``faults``, the replay's, where they struck) and each Decode TE's iterations."""
    return chrome_trace(
        result.records,
        marks=replay_marks(result, faults),
        series=decode_series(result),
        title=title,
    )
