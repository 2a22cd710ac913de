"""How a collective group (dispatch/combine, A2E/E2A) meets a die failure (fail-stop).

A collective needs every member: dispatch's step-5 barrier waits for every rank's metadata, a
rank pulls from every peer's managed area, an E2A waits for copies relayed through trampolines.
So a failure of any member (``XCCL.fail_die``) *breaks the group*:

- the failed die's own operation in flight stops at once and raises
  :class:`~xds.errors.DieFailure` (the writes it had already issued still land);
- every other member's operation in flight raises ``DieFailure`` when that die learns of the
  failure (one metadata latency, plus the ``detect_ns`` given to ``fail_die``), unless it has
  completed by then: a rank that finished before it could know keeps its result;
- a later operation on the group raises ``DieFailure`` (a member that has not learnt of the
  failure yet starts, and raises when it does); once the die is repaired, a
  :class:`~xds.errors.ProtocolError` says the group is broken: build a new one (its managed
  areas and eventIDs are its own, so nothing of the broken group leaks into it).

Nothing here touches the exchange's data path: each operation runs in a cancel scope that the
failure cancels at the instant the die learns of it.
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


class _Operation:
    """One member's operation in flight: its die, its cancel scope and the failure (if any)
    that cancelled it."""

    def __init__(self, die: int, who: str):
        self.die = die
        self.who = who
        self.scope = anyio.CancelScope()
        self.failure: FailedDie | None = None


class GroupFailures:
    """The failure view of one collective group: its member dies and operations in flight."""

    def __init__(self, fabric: UBFabric, dies: list[int], group: str):
        self.fabric = fabric
        self.group = group
        self._dies = frozenset(dies)
        self.broken_by: FailedDie | None = None
        """The first failure of a member since the group was built (it stays broken for the
        rest of the run; a later run on the fabric starts every die healthy)."""
        self._epoch = fabric.failures.epoch
        self._ops: dict[int, _Operation] = {}
        self._next = 0
        fabric.failures.listen(self)

    def die_failed(self, failure: FailedDie) -> None:
        if failure.die not in self._dies:
            return
        if self.broken_by is None:
            self.broken_by = failure
            emit("xccl", "group_broken", group=self.group, die=failure.die)
        for op in list(self._ops.values()):
            self._schedule(op, failure)

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

    async def run(self, die: int, who: str, body: Callable[[], Awaitable[T]]) -> T:
        """Run ``body`` (member ``die``'s part of a collective, described by ``who``) so that
        it raises :class:`~xds.errors.DieFailure` when the die learns of a member's failure."""
        self.fabric._enter_run()
        if self._epoch != self.fabric.failures.epoch:  # a later run: an earlier one's break
            self._epoch, self.broken_by = self.fabric.failures.epoch, None
        broken = self.broken_by
        if broken is not None:
            failures = self.fabric.failures
            current = failures.of(broken.die)
            if current is None:
                raise ProtocolError(
                    f"{who}: this {self.group} group broke when die {broken.die} failed at "
                    f"t={broken.at_ns} ns; the die is repaired, but a collective group does "
                    "not survive a member's failure: build a new group"
                )
            broken = current
            if failures.known_ns(broken, die) <= now_ns():
                raise broken.error(who)
        op = _Operation(die, who)
        key = self._next
        self._next += 1
        self._ops[key] = op
        try:
            with op.scope:
                if broken is not None:  # this die has not learnt of it yet
                    self._schedule(op, broken)
                return await body()
        finally:
            del self._ops[key]
        assert op.failure is not None  # the scope is only ever cancelled by a failure
        raise op.failure.error(who)
