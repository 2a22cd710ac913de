"""Timed callbacks: run a plain function at a virtual instant, without a task.

Posted writes on the fabric (data or metadata becoming visible at their completion time) are
callbacks, not tasks: one timer each. On asyncio they go straight onto the loop's timer heap
(``VirtualTimeEventLoop.call_at_ns``). Trio has no timed callbacks, so :class:`TrioTimerWheel`
keeps a heap of them, served by one trio system task that sleeps until the earliest, and the
clock runs the ones due as soon as it jumps (:meth:`TrioTimerWheel.run_due`). In both, callbacks
due at the same nanosecond run in the order they were scheduled, and callbacks due at an
instant the clock jumps to run before any task that wakes at that instant resumes (so a task
sleeping until a write's ``visible_ns`` sees the write on either backend).

A callback runs in the event loop's context: it must not block. It may set events, write
memory, and schedule further callbacks.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class TimerHandle:
    """A scheduled callback; ``cancel()`` stops it from running."""

    __slots__ = ("_wheel", "args", "callback", "cancelled", "when_ns")

    def __init__(
        self,
        when_ns: int,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        wheel: TrioTimerWheel | None = None,
    ):
        self.when_ns = when_ns
        self.callback = callback
        self.args = args
        self.cancelled = False
        self._wheel = wheel

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            if self._wheel is not None:
                self._wheel._cancelled(self)


class TrioTimerWheel:
    """Timed callbacks for the trio backend (one system task serves them all)."""

    def __init__(self, now_ns: Callable[[], int], on_error: Callable[[BaseException], None]):
        self._now_ns = now_ns
        self._on_error = on_error
        self._heap: list[tuple[int, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._scope: Any = None
        self._started = False

    def call_at_ns(self, when_ns: int, callback: Callable[..., object], *args: Any) -> TimerHandle:
        import trio

        handle = TimerHandle(when_ns, callback, args, self)
        heapq.heappush(self._heap, (when_ns, next(self._seq), handle))
        if not self._started:
            self._started = True
            trio.lowlevel.spawn_system_task(self._serve, name="<xds timers>")
        elif self._scope is not None and self._heap[0][2] is handle:
            self._scope.deadline = when_ns / 1e9  # an earlier head: wake sooner
        return handle

    def _cancelled(self, handle: TimerHandle) -> None:
        """``handle`` was cancelled: if it held the wheel's deadline, the next live timer's
        takes over (a cancelled timer must not move virtual time)."""
        if self._scope is None or not self._heap or self._heap[0][2] is not handle:
            return
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        self._scope.deadline = self._heap[0][0] / 1e9 if self._heap else math.inf

    async def _serve(self) -> None:
        import trio

        while True:
            while self._heap and self._heap[0][2].cancelled:
                heapq.heappop(self._heap)  # cancelled timers must not hold a deadline
            deadline = self._heap[0][0] / 1e9 if self._heap else math.inf
            with trio.CancelScope(deadline=deadline) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            self.run_due()

    def run_due(self) -> None:
        """Run every callback due by now, in order (the clock calls this right after it jumps,
        before the tasks woken at the new instant resume; the serving task catches the rest,
        e.g. callbacks scheduled for the current instant)."""
        now = self._now_ns()
        while self._heap and self._heap[0][0] <= now:
            _, _, handle = heapq.heappop(self._heap)
            if not handle.cancelled:
                try:
                    handle.callback(*handle.args)
                except Exception as exc:  # a model bug: fail the run, as on asyncio
                    self._on_error(exc)
        if self._scope is not None:  # the serving task sleeps until the next one
            self._scope.deadline = self._heap[0][0] / 1e9 if self._heap else math.inf
