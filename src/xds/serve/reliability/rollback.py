"""Token recomputation after transient network errors (SPEC 11.2 stage 3, 11.3 "Rollback").

The pieces, named as in P120:

* :class:`RollbackCoordinator` is the dedicated broadcast thread. An executor whose collective
  fails reports the error code; a code in :attr:`RollbackConfig.codes` is broadcast, after
  ``broadcast_ns``, as a flag tagged with the iteration and its attempt; any other code, or a
  rollback of the same iteration beyond ``max_retries``, escalates to component failover.
* :class:`PollBarrier` is a global-sync point (a layer's dispatch or combine, or the
  iteration's commit) as the kernels implement it: a busy-poll loop. Each poll reads both the
  barrier and the rollback flag, so a DP stuck in a dispatch busy-poll sees the rollback at its
  next poll: within ``poll_ns`` of the broadcast (the polls are not simulated one by one: a
  waiter wakes on the first poll tick, counted from its arrival, at or after the event).
* After a rollback each DP master discards the attempt, restores its KV to the checkpoint and
  acknowledges the epoch at :attr:`RollbackCoordinator.epoch_barrier`; no DP starts the redo
  before all have (no mixed epochs).
* A scale-down aborts the current attempt the same way (:meth:`RollbackCoordinator.abort`)
  and lowers the number of parties every barrier waits for (:meth:`RollbackCoordinator.remove`).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec

from ...runtime import call_at_ns, emit, now_ns, sleep_until_ns
from .config import RollbackConfig


class RolledBack(Exception):
    """Raised inside an executor when it observes the rollback of its attempt."""


class RollbackRecord(msgspec.Struct, kw_only=True):
    """One rollback: where it came from and when each DP saw it."""

    iteration: int
    attempt: int
    code: str
    origin_dp: int
    error_ns: int
    broadcast_ns: int = -1
    observed_ns: dict[int, int] = {}
    """DP -> when its executor saw the flag."""
    polling: list[int] = []
    """DPs that were already inside a busy-poll when the flag was raised."""
    redo_ns: int = -1
    """When every DP had acknowledged the epoch and the redo began."""


class _Flag(msgspec.Struct, frozen=True):
    iteration: int
    attempt: int
    set_ns: int


class RollbackCoordinator:
    """The broadcast thread and the rollback bookkeeping of one decode group."""

    def __init__(
        self,
        config: RollbackConfig,
        dps: int,
        poll_ns: int,
        escalate: Callable[[str], None],
    ):
        self.config = config
        self.dps = dps
        self.poll_ns = poll_ns
        self._escalate = escalate
        self.flag: _Flag | None = None
        self.records: list[RollbackRecord] = []
        self.epoch_barrier = EpochBarrier(self)
        self._tries: dict[int, int] = {}
        self._open: list[PollBarrier] = []
        self.current = (0, 0)
        """The (iteration, attempt) the DP masters last started."""
        self._computing: dict[int, tuple[int, int, anyio.Event]] = {}
        """DP -> (iteration, attempt, wake) of the kernel it is running."""

    def remove(self, removed: list[int]) -> None:
        """Scale-down: the ``removed`` DPs leave every barrier, which from now on waits for
        the DPs left (and the epoch barrier releases if they are all already there)."""
        self.dps -= len(removed)
        self.epoch_barrier.waiting -= set(removed)
        self.epoch_barrier.check()

    def is_polling(self, dp: int) -> bool:
        """Whether DP ``dp`` is waiting at a global barrier right now (a busy-poll, or the
        epoch barrier of a rollback): stalled behind others, not stopped itself."""
        return dp in self.epoch_barrier.waiting or any(dp in b.waiting for b in self._open)

    def abort(self, dp: int, code: str) -> None:
        """Abort the current attempt on every DP (a rollback not caused by an error, e.g. a
        scale-down changing the parties); not counted against ``max_retries``."""
        iteration, attempt = self.current
        if self._current(iteration, attempt) is not None:
            return  # already being rolled back: the epoch barrier now waits for fewer DPs
        record = RollbackRecord(
            iteration=iteration, attempt=attempt, code=code, origin_dp=dp, error_ns=now_ns()
        )
        self.records.append(record)
        emit("rollback", "abort", dp=dp, iteration=iteration, attempt=attempt, code=code)
        call_at_ns(now_ns() + self.config.broadcast_ns, self._broadcast, record)

    def flagged(self, iteration: int, attempt: int) -> bool:
        f = self.flag
        return f is not None and f.iteration == iteration and f.attempt == attempt

    def report(self, dp: int, iteration: int, attempt: int, code: str) -> None:
        """An executor's collective failed with ``code``: roll back, or escalate. The
        reporting executor has seen its own error: it counts as having observed the flag. A
        code outside the rollback list escalates even while the attempt is being rolled back
        (a redo would not cure it), whichever DP reported first."""
        emit("rollback", "error", dp=dp, iteration=iteration, attempt=attempt, code=code)
        if not self.config.enabled or code not in self.config.codes:
            self._escalate(f"DP {dp} failed with {code} in iteration {iteration}")
            return
        if self._current(iteration, attempt) is not None:
            self.observed(dp)
            return  # this attempt is already being rolled back
        tries = self._tries[iteration] = self._tries.get(iteration, 0) + 1
        if tries > self.config.max_retries:
            self._escalate(
                f"iteration {iteration} rolled back {tries - 1} times and failed again "
                f"with {code} (max_retries {self.config.max_retries})"
            )
            return
        record = RollbackRecord(
            iteration=iteration, attempt=attempt, code=code, origin_dp=dp, error_ns=now_ns()
        )
        self.records.append(record)
        self.observed(dp)
        call_at_ns(now_ns() + self.config.broadcast_ns, self._broadcast, record)

    async def compute(self, dp: int, iteration: int, attempt: int, ns: int) -> None:
        """A kernel of ``ns`` on DP ``dp``'s die. The executor's poll loop checks the
        rollback flag between polls even while a kernel runs, so a rollback raised meanwhile
        is seen at the next poll tick (counted from the kernel's start): every DP observes
        it within one poll interval, computing or not (SPEC 11.3 "Reach")."""
        start = now_ns()
        if self.flagged(iteration, attempt):
            self.observed(dp)
            raise RolledBack
        wake = anyio.Event()  # set by the kernel's end, or by a broadcast for this attempt
        timer = call_at_ns(start + ns, wake.set)
        self._computing[dp] = (iteration, attempt, wake)
        try:
            await wake.wait()
        finally:
            self._computing.pop(dp, None)
        if not self.flagged(iteration, attempt) or now_ns() >= start + ns:
            timer.cancel()
            return
        timer.cancel()
        polls = -(-(now_ns() - start) // self.poll_ns)
        await sleep_until_ns(min(start + ns, start + polls * self.poll_ns))
        self.observed(dp)
        raise RolledBack

    def _broadcast(self, record: RollbackRecord) -> None:
        record.broadcast_ns = now_ns()
        self.flag = _Flag(record.iteration, record.attempt, record.broadcast_ns)
        for iteration, attempt, wake in list(self._computing.values()):
            if (iteration, attempt) == (record.iteration, record.attempt):
                wake.set()
        for barrier in self._open:
            if barrier.iteration == record.iteration and barrier.attempt == record.attempt:
                record.polling.extend(sorted(barrier.waiting))
                barrier.wake.set()
        record.polling.sort()
        emit("rollback", "broadcast", iteration=record.iteration, attempt=record.attempt)

    def _current(self, iteration: int, attempt: int) -> RollbackRecord | None:
        last = self.records[-1] if self.records else None
        if last is not None and (last.iteration, last.attempt) == (iteration, attempt):
            return last
        return None

    def observed(self, dp: int) -> None:
        """DP ``dp``'s executor saw the rollback now (first sighting counts)."""
        self.records[-1].observed_ns.setdefault(dp, now_ns())

    def redo_started(self) -> None:
        rec = self.records[-1]
        rec.redo_ns = now_ns()
        self._open = [
            b for b in self._open if (b.iteration, b.attempt) != (rec.iteration, rec.attempt)
        ]

    def barrier(self, iteration: int, attempt: int, name: str) -> PollBarrier:
        """The global-sync point ``name`` of this attempt (created by its first arrival)."""
        for b in self._open:
            if (b.iteration, b.attempt, b.name) == (iteration, attempt, name):
                return b
        b = PollBarrier(self, iteration, attempt, name)
        self._open.append(b)
        return b

    def close(self, barrier: PollBarrier) -> None:
        if barrier in self._open:
            self._open.remove(barrier)


class EpochBarrier:
    """Every live DP acknowledges the rolled-back epoch before any starts the redo; the
    number of live DPs may drop while they wait (scale-down)."""

    def __init__(self, coord: RollbackCoordinator):
        self.coord = coord
        self.waiting: set[int] = set()
        self._release = anyio.Event()

    async def wait(self, dp: int) -> None:
        self.waiting.add(dp)
        release = self._release
        if self.check():
            return
        try:
            await release.wait()
        finally:
            self.waiting.discard(dp)

    def check(self) -> bool:
        """Release the waiters if all live DPs are here; True if it did."""
        if not self.waiting or len(self.waiting) < self.coord.dps:
            return False
        self.waiting = set()
        self._release.set()
        self._release = anyio.Event()
        self.coord.redo_started()
        return True


class PollBarrier:
    """One busy-polled global-sync point of one attempt (all DPs take part)."""

    def __init__(self, coord: RollbackCoordinator, iteration: int, attempt: int, name: str):
        self.coord = coord
        self.iteration = iteration
        self.attempt = attempt
        self.name = name
        self.waiting: set[int] = set()
        self.arrived = 0
        self.release_ns = -1
        self.wake = anyio.Event()

    async def wait(self, dp: int) -> None:
        """Poll until every DP has arrived; raise :class:`RolledBack` on the first poll that
        reads this attempt's rollback flag."""
        c = self.coord
        arrival = now_ns()
        if c.flagged(self.iteration, self.attempt):  # the first poll reads the flag
            c.observed(dp)
            raise RolledBack
        self.arrived += 1
        if self.arrived >= c.dps:
            self.release_ns = arrival
            self.wake.set()
            c.close(self)
            return
        self.waiting.add(dp)
        try:
            await self.wake.wait()
        finally:
            self.waiting.discard(dp)
        released = self.release_ns >= 0
        event = self.release_ns if released else c.flag.set_ns  # type: ignore[union-attr]
        polls = -(-(event - arrival) // c.poll_ns)
        await sleep_until_ns(arrival + polls * c.poll_ns)
        if not released:
            c.observed(dp)
            raise RolledBack
