"""One exception hierarchy for xds (ARCHITECTURE.md, "Configuration, records, errors").

Every error xds raises on purpose derives from :class:`XdsError`, so a caller can catch the
simulator's own failures without catching bugs in their code.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class XdsError(Exception):
    """Base class of every error raised on purpose by xds."""


class ConfigError(XdsError, ValueError):
    """A configuration or API argument is invalid.

    ``field`` is the dotted path of the offending field and ``source`` the file it came from
    (when it came from a file), so the message can point at it.
    """

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.message = message
        self.field = field
        self.source = source
        where = ""
        if source:
            where += f"{source}: "
        if field:
            where += f"{field}: "
        super().__init__(f"{where}{message}")


class TraceError(XdsError, ValueError):
    """A workload trace is malformed (file, line and field are named in the message)."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ):
        self.path = path
        self.line = line
        self.field = field
        parts = [p for p in (path, f"line {line}" if line is not None else None) if p]
        prefix = ":".join(parts)
        if field:
            prefix = f"{prefix} field {field!r}" if prefix else f"field {field!r}"
        super().__init__(f"{prefix}: {message}" if prefix else message)


class ProtocolError(XdsError):
    """A communication protocol rule was broken (eventID mismatch, bad peer, bad buffer)."""


class FaultError(XdsError):
    """An injected fault surfaced to the caller (link down, die failure, ...)."""


class DieFailure(FaultError, ProtocolError):
    """An XCCL operation (point-to-point or collective) met a failed die (``XCCL.fail_die``):
    the die itself, or a peer or group member that learnt of the failure. ``die`` is the failed
    die, ``at_ns`` when it failed."""

    def __init__(self, message: str, *, die: int, at_ns: int):
        self.die = die
        self.at_ns = at_ns
        super().__init__(message)


class WaitingTask(msgspec.Struct, frozen=True):
    """One task found blocked when the model deadlocked."""

    name: str
    waiting_in: str
    """Innermost frame of the model's own code, as ``file:line in function``."""
    waiting_on: str
    """Innermost library call it is blocked in (e.g. ``Event.wait``), or ``""``."""
    called_from: str = ""
    """When ``waiting_in`` is inside xds: the innermost frame of the caller's own code."""
    waiting_for: str = ""
    """What the task said it waits for (:func:`xds.waiting_for`), or ``""``."""
    own_code: bool = False
    """The task runs code of the caller's own (outside xds and the async libraries)."""

    def describe(self) -> str:
        on = f" (blocked in {self.waiting_on})" if self.waiting_on else ""
        caller = f", called from {self.called_from}" if self.called_from else ""
        what = f"\n      waiting for {self.waiting_for}" if self.waiting_for else ""
        return f"{self.name}: {self.waiting_in}{on}{caller}{what}"


def describe_waiting(waiting: Sequence[WaitingTask], limit: int = 40) -> list[str]:
    """Report lines for the waiting tasks: those that say what they wait for first, then
    those waiting in the caller's own code, then the rest (xds's own plumbing); tasks waiting
    at the same place for the same thing share one line."""
    groups: dict[tuple[str, str, str, str], list[WaitingTask]] = {}
    for w in waiting:
        groups.setdefault((w.waiting_in, w.waiting_on, w.called_from, w.waiting_for), []).append(w)

    def rank(tasks: list[WaitingTask]) -> tuple[int, str]:
        w = tasks[0]
        return (0 if w.waiting_for else 1 if w.own_code else 2), w.name

    ordered = sorted(groups.values(), key=rank)
    lines = []
    for tasks in ordered[:limit]:
        line = f"  - {tasks[0].describe()}"
        others = [w.name for w in tasks[1:]]
        if others:
            also = ", ".join(others[:3]) + (
                f" and {len(others) - 3} more" if len(others) > 3 else ""
            )
            line = line.replace(tasks[0].name + ":", f"{tasks[0].name} (also {also}):", 1)
        lines.append(line)
    if len(ordered) > limit:
        rest = sum(len(t) for t in ordered[limit:])
        lines.append(f"  ... and {rest} more task(s) elsewhere")
    return lines


class ModelDeadlock(XdsError):
    """Every task is waiting, nothing is runnable and no timer is pending.

    In virtual time this can never resolve by itself, so instead of hanging xds raises this,
    naming each waiting task and where it waits.
    """

    def __init__(self, t_ns: int, waiting: Sequence[WaitingTask]):
        self.t_ns = t_ns
        self.waiting = tuple(waiting)
        lines = [
            f"model deadlock at t={t_ns} ns: {len(self.waiting)} task(s) waiting, "
            "nothing runnable, no timer pending"
        ]
        super().__init__("\n".join(lines + describe_waiting(self.waiting)))


class ModelTimeLimit(XdsError):
    """The run reached its virtual-time limit (``xds.run(..., time_limit_ns=...)``) before
    ``main`` returned: a hang that periodic tasks keep from being a deadlock, or a model
    slower than expected. Names each task still waiting and where it waits."""

    def __init__(self, t_ns: int, limit_ns: int, waiting: Sequence[WaitingTask]):
        self.t_ns = t_ns
        self.limit_ns = limit_ns
        self.waiting = tuple(waiting)
        from .runtime.loop import HORIZON_NS

        what = (
            f"virtual time reached xds's horizon of {limit_ns} ns (about 48.5 days; nanoseconds "
            "stay exact below it)"
            if limit_ns == HORIZON_NS
            else f"virtual-time limit of {limit_ns} ns reached"
        )
        lines = [f"{what} (next event due after it): {len(self.waiting)} task(s) still waiting"]
        super().__init__("\n".join(lines + describe_waiting(self.waiting)))


class ModelTimeStepLimit(ModelTimeLimit):
    """The run used up its time-step budget (``xds.run(..., time_step_limit=...)``) before
    ``main`` returned: virtual time stepped forward (jumped to the next pending timer) that
    many times. A fine-grained poll loop kept alive past its purpose, bounded in wall time
    rather than virtual time. A :class:`ModelTimeLimit` (``limit_ns`` is the run's
    virtual-time limit, not reached); names each task still waiting and where it waits."""

    def __init__(self, t_ns: int, step_limit: int, limit_ns: int, waiting: Sequence[WaitingTask]):
        self.t_ns = t_ns
        self.step_limit = step_limit
        self.limit_ns = limit_ns
        self.waiting = tuple(waiting)
        lines = [
            f"time-step limit of {step_limit} reached at t={t_ns} ns: virtual time stepped "
            f"forward {step_limit} times (a fine-grained poll loop that never ends? raise it, "
            f"or lift it with time_step_limit=None): {len(self.waiting)} task(s) still waiting"
        ]
        XdsError.__init__(self, "\n".join(lines + describe_waiting(self.waiting)))


class ModelLivelock(XdsError):
    """The model kept running at one virtual instant for too many loop iterations.

    Typically a task polls in a loop with zero-time checkpoints and never lets time advance.
    """

    def __init__(self, t_ns: int, iterations: int, tasks: Sequence[WaitingTask] = ()):
        self.t_ns = t_ns
        self.iterations = iterations
        self.tasks = tuple(tasks)
        """Every task and where it was when the livelock was found (the spinning one among
        them, at its zero-time checkpoint)."""
        lines = [
            f"model livelock at t={t_ns} ns: {iterations} loop iterations without virtual time "
            "advancing (a task polls with zero-time checkpoints; sleep for a modelled poll "
            "interval instead, or raise xds.run(..., livelock_limit=...))"
        ]
        if self.tasks:
            lines.append(f"  {len(self.tasks)} task(s), where each was:")
        super().__init__("\n".join(lines + describe_waiting(self.tasks)))
