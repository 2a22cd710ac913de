"""Bandwidth ports: how concurrent transfers share a die's links (contention).

Each die has, per network, an egress and an ingress port, and one HBM port for local copies.
A port is a fluid FIFO server: a transfer of ``n`` bytes issued at ``t`` occupies the port for
``n / bandwidth`` starting when the port's earlier work drains. A transfer finishes when its
slowest constraint does: its own rate cap (``n / rate``) or the drain time of every port it
crosses. Concurrent flows whose rates sum below a port's bandwidth do not slow each other; above
it they share it, and the port's throughput never exceeds its bandwidth.
"""

from __future__ import annotations

import math


class Port:
    """One direction of one link of one die."""

    __slots__ = ("bandwidth", "busy_until_ns", "bytes_total", "name")

    def __init__(self, name: str, bandwidth: float):
        if bandwidth <= 0:
            raise ValueError(f"port {name}: bandwidth must be positive")
        self.name = name
        self.bandwidth = bandwidth  # bytes per second
        self.busy_until_ns = 0.0
        self.bytes_total = 0

    def reserve(self, start_ns: float, nbytes: int) -> float:
        """Queue ``nbytes`` from ``start_ns``; return when this port has carried them."""
        begin = max(start_ns, self.busy_until_ns)
        self.busy_until_ns = begin + nbytes * 1e9 / self.bandwidth
        self.bytes_total += nbytes
        return self.busy_until_ns


def finish_ns(start_ns: float, nbytes: int, rate: float, ports: tuple[Port, ...]) -> int:
    """When a transfer of ``nbytes`` at most ``rate`` B/s through ``ports`` completes."""
    end = start_ns + nbytes * 1e9 / rate
    for port in ports:
        end = max(end, port.reserve(start_ns, nbytes))
    return math.ceil(end)
