"""The collective tier of a count-then-pull exchange (dispatch or combine).

When the last rank arrives, every rank's barrier and completion time are computed at once from
all arrival times, with the same cost functions and the same fabric ports the protocol tier uses
(:mod:`xds.fabric.xccl.ep`): kernel launch, packing through the die's HBM, the AIVs issuing one
metadata write per destination, the barrier on the last metadata, then each rank's pulls spread
over its AIVs, one after another per AIV, reserving the source's egress and the puller's ingress.
Instead of one event per block and metadata write, the pulls are replayed in issue order from a
heap: no task, no timer, and the ports see the same traffic in the same order.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from ...hw import collective_efficiency
from ..ub import UBFabric
from .moe import PullOrder, pull_lanes


class ExchangeTimes(NamedTuple):
    """Per rank of a collective-tier exchange (virtual ns)."""

    posted: np.ndarray
    """When it posts its metadata (launch and packing done)."""
    barrier: np.ndarray
    """When it has seen every rank's metadata."""
    end: np.ndarray
    """When its exchange completes."""


def exchange_completion(
    fabric: UBFabric,
    ranks: list[int],
    *,
    n_aiv: int,
    pull_order: PullOrder = "static",
    arrival_ns: np.ndarray,
    counts: np.ndarray,
    row_bytes: int,
    pack_vector_ns: np.ndarray,
    per_row_ns: float,
    post_ns: np.ndarray,
    now_ns: int,
) -> ExchangeTimes:
    """Every rank's metadata post, barrier and completion times; ``counts[s, r]`` rows go
    s -> r."""
    e = fabric.engines
    n = len(ranks)
    # launch, then pack into the own managed area (local MTE through the HBM port)
    packed = _pack(fabric, ranks, n_aiv, arrival_ns, counts, row_bytes, pack_vector_ns, now_ns)
    # metadata: the AIV owning destination d issues it after (d // n_aiv + 1) issue slots
    # (barrier[d] = max over s of meta_visible_ns(s, d, issued by s), vectorised: exact ints)
    slots = (np.arange(n, dtype=np.int64) // n_aiv + 1) * e.meta_issue_ns
    barrier = (packed[:, None] + fabric.meta_delay_ns(ranks)).max(axis=0) + slots
    end = _pull(fabric, ranks, n_aiv, pull_order, barrier, counts, row_bytes, per_row_ns, now_ns)
    return ExchangeTimes(
        packed, barrier, np.ceil(np.array(end, dtype=np.float64) + post_ns).astype(np.int64)
    )


def _pack(
    fabric: UBFabric,
    ranks: list[int],
    n_aiv: int,
    arrival_ns: np.ndarray,
    counts: np.ndarray,
    row_bytes: int,
    pack_vector_ns: np.ndarray,
    now_ns: int,
) -> np.ndarray:
    """When each rank has launched and packed its rows, in arrival order (the HBM ports are
    reserved in that order)."""
    launch_ns = fabric.engines.kernel_launch_ns
    arrival = arrival_ns.tolist()
    rows = counts.sum(axis=1).tolist()
    vector = pack_vector_ns.tolist()
    packed = np.zeros(len(ranks), dtype=np.int64)
    for r in np.argsort(arrival_ns, kind="stable").tolist():
        t = fabric.mte_transfer(
            ranks[r],
            ranks[r],
            rows[r] * row_bytes,
            start_ns=arrival[r] + launch_ns,
            aivs=n_aiv,
            now_ns=now_ns,
        )
        packed[r] = t.end_ns + vector[r]
    return packed


def _pull(
    fabric: UBFabric,
    ranks: list[int],
    n_aiv: int,
    pull_order: PullOrder,
    barrier: np.ndarray,
    counts: np.ndarray,
    row_bytes: int,
    per_row_ns: float,
    now_ns: int,
) -> list[float | int]:
    """When each rank has pulled every block for it (not yet rounded up to whole ns): per rank,
    its sources are spread over lanes, and the pulls are replayed in issue order from a heap.

    The counts and times are plain Python numbers here (``tolist``), which compare, add and
    round exactly as the numpy scalars did, without their per-element cost."""
    n = len(ranks)
    into = counts.T.tolist()  # into[r][s]: rows s -> r
    starts = barrier.tolist()
    end: list[float | int] = [float(t) for t in starts]
    # A lane is (rank, lane index), numbered r * width + lane: heap entries order by (issue
    # time, rank, lane) as the tuples (issue, r, lane, position) would (a lane has one entry
    # at a time), but as the one integer issue * n_lanes + number, cheaper to compare.
    width = min(n_aiv, n)
    n_lanes = n * width
    lane_sources: list[list[int]] = [[] for _ in range(n_lanes)]
    lane_pos = [0] * n_lanes
    eta = [1.0] * n
    static = pull_lanes(0, n, n_aiv, pull_order) if pull_order == "static" else None
    heap: list[int] = []
    for r in range(n):
        incoming = into[r]
        fan_in = n - incoming.count(0) - (1 if incoming[r] else 0)
        eta[r] = collective_efficiency(fabric.engines, fan_in)
        lanes = static if static is not None else pull_lanes(r, n, n_aiv, pull_order)
        for lane, peers in enumerate(lanes):
            sources = [s for s in peers if incoming[s]]
            if sources:
                number = r * width + lane
                lane_sources[number] = sources
                heap.append(starts[r] * n_lanes + number)
    heapq.heapify(heap)
    mte_transfer = fabric.mte_transfer
    while heap:
        issue, number = divmod(heapq.heappop(heap), n_lanes)
        r = number // width
        sources, pos = lane_sources[number], lane_pos[number]
        src = sources[pos]
        rows = into[r][src]
        t = mte_transfer(
            ranks[src],
            ranks[r],
            rows * row_bytes,
            start_ns=issue,
            fill=pos == 0,
            aiv_die=ranks[r],
            efficiency=eta[r],
            now_ns=now_ns,
        )
        done = t.visible_ns + round(rows * per_row_ns)
        if done > end[r]:  # max(end[r], done), which keeps end[r] on a tie
            end[r] = done
        if pos + 1 < len(sources):
            lane_pos[number] = pos + 1
            heapq.heappush(heap, done * n_lanes + number)
    return end
