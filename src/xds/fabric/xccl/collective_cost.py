"""The collective tier's closed form for a count-then-pull exchange (dispatch or combine).

Given every rank's arrival time and the row counts between all ranks, compute each rank's
barrier time and completion time with the same costs the protocol tier charges event by event
(:mod:`xds.fabric.xccl.ep`): kernel launch, packing through the die's HBM, the AIVs issuing one
metadata write per destination, the barrier on the last metadata, then pulls spread over the
AIVs, each at one AIV's MTE rate, sharing the source's egress (served first come, first served)
and the puller's ingress, plus the link latency and per-row vector work. One numpy pass per
collective instead of one event per block: this is what makes full-pod runs cheap.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ...hw import aiv_mte_bandwidth
from ..ub import UBFabric


class ExchangeCost(msgspec.Struct, frozen=True):
    """The cost parameters of one EP group's exchanges."""

    n_aiv: int
    launch_ns: int
    mte_startup_ns: int
    mte_op_bytes: int
    b_aiv: float
    hbm_bandwidth: float
    meta_issue_ns: int
    meta_write_ns: int
    link_bandwidth: np.ndarray  # [R, R] bytes/s between ranks (UB or NoC)
    link_latency_ns: np.ndarray  # [R, R]

    @classmethod
    def of(cls, fabric: UBFabric, ranks: list[int], n_aiv: int) -> ExchangeCost:
        pod = fabric.pod
        e = pod.engines
        die = pod.spec_of(ranks[0])
        r = len(ranks)
        bw = np.zeros((r, r))
        lat = np.zeros((r, r), dtype=np.int64)
        server = pod.server_of[ranks]
        chip = pod.chip_of[ranks]
        same_chip = (server[:, None] == server[None, :]) & (chip[:, None] == chip[None, :])
        ub, noc = pod.config.ub, pod.config.noc
        bw[:] = np.where(same_chip, noc.bandwidth, ub.bandwidth)
        lat[:] = np.where(same_chip, noc.latency_ns, ub.latency_ns)
        np.fill_diagonal(bw, die.hbm_bandwidth)
        np.fill_diagonal(lat, 0)
        return cls(
            n_aiv=n_aiv,
            launch_ns=e.kernel_launch_ns,
            mte_startup_ns=e.mte_startup_ns,
            mte_op_bytes=fabric.config.mte_chunk_bytes or 0,
            b_aiv=aiv_mte_bandwidth(e, die),
            hbm_bandwidth=die.hbm_bandwidth,
            meta_issue_ns=e.meta_issue_ns,
            meta_write_ns=e.meta_write_ns,
            link_bandwidth=bw,
            link_latency_ns=lat,
        )


def pack_end_ns(cost: ExchangeCost, start_ns: np.ndarray, pack_bytes: np.ndarray) -> np.ndarray:
    """When each rank has packed ``pack_bytes`` into its managed area (local MTE copy)."""
    rate = min(cost.n_aiv * cost.b_aiv, cost.hbm_bandwidth)
    op = np.minimum(pack_bytes, cost.mte_op_bytes)
    begin = start_ns + cost.mte_startup_ns + op * 1e9 / cost.b_aiv
    dur = np.maximum(pack_bytes * 1e9 / rate, 2 * pack_bytes * 1e9 / cost.hbm_bandwidth)
    return np.ceil(begin + dur).astype(np.int64)


def exchange_completion(
    cost: ExchangeCost,
    *,
    arrival_ns: np.ndarray,
    counts: np.ndarray,
    row_bytes: int,
    pack_vector_ns: np.ndarray,
    per_row_ns: float,
    post_ns: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(barrier time, completion time) of every rank; ``counts[s, r]`` rows go s -> r."""
    n = counts.shape[0]
    nbytes = counts.astype(np.float64) * row_bytes
    started = arrival_ns + cost.launch_ns
    packed = pack_end_ns(cost, started, nbytes.sum(axis=1)) + pack_vector_ns
    # metadata of s reaches r after the AIV that owns destination r issued it
    issue = (np.arange(n) // cost.n_aiv + 1) * cost.meta_issue_ns
    meta_delay = np.maximum(cost.meta_write_ns, cost.link_latency_ns)  # as UBFabric.meta_visible_ns
    meta_visible = packed[:, None] + issue[None, :] + meta_delay
    barrier = meta_visible.max(axis=0)

    lanes = min(cost.n_aiv, n)
    rate = np.minimum(cost.b_aiv, cost.link_bandwidth)  # one AIV per pull
    has = counts > 0
    per_pull = np.where(has, nbytes * 1e9 / rate + cost.link_latency_ns + counts * per_row_ns, 0.0)
    first_fill = np.where(
        has, cost.mte_startup_ns + np.minimum(nbytes, cost.mte_op_bytes) * 1e9 / cost.b_aiv, 0.0
    )
    # Each lane pulls its sources one after another: when would each pull be requested, and
    # when would the lane finish, if no port were shared?
    lane_end = np.zeros(n)
    requested = np.zeros((n, n))  # [s, r]: when r's lane issues its pull from s
    for lane in range(lanes):
        rows = slice(lane, n, lanes)
        lane_has = has[rows]
        first = np.argmax(lane_has, axis=0)
        fill = np.where(lane_has.any(axis=0), first_fill[rows][first, np.arange(n)], 0.0)
        before = np.cumsum(per_pull[rows], axis=0) - per_pull[rows]
        requested[rows] = barrier[None, :] + np.where(lane_has, before + fill[None, :], 0.0)
        lane_end = np.maximum(lane_end, per_pull[rows].sum(axis=0) + fill)
    end = barrier + lane_end

    # Sharing: the puller's ingress carries all it pulls; each source's egress serves the
    # pulls of all ranks first come, first served (in request order).
    bw = cost.link_bandwidth
    start = np.where(has, requested, np.inf).min(axis=0)
    start = np.where(np.isfinite(start), start, barrier)
    ingress = start + (nbytes * 1e9 / bw).sum(axis=0) + _max_latency(cost, has)
    end = np.maximum(end, ingress)
    egress_done = np.zeros((n, n))
    for src in range(n):
        pullers = np.nonzero(has[src])[0]
        if not len(pullers):
            continue
        pullers = pullers[np.argsort(requested[src, pullers], kind="stable")]
        free = 0.0
        for r in pullers:
            free = max(free, requested[src, r]) + nbytes[src, r] * 1e9 / bw[src, r]
            egress_done[src, r] = free + cost.link_latency_ns[src, r]
    end = np.maximum(end, egress_done.max(axis=0))
    end = end + post_ns
    return barrier.astype(np.int64), np.ceil(end).astype(np.int64)


def _max_latency(cost: ExchangeCost, has: np.ndarray) -> np.ndarray:
    lat = np.where(has, cost.link_latency_ns, 0)
    return lat.max(axis=0) if lat.size else np.zeros(0)
