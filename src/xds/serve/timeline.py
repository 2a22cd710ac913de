"""A replay's timeline (:mod:`xds.trace.timeline`) with what happened to the deployment drawn
beside its requests: restarts of the world, TE failovers, scale-downs and scale-ups, memory
faults, and link probes that did not find the link healthy (``xds replay --timeline``)."""

from __future__ import annotations

from typing import Any

from ..trace.timeline import Mark, Series, chrome_trace
from .probe import LinkVerdict
from .replay import ReplayResult


def replay_marks(result: ReplayResult) -> list[Mark]:
    """The replay's faults and recoveries as spans (from the fault to the recovery, or an
    instant where the recovery never came), in time order."""
    marks: list[Mark] = []
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


def replay_timeline(result: ReplayResult, *, title: str = "") -> dict[str, Any]:
    """:func:`xds.trace.timeline.chrome_trace` of the replay's records, with its marks and
    each Decode TE's iterations."""
    return chrome_trace(
        result.records, marks=replay_marks(result), series=decode_series(result), title=title
    )
