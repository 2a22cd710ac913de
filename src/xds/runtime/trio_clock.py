"""Trio's virtual clock for xds: ``MockClock(autojump_threshold=0)`` plus deadlock detection.

Trio is xds's verification backend (ARCHITECTURE.md, "Time"). With ``autojump_threshold=0`` the
mock clock jumps to the next deadline as soon as every task is blocked. If there is no next
deadline the stock clock would spin forever; the clock made here reports a model deadlock
instead. ``MockClock`` cannot be subclassed, so the two behaviours are set on the instance
(``_autojump`` is the hook trio's run loop calls when it is idle; trio is pinned for this).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio
from trio.testing import MockClock

from .loop import effective_limit_ns


def virtual_mock_clock(
    on_deadlock: Callable[[], None],
    time_limit_ns: int | None = None,
    on_time_limit: Callable[[], None] | None = None,
    time_step_limit: int | None = None,
    on_time_step_limit: Callable[[], None] | None = None,
    on_jump: Callable[[], None] | None = None,
) -> MockClock:
    """A ``MockClock(rate=0, autojump_threshold=0)`` that reports deadlocks to ``on_deadlock``
    and, instead of jumping past ``time_limit_ns``, calls ``on_time_limit``. It counts its
    jumps (time steps, ``clock._xds_steps``) and, instead of jumping once more than
    ``time_step_limit``, calls ``on_time_step_limit``. ``on_jump`` runs right after each jump,
    before any task woken at the new instant resumes (the timed callbacks due then)."""
    clock = MockClock(rate=0.0, autojump_threshold=0)
    clock._xds_stop = None  # type: ignore[attr-defined]
    clock._xds_steps = 0  # type: ignore[attr-defined]

    def current_time() -> float:
        # A failure that must end the run (a livelock that survived cancellation): raised in
        # trio's run loop, which reads the clock every iteration.
        if clock._xds_stop is not None:  # type: ignore[attr-defined]
            raise clock._xds_stop  # type: ignore[attr-defined]
        # rate is 0: virtual time is exactly the accumulated jumps (skip the wall-clock read).
        return clock._virtual_base

    def autojump() -> None:  # trio's run loop calls this when every task is blocked
        statistics = trio.lowlevel.current_statistics()
        jump = statistics.seconds_to_next_deadline
        if jump == math.inf:
            if statistics.tasks_runnable == 0:
                on_deadlock()
        elif jump > 0:
            limit = effective_limit_ns(time_limit_ns)
            if (clock._virtual_base + jump) * 1e9 >= limit + 0.5:  # float: jump may be huge
                if on_time_limit is not None:
                    on_time_limit()
                return
            base = clock._virtual_base
            if round((base + jump) * 1e9) > round(base * 1e9):  # a step of the ns clock (float
                # deadlines can sit a fraction of a ns apart: asyncio's int clock sees one step)
                steps: int = clock._xds_steps  # type: ignore[attr-defined]
                if time_step_limit is not None and steps >= time_step_limit:
                    if on_time_step_limit is not None:
                        on_time_step_limit()
                    return
                clock._xds_steps = steps + 1  # type: ignore[attr-defined]
            clock.jump(jump)
            if on_jump is not None:
                on_jump()

    clock.current_time = current_time  # type: ignore[method-assign]
    clock._autojump = autojump  # type: ignore[method-assign]
    return clock


class LivelockInstrument(trio.abc.Instrument):
    """Counts trio run-loop iterations that find runnable tasks without virtual time moving;
    at ``limit`` of them in a row it calls ``on_livelock(t_ns, limit)`` (the asyncio loop's
    livelock check, for trio)."""

    def __init__(self, clock: MockClock, limit: int, on_livelock: Callable[[int, int], None]):
        self.clock = clock
        self.limit = limit
        self.on_livelock = on_livelock
        self._spins = 0
        self._at = -1.0

    def before_io_wait(self, timeout: float) -> None:
        now = self.clock._virtual_base
        if timeout > 0 or now != self._at:
            self._spins = 0
            self._at = now
            return
        self._spins += 1
        if self._spins >= self.limit:
            self._spins = 0
            self.on_livelock(round(now * 1e9), self.limit)
