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
    packed = np.zeros(n, dtype=np.int64)
    for r in np.argsort(arrival_ns, kind="stable"):
        start = int(arrival_ns[r]) + e.kernel_launch_ns
        pack_bytes = int(counts[r].sum()) * row_bytes
        t = fabric.mte_transfer(
            ranks[r], ranks[r], pack_bytes, start_ns=start, aivs=n_aiv, now_ns=now_ns
        )
        packed[r] = t.end_ns + int(pack_vector_ns[r])
    # metadata: the AIV owning destination d issues it after (d // n_aiv + 1) issue slots
    # (barrier[d] = max over s of meta_visible_ns(s, d, issued by s), vectorised: exact ints)
    slots = (np.arange(n, dtype=np.int64) // n_aiv + 1) * e.meta_issue_ns
    barrier = (packed[:, None] + fabric.meta_delay_ns(ranks)).max(axis=0) + slots
    # pulls: per rank, its sources spread over lanes; replay them in issue order
    end = barrier.astype(np.float64)
    heap: list[tuple[int, int, int, int]] = []  # (issue time, rank, lane, position)
    plan: dict[tuple[int, int], list[int]] = {}
    eta = np.ones(n)
    for r in range(n):
        incoming = counts[:, r]
        fan_in = int(np.count_nonzero(incoming)) - (1 if incoming[r] else 0)
        eta[r] = collective_efficiency(e, fan_in)
        for lane, peers in enumerate(pull_lanes(r, n, n_aiv, pull_order)):
            sources = [s for s in peers if incoming[s]]
            if sources:
                plan[(r, lane)] = sources
                heapq.heappush(heap, (int(barrier[r]), r, lane, 0))
    while heap:
        issue, r, lane, pos = heapq.heappop(heap)
        src = plan[(r, lane)][pos]
        rows = int(counts[src, r])
        t = fabric.mte_transfer(
            ranks[src],
            ranks[r],
            rows * row_bytes,
            start_ns=issue,
            fill=pos == 0,
            aiv_die=ranks[r],
            efficiency=float(eta[r]),
            now_ns=now_ns,
        )
        done = t.visible_ns + round(rows * per_row_ns)
        end[r] = max(end[r], done)
        if pos + 1 < len(plan[(r, lane)]):
            heapq.heappush(heap, (done, r, lane, pos + 1))
    return ExchangeTimes(packed, barrier, np.ceil(end + post_ns).astype(np.int64))
