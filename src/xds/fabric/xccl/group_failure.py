"""How a collective group (dispatch/combine, A2E/E2A) meets a die failure (fail-stop).

A collective needs every member: dispatch's step-5 barrier waits for every rank's metadata, a
rank pulls from every peer's managed area, an E2A waits for copies relayed through trampolines.
So a failure of any member (``XCCL.fail_die``, before or after the group was built) *breaks the
group* for the rest of the run:

- the failed die's own operation in flight stops at once and raises
  :class:`~xds.errors.DieFailure`; the writes it had issued before the failure still land,
  none issued at or after its instant does;
- every other member's operation in flight raises ``DieFailure`` when its die learns of the
  failure (one metadata latency, plus the ``detect_ns`` given to ``fail_die``), unless it
  completed strictly before: a member that finished before it could know keeps its result
  (one that finishes at the very instant it learns fails, on every backend and tier);
- a later operation raises ``DieFailure`` (a member that has not learnt of the failure yet
  starts, and raises when it does); once every failed member is repaired, a
  :class:`~xds.errors.ProtocolError` says the group is broken: build a new one (its managed
  areas and eventIDs are its own, so nothing of the broken group leaks into it). Repairing a
  die does not wait for the operations of its groups: they fail as described all the same.

A later run on the fabric starts every die healthy and the group idle (its exchange state
dropped through ``on_new_run``). Nothing here touches the exchange's data path: each operation
runs in a cancel scope that the failure cancels at the instant the die learns of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from ...errors import ProtocolError
from ...runtime import emit, now_ns
from ..failures import FailedDie
from ..ub import UBFabric

T = TypeVar("T")

_REMEDY = "the group is broken: build a new one once the die is repaired (xccl.repair_die)"


class _Operation:
    """One member's operation in flight: its die, its cancel scope and the failure (if any)
    that cancelled it."""

    def __init__(self, die: int):
        self.die = die
        self.scope = anyio.CancelScope()
        self.failure: FailedDie | None = None


class GroupFailures:
    """The failure view of one collective group: its member dies, the failures among them this
    run (a repair does not undo them) and the operations in flight."""

    def __init__(
        self,
        fabric: UBFabric,
        dies: list[int],
        group: str,
        *,
        on_new_run: Callable[[], None] | None = None,
    ):
        self.fabric = fabric
        self.group = group
        self._dies = frozenset(dies)
        self._on_new_run = on_new_run
        self._epoch = fabric.run_epoch
        self.failed: dict[int, FailedDie] = {}
        """Member die -> its failure this run, in the order they failed (kept after repair)."""
        self._ops: dict[int, _Operation] = {}
        self._next = 0
        registry = fabric.failures
        for die in sorted(self._dies):  # members that are down already
            failure = registry.of(die)
            if failure is not None:
                self.failed[die] = failure
        self.failed = dict(sorted(self.failed.items(), key=lambda kv: (kv[1].at_ns, kv[0])))
        registry.listen(self)

    @property
    def broken_by(self) -> FailedDie | None:
        """The first failure of a member this run (None: the group is whole)."""
        return next(iter(self.failed.values()), None)

    def _sync_run(self) -> None:
        """A later run on the fabric: every die is healthy again and the group starts idle."""
        self.fabric._enter_run()
        if self._epoch != self.fabric.run_epoch:
            self._epoch = self.fabric.run_epoch
            self.failed.clear()
            self._ops.clear()
            if self._on_new_run is not None:
                self._on_new_run()

    def die_failed(self, failure: FailedDie) -> None:
        if failure.die not in self._dies:
            return
        self._sync_run()
        if not self.failed:
            emit("xccl", "group_broken", group=self.group, die=failure.die)
        self.failed[failure.die] = failure
        for op in list(self._ops.values()):
            self._schedule(op, failure)

    def failed_by(self, die: int, t_ns: int) -> FailedDie | None:
        """``die``'s failure this run if it failed at or before ``t_ns`` (repaired or not)."""
        failure = self.failed.get(die)
        return failure if failure is not None and failure.at_ns <= t_ns else None

    def _schedule(self, op: _Operation, failure: FailedDie) -> None:
        when = self.fabric.failures.known_ns(failure, op.die)
        if when <= now_ns():
            self._fire(op, failure)
        else:
            self.fabric.post(when, self._fire, op, failure)

    @staticmethod
    def _fire(op: _Operation, failure: FailedDie) -> None:
        if op.failure is None:  # the first failure the die learns of is the one it reports
            op.failure = failure
            op.scope.cancel()

    def _known(self, die: int, failures: list[FailedDie]) -> FailedDie | None:
        """Of ``failures``, the one ``die`` learnt of first, if it has learnt of any by now."""
        registry, now = self.fabric.failures, now_ns()
        known = [(registry.known_ns(f, die), f.at_ns, f.die, f) for f in failures]
        known = [k for k in known if k[0] <= now]
        return min(known, key=lambda k: k[:3])[3] if known else None

    def _since(self, before: list[FailedDie]) -> list[FailedDie]:
        """Member failures recorded since ``before`` (a snapshot of ``failed``) was taken."""
        return [f for f in self.failed.values() if all(f is not b for b in before)]

    async def run(self, die: int, who: str, body: Callable[[], Awaitable[T]]) -> T:
        """Run ``body`` (member ``die``'s part of a collective, described by ``who``) so that
        it raises :class:`~xds.errors.DieFailure` when the die learns of a member's failure."""
        self._sync_run()
        registry = self.fabric.failures
        # the member failures this operation meets: those not repaired (a repaired member
        # leaves the group broken, which a ProtocolError reports once none is down)
        down = [f for d, f in self.failed.items() if registry.of(d) is f]
        if self.failed and not down:
            first = self.broken_by
            assert first is not None
            raise ProtocolError(
                f"{who}: this {self.group} group broke when die {first.die} failed at "
                f"t={first.at_ns} ns; the die is repaired, but a collective group does "
                "not survive a member's failure: build a new group"
            )
        known = self._known(die, down)
        if known is not None:
            raise known.error(who, _REMEDY)
        recorded = list(self.failed.values())
        op = _Operation(die)
        key = self._next
        self._next += 1
        self._ops[key] = op
        try:
            with op.scope:
                for failure in down:  # not known to this die yet
                    self._schedule(op, failure)
                result = await body()
                # a failure it learns of at the very instant it completes counts
                known = self._known(die, [*down, *self._since(recorded)])
                if known is not None:
                    raise known.error(who, _REMEDY)
                return result
        finally:
            self._ops.pop(key, None)
        assert op.failure is not None  # the scope is only ever cancelled by a failure
        raise op.failure.error(who, _REMEDY)
