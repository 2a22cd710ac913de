"""Load collection (SPEC 7.2): per-layer expert counts, aggregated per DP, reported per window.

After gating, every MoE layer counts the tokens each die sends to each expert. A DP group's
executors sum their counts; every ``window_ns`` (default one simulated minute, P068) each DP
sends one report to the TE-shell, which sums them. The report costs one host message of
``layers x experts x 4`` bytes over the VPC network.
"""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...hw import CloudMatrix384
from ...units import S


class LoadCollector:
    def __init__(self, layers: int, experts: int, n_dp: int, *, window_ns: int = 60 * S):
        self.layers, self.experts, self.n_dp = layers, experts, n_dp
        self.window_ns = window_ns
        self._dp_counts = np.zeros((n_dp, layers, experts), dtype=np.int64)
        self.reports: list[np.ndarray] = []  # the TE-shell's aggregated windows

    def record(self, dp: int, layer: int, topk_idx: np.ndarray) -> None:
        """The Collect kernel: count one pass's routed (token, expert) pairs."""
        ids = np.asarray(topk_idx)[np.asarray(topk_idx) >= 0]
        if ids.size and ids.max() >= self.experts:
            raise ConfigError(
                f"expert id {int(ids.max())} out of range 0..{self.experts - 1}", field="topk_idx"
            )
        if not (0 <= dp < self.n_dp and 0 <= layer < self.layers):
            raise ConfigError(f"dp {dp} / layer {layer} out of range", field="dp")
        self._dp_counts[dp, layer] += np.bincount(ids, minlength=self.experts)

    def report_cost_ns(self, pod: CloudMatrix384) -> int:
        """One DP's report: ``layers x experts`` int32 counts over VPC."""
        link = pod.config.vpc
        return link.latency_ns + round(self.layers * self.experts * 4 / link.bandwidth * 1e9)

    def window_due(self, now_ns: int, last_report_ns: int) -> bool:
        """Whether the reporting window that started at ``last_report_ns`` has ended."""
        return now_ns - last_report_ns >= self.window_ns

    def close_window(self) -> np.ndarray:
        """Every DP reports; the TE-shell sums them (one report per DP per window; the caller
        decides when, e.g. with :meth:`window_due`)."""
        total = self._dp_counts.sum(axis=0)
        self.reports.append(total)
        self._dp_counts[:] = 0
        return total
