"""Bandwidth ports: how concurrent transfers share a die's links (contention).

Each die has, per network, an egress and an ingress port, and one HBM port for local copies.
A transfer of ``n`` bytes occupies a port for ``n / bandwidth``. The port keeps the intervals
it is already committed to; a new transfer fills the idle time from when it can start, gap by
gap, until its bytes are carried (packets of concurrent transfers interleave on a link), so a
transfer that starts later (after a DMA start-up, say) never blocks one that can go now, and a
port never idles while a transfer waits for it: however concurrent transfers are ordered, the
port is busy until it has carried all their bytes. A transfer finishes when its slowest
constraint does: its own rate cap (``n / rate``) or the time every port it crosses has carried
its bytes. The port's throughput never exceeds its bandwidth.
"""

from __future__ import annotations

import bisect
import math

_EPS_NS = 1e-3
"""A picosecond: gaps and durations that differ by less are equal (times are float ns;
completions are rounded up to whole ns)."""


class Port:
    """One direction of one link of one die."""

    __slots__ = ("_ends", "_starts", "bandwidth", "bytes_total", "name")

    def __init__(self, name: str, bandwidth: float):
        if bandwidth <= 0:
            raise ValueError(f"port {name}: bandwidth must be positive")
        self.name = name
        self.bandwidth = bandwidth  # bytes per second
        self.bytes_total = 0
        self._starts: list[float] = []  # committed busy intervals, sorted and disjoint
        self._ends: list[float] = []

    @property
    def busy_until_ns(self) -> float:
        return self._ends[-1] if self._ends else 0.0

    def reserve(self, start_ns: float, nbytes: int, *, now_ns: float | None = None) -> float:
        """Carry ``nbytes`` in the port's idle time from ``start_ns`` on, filling every gap
        the committed intervals leave (packets of concurrent transfers interleave on a link);
        return when the last byte has been carried. Intervals that ended before ``now_ns``
        are forgotten."""
        self.bytes_total += nbytes
        remaining = nbytes * 1e9 / self.bandwidth
        starts, ends = self._starts, self._ends
        if now_ns is not None and ends and ends[0] <= now_ns:
            drop = bisect.bisect_right(ends, now_ns)
            del starts[:drop], ends[:drop]
        if remaining <= 0:
            return start_ns
        # intervals [0, i) end at or before start_ns and cannot delay this transfer; from
        # start_ns on, the transfer takes every gap before intervals i, i + 1, ... until its
        # time is used up: all of [start_ns, end] is then busy, one interval
        i = bisect.bisect_right(ends, start_ns)
        t, j, n = start_ns, i, len(starts)
        # (the comparisons below stand for max(gap, 0.0) and max(t, ends[j]), exactly: they
        # keep the first operand on a tie, and remaining stays positive here)
        while j < n:
            gap = starts[j] - t
            if gap >= remaining - _EPS_NS:  # it fits (float sums may miss by an ulp)
                break
            if gap > 0.0:
                remaining -= gap
            if ends[j] > t:
                t = ends[j]
            j += 1
        end = t + remaining
        lo, hi = (min(start_ns, starts[i]) if i < n else start_ns), end
        if j < n and starts[j] <= end + _EPS_NS:  # it filled the gap before j
            end = min(end, starts[j])
            hi = ends[j]
            j += 1
        starts[i:j] = [lo]
        ends[i:j] = [hi]
        if i > 0 and ends[i - 1] >= lo:  # touches the previous interval
            ends[i - 1] = hi
            del starts[i], ends[i]
        return end


def finish_ns(
    start_ns: float,
    nbytes: int,
    rate: float,
    ports: tuple[Port, ...],
    now_ns: float | None = None,
    efficiency: float = 1.0,
) -> int:
    """When a transfer of ``nbytes`` at most ``rate`` B/s through ``ports`` completes.

    ``efficiency`` < 1 models congestion: the ports carry the bytes as if their bandwidth were
    that fraction of it."""
    end = start_ns + nbytes * 1e9 / rate
    port_bytes = nbytes if efficiency == 1.0 else math.ceil(nbytes / efficiency)
    for port in ports:
        carried = port.reserve(start_ns, port_bytes, now_ns=now_ns)
        if carried > end:  # max(end, carried), which keeps end on a tie
            end = carried
    return math.ceil(end)
