"""Host-side jitter sources of a DP group and their mitigations (SPEC 6.5, P060-P064).

Every decode iteration, each DP group's executor may be delayed before it reaches the first
dispatch (the first all-die synchronisation), which absorbs the spread: a slow DP makes every
DP wait. Three sources, each a switch with its paper mitigation:

* **GC pauses.** Automatic Python GC triggers at random forward passes and pauses the executor
  (``gc_pause_ns``). Mitigation (P064): manual GC every ``gc_every_n`` passes *between* passes,
  so no pause overlaps a forward pass.
* **CPU scheduling noise.** Without core pinning the executor is preempted now and then
  (exponential delays); pinning (P062) leaves a small residual.
* **Graph guard checks.** Without the graph cache each launch runs guard checks
  (``guard_ns``) and occasionally recompiles; the PTA cache (P063) skips both.

Defaults are [emulator choice] (SPEC App. B: GC every 300 passes, 20 ms pause; jitter off).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..units import MS, US


class JitterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = False
    manual_gc: bool = True
    core_pinning: bool = True
    graph_cache: bool = True
    gc_every_n: Annotated[int, Meta(ge=1)] = 300
    gc_pause_ns: Annotated[int, Meta(ge=0)] = 20 * MS
    auto_gc_probability: Annotated[float, Meta(ge=0, le=1)] = 1 / 300
    """Per forward pass, when GC is automatic (same mean rate as manual GC)."""
    preempt_probability: Annotated[float, Meta(ge=0, le=1)] = 0.02
    preempt_mean_ns: Annotated[int, Meta(ge=0)] = 2 * MS
    pinned_noise_mean_ns: Annotated[int, Meta(ge=0)] = 20 * US
    guard_ns: Annotated[int, Meta(ge=0)] = 300 * US
    recompile_probability: Annotated[float, Meta(ge=0, le=1)] = 0.001
    recompile_ns: Annotated[int, Meta(ge=0)] = 150 * MS

    def __post_init__(self) -> None:
        check_fields(self)


class IterationJitter(msgspec.Struct, frozen=True):
    """Delays of one DP group in one iteration."""

    before_dispatch_ns: int
    """Added to the DP's path to its first dispatch (inside the forward pass)."""
    between_passes_ns: int
    """Spent after the pass, before the next one (manual GC): never inside a pass."""


def sample(config: JitterConfig, rng: np.random.Generator, iteration: int) -> IterationJitter:
    """This DP's jitter in ``iteration`` (draws from the DP's own seeded stream)."""
    if not config.enabled:
        return IterationJitter(0, 0)
    inside = 0
    between = 0
    if config.manual_gc:
        if (iteration + 1) % config.gc_every_n == 0:
            between += config.gc_pause_ns
    elif rng.random() < config.auto_gc_probability:
        inside += config.gc_pause_ns
    if config.core_pinning:
        inside += int(rng.exponential(config.pinned_noise_mean_ns))
    elif rng.random() < config.preempt_probability:
        inside += int(rng.exponential(config.preempt_mean_ns))
    if not config.graph_cache:
        inside += config.guard_ns
        if rng.random() < config.recompile_probability:
            inside += config.recompile_ns
    return IterationJitter(inside, between)


def sample_dps(
    config: JitterConfig, rng: np.random.Generator, iteration: int, dps: int
) -> tuple[np.ndarray, int]:
    """:func:`sample` for ``dps`` DP groups at once, from one stream (a PD replay's Decode TE):
    each DP's delay before its first dispatch, and the longest between-pass pause."""
    inside = np.zeros(dps, dtype=np.int64)
    if not config.enabled:
        return inside, 0
    between = 0
    if config.manual_gc:
        if (iteration + 1) % config.gc_every_n == 0:
            between = config.gc_pause_ns
    else:
        inside += (rng.random(dps) < config.auto_gc_probability) * config.gc_pause_ns
    if config.core_pinning:
        inside += rng.exponential(config.pinned_noise_mean_ns, dps).astype(np.int64)
    else:
        hit = rng.random(dps) < config.preempt_probability
        inside += (hit * rng.exponential(config.preempt_mean_ns, dps)).astype(np.int64)
    if not config.graph_cache:
        inside += config.guard_ns
        inside += (rng.random(dps) < config.recompile_probability) * config.recompile_ns
    return inside, between


document_fields(JitterConfig)
