"""Die failures on one fabric: which dies have failed (fail-stop), when, and when the others
learn of it.

A fabric has one registry (``fabric.failures``); ``XCCL.fail_die`` records a failure in it and
``XCCL.repair_die`` removes it. The engines that move data react through listeners, called in
the order they registered: the point-to-point engine poisons the failed die's pairs, and each
collective group (dispatch/combine, A2E/E2A) fails the operations in flight on its dies
(:mod:`xds.fabric.xccl.group_failure`).

Every die other than the failed one learns of a failure one metadata latency after it (the
failed die's last write, or its silence, reaches the die over their link), plus ``detect_ns``,
the caller's model of a slower detection such as a heartbeat timeout (SPEC 11).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol

import msgspec

from ..errors import DieFailure, ProtocolError
from ..runtime import emit, now_ns

if TYPE_CHECKING:
    from .ub import UBFabric


class FailedDie(msgspec.Struct, frozen=True):
    """A failed die: when it failed and how much later than one metadata latency the other
    dies learn of it."""

    die: int
    at_ns: int
    detect_ns: int

    def describe(self, remedy: str = "") -> str:
        return f"die {self.die} failed at t={self.at_ns} ns; " + (
            remedy or f"xccl.repair_die({self.die}) brings it back"
        )

    def error(self, who: str, remedy: str = "") -> DieFailure:
        """The :class:`~xds.errors.DieFailure` an operation described by ``who`` raises
        (``remedy``: what brings the operation back, if not repairing the die)."""
        return DieFailure(f"{who}: {self.describe(remedy)}", die=self.die, at_ns=self.at_ns)


class FailureListener(Protocol):
    def die_failed(self, failure: FailedDie) -> None:
        """React to ``failure`` (called at the instant the die fails)."""


class DieFailures:
    """The failed dies of one fabric and the listeners told of each new failure."""

    def __init__(self, fabric: UBFabric):
        self._fabric = weakref.ref(fabric)
        self._failed: dict[int, FailedDie] = {}
        self._listeners: list[weakref.ref[FailureListener]] = []

    @property
    def fabric(self) -> UBFabric:
        fabric = self._fabric()
        assert fabric is not None, "the fabric of this failure registry is gone"
        return fabric

    def listen(self, listener: FailureListener) -> None:
        """Call ``listener.die_failed`` on every later failure (held weakly: a listener that
        is garbage-collected stops listening)."""
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        self._listeners.append(weakref.ref(listener))

    def fail(self, die: int, detect_ns: int) -> FailedDie:
        """Record that ``die`` failed now and tell the listeners, in registration order."""
        if die in self._failed:
            raise ProtocolError(
                f"die {die} already failed at t={self._failed[die].at_ns} ns; "
                f"xccl.repair_die({die}) brings it back"
            )
        failure = self._failed[die] = FailedDie(die, now_ns(), detect_ns)
        emit("xccl", "die_failed", die=die, detect_ns=detect_ns)
        live = [ref for ref in self._listeners if ref() is not None]
        self._listeners = live
        for ref in live:
            listener = ref()
            if listener is not None:
                listener.die_failed(failure)
        return failure

    def repair(self, die: int) -> None:
        if die not in self._failed:
            raise ProtocolError(f"die {die} has not failed (xccl.fail_die fails it)")
        del self._failed[die]
        emit("xccl", "die_repaired", die=die)

    def failed_by(self, die: int, t_ns: int) -> bool:
        """Whether ``die`` has failed at or before ``t_ns`` (and is not repaired)."""
        failure = self._failed.get(die)
        return failure is not None and failure.at_ns <= t_ns

    def of(self, die: int) -> FailedDie | None:
        """``die``'s failure, or None if it has not failed (or was repaired)."""
        return self._failed.get(die)

    def __contains__(self, die: int) -> bool:
        return die in self._failed

    def __bool__(self) -> bool:
        return bool(self._failed)

    def failed(self) -> dict[int, int]:
        """Failed (unrepaired) dies -> the virtual time each failed, by die."""
        return {die: f.at_ns for die, f in sorted(self._failed.items())}

    def known_ns(self, failure: FailedDie, die: int) -> int:
        """When ``die`` learns of ``failure``: at once if it is the failed die, else one
        metadata latency from the failed die later, plus ``detect_ns``."""
        if die == failure.die:
            return failure.at_ns
        return self.fabric.meta_visible_ns(failure.die, die, failure.at_ns) + failure.detect_ns

    def clear(self) -> None:
        """A later run starts with every die healthy (failures belong to the earlier one)."""
        self._failed.clear()
