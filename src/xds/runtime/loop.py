"""The asyncio virtual-time event loop (ARCHITECTURE.md, "Time").

:class:`VirtualTimeEventLoop` is an ``asyncio.SelectorEventLoop`` whose clock is an integer
number of nanoseconds that only moves when the loop would otherwise block: its selector never
waits, it jumps the clock to the earliest pending timer instead. Everything built on the loop's
clock (``asyncio.sleep``, anyio's ``sleep``, ``move_on_after``, ``fail_after``, deadlines of
cancel scopes) therefore runs in virtual time, as fast as the CPU allows.

Exactness: timers are ordered by ``(deadline in whole nanoseconds, arming sequence)``, so timers
due at the same nanosecond fire in the order they were armed (FIFO), independent of float
rounding or heap history. The integer clock jumps to the head timer's nanosecond and the float
clock (``time()``) to its exact deadline, so a caller comparing ``time()`` with the deadline it
armed always finds it reached.

When nothing is runnable and no timer is pending the model is deadlocked; the loop reports it to
its owner (``on_deadlock``) instead of blocking forever. With a ``time_limit_ns`` it reports
(``on_time_limit``) instead of jumping past the limit, and with a ``time_step_limit`` it reports
(``on_time_step_limit``) instead of stepping virtual time forward once more than that: each jump
of the clock to the next pending timer is one time step, however many timers fall due at that
nanosecond (``time_steps`` counts them). When the loop spins at one instant for
``livelock_limit`` iterations it reports a livelock.

Horizon: deadlines travel through asyncio (and trio) as float seconds, which resolve half a
nanosecond only below 2**22 s. Virtual time therefore stops at :data:`HORIZON_NS` (about 48.5
days) with a time-limit report rather than drifting. An infinite sleep (``anyio.sleep_forever``)
arms no timer: if nothing else can happen the model is deadlocked.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import selectors
from collections.abc import Callable
from typing import Any

_RESOLUTION_S = 0.5e-9
"""Timers due within half a nanosecond of now fire now; all deadlines are whole nanoseconds."""

HORIZON_NS = 2**22 * 1_000_000_000
"""The last exact virtual instant (2**22 s, about 48.5 days): float seconds resolve half a
nanosecond below it. A run whose next event lies beyond it stops with a time-limit report."""


_FAR_S = 2.0**23
"""Float deadlines from here on are past the horizon (kept as they are in the heap)."""


def effective_limit_ns(time_limit_ns: int | None) -> int:
    """The run's virtual-time limit: the caller's, never beyond :data:`HORIZON_NS`."""
    return HORIZON_NS if time_limit_ns is None else min(time_limit_ns, HORIZON_NS)


class _VirtualTimerHandle(asyncio.TimerHandle):
    """A timer handle ordered by (deadline in whole ns, arming sequence): FIFO among timers due
    at the same nanosecond. ``_when`` keeps the caller's exact float deadline, so code that
    compares ``loop.time()`` with its own deadline (anyio's timeouts do) sees it reached."""

    __slots__ = ("_seq", "_when_ns")

    def __lt__(self, other: _VirtualTimerHandle) -> bool:  # type: ignore[override]
        # hot: called ~10 times per timer by heapq; only ever compared with its own kind
        a, b = self._when_ns, other._when_ns
        return a < b if a != b else self._seq < other._seq


class _VirtualSelector(selectors.SelectSelector):
    """A selector that never blocks: where the real loop would wait, virtual time jumps."""

    def __init__(self, loop: VirtualTimeEventLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self._loop
        if timeout is None:
            # Nothing ready, no timer: in virtual time nothing can ever happen again.
            loop._report_deadlock()
            return []
        if timeout <= 0:
            loop._spins += 1
            if loop._spins >= loop.livelock_limit:
                loop._spins = 0
                loop._report_livelock()
            return []
        # The head timer is in the future: jump to it. The float clock moves to the timer's
        # own deadline (never back), the integer clock to its nanosecond. The float clock is
        # not snapped to that nanosecond: a float deadline rounded up would then carry its
        # rounding into the next ``time() + delay``, and the clock would drift ahead of
        # trio's, which keeps the exact float deadline (anyio.sleep(1/3) three thousand
        # times lands on 1000 s exactly on both). A cancelled head
        # (an expired timeout's timer) must not decide a time-limit report: drop those first.
        while loop._scheduled and loop._scheduled[0]._cancelled:
            heapq.heappop(loop._scheduled)._scheduled = False
            loop._timer_cancelled_count -= 1
        if not loop._scheduled:
            return []  # the loop comes back with no timer at all: a deadlock, reported then
        head = loop._scheduled[0]
        if head._when_ns > effective_limit_ns(loop.time_limit_ns):
            loop._report_time_limit()
            return []
        if head._when_ns > loop._now_ns:
            limit = loop.time_step_limit
            if limit is not None and loop.time_steps >= limit:
                loop._report_time_step_limit()
                return []
            loop.time_steps += 1
            loop._now_ns = head._when_ns
        loop._time_s = max(loop._time_s, head._when)
        loop._spins = 0
        return []


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An exception escaped a plain callback: that is a model bug, so fail the run loudly."""
    exc = context.get("exception")
    if not loop.is_running():  # reported after the run (a collected task, or shutdown)
        if not _only_exits(exc):  # a model's sys.exit or Ctrl-C ended the run as itself
            loop.default_exception_handler(context)
        return
    handler = getattr(loop, "_on_callback_error", None)
    if isinstance(exc, BaseException) and handler is not None:
        handler(exc)
    else:
        loop.default_exception_handler(context)


def _only_exits(exc: object) -> bool:
    """Whether ``exc`` is a SystemExit or KeyboardInterrupt, or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_exits(e) for e in exc.exceptions)
    return isinstance(exc, SystemExit | KeyboardInterrupt)


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """asyncio event loop on an integer-nanosecond virtual clock starting at 0."""

    def __init__(
        self,
        *,
        on_deadlock: Callable[[], None] | None = None,
        on_livelock: Callable[[int, int], None] | None = None,
        on_callback_error: Callable[[BaseException], None] | None = None,
        livelock_limit: int = 1_000_000,
        time_limit_ns: int | None = None,
        on_time_limit: Callable[[], None] | None = None,
        time_step_limit: int | None = None,
        on_time_step_limit: Callable[[], None] | None = None,
    ):
        self._now_ns = 0
        self.time_steps = 0
        """How many times virtual time has stepped forward (jumped to the next timer)."""
        self.time_step_limit = time_step_limit
        self._on_time_step_limit = on_time_step_limit
        self.time_limit_ns = time_limit_ns
        self._on_time_limit = on_time_limit
        self._time_s = 0.0
        self._spins = 0
        self._timer_seq = itertools.count()
        self.livelock_limit = livelock_limit
        self._on_deadlock = on_deadlock
        self._on_livelock = on_livelock
        super().__init__(selector=_VirtualSelector(self))
        self._clock_resolution = _RESOLUTION_S
        self._on_callback_error = on_callback_error
        self.set_exception_handler(_exception_handler)

    # -- clock -------------------------------------------------------------------------------
    @property
    def now_ns(self) -> int:
        """Virtual time in integer nanoseconds."""
        return self._now_ns

    def time(self) -> float:
        return self._time_s

    # -- timers ------------------------------------------------------------------------------
    def call_at(self, when, callback, *args, context=None):  # type: ignore[override]
        if when is None:
            raise TypeError("when cannot be None")
        if not math.isfinite(when):
            if when < 0:
                raise ValueError(f"cannot schedule a callback at {when}")
            # sleep_forever / sleep(inf): a timer that never fires; arm nothing
            self._check_closed()
            return asyncio.TimerHandle(when, callback, args, self, context)
        if when >= _FAR_S:  # beyond the horizon: due "after the limit", whatever its value
            return self._arm(when, HORIZON_NS + 1, callback, args, context)
        return self._arm(when, round(when * 1e9), callback, args, context)

    def call_at_ns(
        self, when_ns: int, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        """Schedule ``callback(*args)`` at virtual time ``when_ns`` (integer nanoseconds)."""
        if when_ns > HORIZON_NS:
            return self._arm(_FAR_S, HORIZON_NS + 1, callback, args, context)
        return self._arm(when_ns / 1e9, when_ns, callback, args, context)

    def _arm(
        self,
        when: float,
        when_ns: int,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        context: Any,
    ) -> asyncio.TimerHandle:
        self._check_closed()
        timer = _VirtualTimerHandle(when, callback, args, self, context)
        timer._when_ns = when_ns
        timer._seq = next(self._timer_seq)
        heapq.heappush(self._scheduled, timer)
        timer._scheduled = True
        return timer

    def run_in_executor(self, executor, func, *args):  # type: ignore[no-untyped-def, override]
        """Refused: a worker thread's result arrives in wall-clock time (asyncio.to_thread
        and run_in_executor; :mod:`xds.runtime.threads`)."""
        from .threads import worker_thread_refused

        raise worker_thread_refused("run_in_executor / asyncio.to_thread")

    # -- model failure reports -----------------------------------------------------------------
    def _report_deadlock(self) -> None:
        if self._on_deadlock is None:
            from xds.errors import ModelDeadlock

            raise ModelDeadlock(self._now_ns, [])
        self._on_deadlock()

    def _report_time_limit(self) -> None:
        if self._on_time_limit is None:
            from xds.errors import ModelTimeLimit

            raise ModelTimeLimit(self._now_ns, effective_limit_ns(self.time_limit_ns), [])
        self._on_time_limit()

    def _report_time_step_limit(self) -> None:
        if self._on_time_step_limit is None:
            from xds.errors import ModelTimeStepLimit

            assert self.time_step_limit is not None
            raise ModelTimeStepLimit(
                self._now_ns, self.time_step_limit, effective_limit_ns(self.time_limit_ns), []
            )
        self._on_time_step_limit()

    def _report_livelock(self) -> None:
        if self._on_livelock is None:
            from xds.errors import ModelLivelock

            raise ModelLivelock(self._now_ns, self.livelock_limit)
        self._on_livelock(self._now_ns, self.livelock_limit)
