"""The xds runtime: run an async model in virtual time, deterministically.

``xds.run(main, *args, seed=0, backend="asyncio")`` runs ``main`` on a virtual-time loop and
returns its result. Inside the run, :func:`now_ns`, :func:`sleep_ns`, :func:`rng` and
:func:`emit` reach the current :class:`Runtime`. anyio's own primitives (``sleep``,
``move_on_after``, ``fail_after``, ``Event``, memory object streams, task groups,
``CapacityLimiter``) all run in virtual time on both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import numbers
import sys
import types
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal, TypeVar

import anyio
import msgspec
import numpy as np

from xds.errors import (
    ConfigError,
    ModelDeadlock,
    ModelLivelock,
    ModelTimeLimit,
    ModelTimeStepLimit,
    WaitingTask,
)

from . import determinism
from .diagnose import (
    NoteEntry,
    Notes,
    interrupt_blocked_trio_tasks,
    waiting_asyncio_tasks,
    waiting_trio_tasks,
)
from .events import EventLog
from .logs import ensure_logging_configured
from .loop import VirtualTimeEventLoop, effective_limit_ns
from .rng import RngStreams
from .threads import no_worker_threads
from .timers import TrioTimerWheel

T = TypeVar("T")
Backend = Literal["asyncio", "trio"]
BACKENDS: tuple[str, ...] = ("asyncio", "trio")

_ROOT_TASK_SUFFIXES = ("Runtime._root", "_run_asyncio.<locals>.root")

_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar(
    "xds_runtime", default=None
)


def _check_count(value: object, field: str, what: str) -> None:
    """``value`` is None or a non-negative integer (numpy integers too)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0
    ):
        raise ConfigError(f"{field} must be a non-negative {what}, got {value!r}", field=field)


class Runtime:
    """One simulation run: its clock, random streams and event log.

    Create it, call :meth:`run` once, then read ``events``, ``end_ns``, ``time_steps`` and
    ``rng`` afterwards.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        backend: Backend = "asyncio",
        event_log: bool = True,
        schedule_seed: int | None = None,
        livelock_limit: int = 1_000_000,
        time_limit_ns: int | None = None,
        time_step_limit: int | None = None,
    ):
        if backend not in BACKENDS:
            why = (
                ": uvloop cannot keep virtual time (libuv timers read the wall clock and round "
                "to 1 ms); the uvloop extra is for a future wall-clock mode"
                if backend == "uvloop"
                else ""
            )
            raise ConfigError(
                f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}{why}",
                field="backend",
            )
        if not isinstance(event_log, (bool, np.bool_)):
            raise ConfigError(
                f"event_log must be True or False, got {event_log!r}", field="event_log"
            )
        if (
            isinstance(livelock_limit, bool)
            or not isinstance(livelock_limit, numbers.Integral)
            or livelock_limit < 1
        ):
            raise ConfigError("livelock_limit must be a positive integer", field="livelock_limit")
        livelock_limit = int(livelock_limit)
        if time_step_limit is not None and (
            isinstance(time_step_limit, bool)
            or not isinstance(time_step_limit, numbers.Integral)
            or time_step_limit < 1
        ):
            raise ConfigError(
                "time_step_limit must be a positive integer (how many times virtual time may "
                f"step forward) or None for no limit, got {time_step_limit!r}",
                field="time_step_limit",
            )
        _check_count(time_limit_ns, "time_limit_ns", "integer number of nanoseconds")
        _check_count(
            schedule_seed,
            "schedule_seed",
            "integer (it seeds trio's scheduler; asyncio ignores it)",
        )
        if schedule_seed is not None and backend != "trio":
            warnings.warn(
                f"schedule_seed={schedule_seed} has no effect on the {backend} backend, which "
                "runs ready tasks in FIFO order: it seeds trio's scheduler (backend='trio'), "
                "where different schedule seeds try different interleavings",
                stacklevel=_caller_level(),
            )
        self.time_limit_ns = None if time_limit_ns is None else int(time_limit_ns)
        self.time_step_limit = None if time_step_limit is None else int(time_step_limit)
        self._time_steps = 0
        self.rng = RngStreams(seed)
        self.seed = self.rng.seed
        self.backend: Backend = backend
        self.schedule_seed = self.seed if schedule_seed is None else int(schedule_seed)
        self.livelock_limit = livelock_limit
        self.events = EventLog(self.now_ns, enabled=bool(event_log))
        self.end_ns: int | None = None
        self._loop: VirtualTimeEventLoop | None = None
        self._trio_clock: Any = None
        self._root_scope: anyio.CancelScope | None = None
        self._failure: BaseException | None = None
        self._used = False
        self._hard_stop = False
        self._trio_timers: TrioTimerWheel | None = None
        self._livelock: Any = None  # trio's livelock instrument, during a trio run
        self.waiting_notes: Notes = {}
        """Task id -> what that task waits for (:func:`waiting_for`), one entry per open
        block, outermost first, for deadlock reports."""

    # -- clock -------------------------------------------------------------------------------
    def now_ns(self) -> int:
        """Virtual time of this run in integer nanoseconds (0 before it starts)."""
        if self._loop is not None:
            return self._loop._now_ns
        if self._trio_clock is not None:
            return round(self._trio_clock._virtual_base * 1e9)
        return 0 if self.end_ns is None else self.end_ns

    @property
    def time_steps(self) -> int:
        """How many times virtual time has stepped forward in this run so far (each jump of
        the clock to the next pending timer is one step, however many timers fall due then):
        what ``time_step_limit`` bounds."""
        if self._loop is not None:
            return self._loop.time_steps
        if self._trio_clock is not None:
            return int(self._trio_clock._xds_steps)
        return self._time_steps

    async def sleep_until_ns(self, t_ns: int) -> None:
        """Sleep until virtual time ``t_ns`` (a checkpoint even if it already passed)."""
        if self._loop is not None:
            loop = self._loop
            if t_ns <= loop._now_ns:
                await asyncio.sleep(0)
                return
            fut = loop.create_future()
            handle = loop.call_at_ns(t_ns, _resolve, fut)
            try:
                await fut
            except BaseException:  # cancelled before the timer fired: disarm it
                handle.cancel()
                raise
        else:
            import trio

            await trio.sleep_until(t_ns / 1e9)

    def call_at_ns(self, when_ns: int, callback: Callable[..., object], *args: Any) -> Any:
        """Run ``callback(*args)`` at virtual time ``when_ns`` (no task; must not block).

        Returns a handle with ``cancel()``. Callbacks due at the same nanosecond run in the
        order they were scheduled.
        """
        when_ns = _as_ns(when_ns, "when_ns")
        if not callable(callback):
            raise ConfigError(
                f"call_at_ns() takes a callable, got {_short_repr(callback)}",
                field="callback",
            )
        if self._loop is not None:
            return self._loop.call_at_ns(max(when_ns, self._loop._now_ns), callback, *args)
        if self._trio_clock is None:
            raise RuntimeError("call_at_ns needs a run in progress")
        if self._trio_timers is None:
            self._trio_timers = TrioTimerWheel(self.now_ns, self._on_callback_error)
        return self._trio_timers.call_at_ns(when_ns, callback, *args)

    def _run_due_callbacks(self) -> None:
        """Trio's clock jumped: apply the callbacks due now before any task resumes (as the
        asyncio loop does: its due timers run before the tasks they wake)."""
        if self._trio_timers is not None:
            self._trio_timers.run_due()

    # -- running -----------------------------------------------------------------------------
    def run(self, main: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``main(*args)`` to completion in virtual time and return its result."""
        __tracebackhide__ = True  # pytest: a model failure's report, not xds's frames
        if self._used:
            raise RuntimeError("a Runtime runs once; create a new one for another run")
        self._used = True
        _check_main(main, args)
        if _running_loop():
            raise ConfigError(
                "xds.run (and what calls it: replay, capacity searches, reproduce) is "
                "synchronous and starts its own virtual-time loop; it cannot run inside a "
                "running event loop (call it from plain code or a plain `def` test)",
                field="main",
            )
        ensure_logging_configured()
        token = _current.set(self)
        try:
            with no_worker_threads():
                if self.backend == "asyncio":
                    return self._run_asyncio(main, args)
                return self._run_trio(main, args)
        finally:
            _current.reset(token)
            self.end_ns = self.now_ns()
            self._time_steps = self.time_steps
            self._loop = None
            self._trio_clock = None
            self._livelock = None

    async def _root(self, main: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
        try:
            with anyio.CancelScope() as scope:
                self._root_scope = scope
                awaitable = main(*args)
                if not inspect.isawaitable(awaitable):
                    raise ConfigError(
                        f"main must be an async function (or return an awaitable), but "
                        f"{_name(main)} returned {_short_repr(awaitable)}: make it `async def`",
                        field="main",
                    )
                result = await awaitable
        except BaseException as exc:
            if self._failure is not None and not (self._hard_stop and self._loop is not None):
                raise self._failure from exc
            raise
        if self._failure is not None:
            raise self._failure
        return result

    def _run_asyncio(self, main: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
        __tracebackhide__ = True

        def loop_factory() -> VirtualTimeEventLoop:
            self._loop = VirtualTimeEventLoop(
                on_deadlock=self._on_deadlock,
                on_livelock=self._on_livelock,
                on_callback_error=self._on_callback_error,
                livelock_limit=self.livelock_limit,
                time_limit_ns=self.time_limit_ns,
                on_time_limit=self._on_time_limit,
                time_step_limit=self.time_step_limit,
                on_time_step_limit=self._on_time_step_limit,
            )
            return self._loop

        end: list[int] = []

        async def root() -> T:
            try:
                return await self._root(main, args)
            finally:
                end.append(self.now_ns())

        try:
            with determinism.asyncio_run_scope():
                return anyio.run(
                    root, backend="asyncio", backend_options={"loop_factory": loop_factory}
                )
        finally:
            # The loop is closed after anyio.run returns; keep the time the model ended at.
            if end and self._loop is not None:
                self._loop._now_ns = end[0]

    def _run_trio(self, main: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
        __tracebackhide__ = True
        import trio

        from .trio_clock import LivelockInstrument, virtual_mock_clock

        self._trio_clock = virtual_mock_clock(
            self._on_deadlock,
            self.time_limit_ns,
            self._on_time_limit,
            self.time_step_limit,
            self._on_time_step_limit,
            self._run_due_callbacks,
        )
        livelock = LivelockInstrument(self._trio_clock, self.livelock_limit, self._on_livelock)
        self._livelock = livelock
        try:
            with determinism.trio_run_scope(self.schedule_seed):
                return anyio.run(
                    self._root,
                    main,
                    args,
                    backend="trio",
                    backend_options={"clock": self._trio_clock, "instruments": [livelock]},
                )
        except trio.TrioInternalError as exc:
            cause = exc.__cause__
            if isinstance(cause, (ModelDeadlock, ModelLivelock, ModelTimeLimit)):
                # trio's run state, abandoned mid-loop, is never collected (_trio_debris);
                # the traceback into trio's loop says nothing about the model
                cause.__traceback__ = cause.__context__ = None
                del exc
                self._root_scope = None
                _trio_debris()
                raise cause from None
            if cause is not None and not isinstance(cause, Exception):
                # raised into trio's loop from outside the model, by a signal handler: a
                # test's timeout (pytest-timeout's Failed), say. It is that, not trio's bug.
                del exc
                self._root_scope = None
                _trio_debris()
                raise cause from None
            raise

    # -- model failures ----------------------------------------------------------------------
    def _waiting_tasks(self) -> list[WaitingTask]:
        notes = self.waiting_notes
        tasks = (
            waiting_asyncio_tasks(self._loop, notes)
            if self._loop is not None
            else waiting_trio_tasks(notes)
        )
        # The root task runs the user's main: call it that.
        return [
            msgspec.structs.replace(w, name="main") if w.name.endswith(_ROOT_TASK_SUFFIXES) else w
            for w in tasks
        ]

    def _on_deadlock(self) -> None:
        if self._failure is not None and self._trio_clock is not None and not self._hard_stop:
            # Still stuck after cancelling the root scope: a task waits inside a shielded
            # scope. Throw the failure into every blocked task so the run unwinds cleanly.
            self._hard_stop = True
            failure = self._failure
            interrupt_blocked_trio_tasks(lambda: failure)
            return
        if self._failure is not None or self._root_scope is None:
            # Already unwinding after a failure and still stuck (a shielded wait): stop hard.
            self._hard_stop = True
            raise self._failure or ModelDeadlock(self.now_ns(), self._waiting_tasks())
        self._failure = ModelDeadlock(self.now_ns(), self._waiting_tasks())
        self._unwind()

    def _on_time_limit(self) -> None:
        """The next event is due after the virtual-time limit: fail the run there, naming the
        waiting tasks (as a deadlock does)."""
        self._stop_at_limit(
            lambda: ModelTimeLimit(
                self.now_ns(), effective_limit_ns(self.time_limit_ns), self._waiting_tasks()
            )
        )

    def _on_time_step_limit(self) -> None:
        """Virtual time would step forward once more than ``time_step_limit`` allows: fail the
        run at the current instant, naming the waiting tasks (as the time limit does)."""
        step_limit = self.time_step_limit
        assert step_limit is not None
        self._stop_at_limit(
            lambda: ModelTimeStepLimit(
                self.now_ns(),
                step_limit,
                effective_limit_ns(self.time_limit_ns),
                self._waiting_tasks(),
            )
        )

    def _stop_at_limit(self, make_failure: Callable[[], ModelTimeLimit]) -> None:
        """A run limit stops the clock: cancel the root scope so the model unwinds at this
        instant; if it is still stuck when the clock would move again, stop hard."""
        if self._failure is not None and self._trio_clock is not None and not self._hard_stop:
            self._hard_stop = True  # still stuck after cancelling: interrupt the shielded waits
            failure = self._failure
            interrupt_blocked_trio_tasks(lambda: failure)
            return
        if self._failure is not None or self._root_scope is None:
            self._hard_stop = True
            raise self._failure or make_failure()
        self._failure = make_failure()
        self._unwind()

    def _on_callback_error(self, exc: BaseException) -> None:
        if self._failure is None and self._root_scope is not None:
            self._failure = exc
            self._unwind()

    def _unwind(self) -> None:
        """The run failed (``self._failure``): cancel the root scope so the model unwinds.
        Unwinding takes a few loop iterations at the current instant; a task that catches the
        cancellation and waits again spins there instead, so from now on the livelock check
        bites after :data:`UNWIND_SPIN_LIMIT` iterations rather than ``livelock_limit``."""
        assert self._root_scope is not None
        limit = min(self.livelock_limit, UNWIND_SPIN_LIMIT)
        if self._loop is not None:
            self._loop.livelock_limit, self._loop._spins = limit, 0
        if self._livelock is not None:
            self._livelock.limit, self._livelock._spins = limit, 0
        self._root_scope.cancel()

    def _on_livelock(self, t_ns: int, iterations: int) -> None:
        if self._failure is not None or self._root_scope is None:
            # Still spinning after the root scope was cancelled: a task swallows cancellation.
            self._hard_stop = True
            failure = self._failure or ModelLivelock(t_ns, iterations, self._waiting_tasks())
            if self._failure is not None and not getattr(failure, "_xds_swallowed", False):
                failure._xds_swallowed = True  # type: ignore[attr-defined]
                tasks = sorted({w.name for w in self._waiting_tasks()})
                failure.add_note(
                    f"then, while the run was being cancelled, the model spun {iterations:,} "
                    f"loop iterations at t={t_ns} ns: a task catches the cancellation and goes "
                    "on (an `except` of anyio.get_cancelled_exc_class(), CancelledError or "
                    "BaseException that does not re-raise); still running: "
                    + (", ".join(tasks) or "-")
                )
            if self._trio_clock is not None:
                # trio disables an instrument that raises; its run loop reads the clock next,
                # and that read ends the run (trio.run raises TrioInternalError from it)
                self._trio_clock._xds_stop = failure
                return
            raise failure
        self._failure = ModelLivelock(t_ns, iterations, self._waiting_tasks())
        self._unwind()


UNWIND_SPIN_LIMIT = 10_000
"""Loop iterations at one instant a failed run may take to unwind before it is stopped hard
(a task that swallows cancellation would otherwise spin up to ``livelock_limit``)."""


def _trio_debris() -> None:
    """A trio run was stopped from inside trio's loop: its run state, abandoned there, is
    garbage that must never be collected. Collecting it closes its tasks' coroutines outside
    any run, so a task that catches every exception in a loop (``except BaseException: pass``)
    would spin in its ``close()`` forever (its awaits raise at once, without a run to yield
    to), hanging the next run or the interpreter's exit; the others would print
    unraisable-exception reports. So the garbage collector sets aside every object it tracks
    now (``gc.freeze``): the abandoned state stays in memory, never finalized, as do today's
    other objects once they become garbage (a one-off leak, after a run that went wrong)."""
    import gc

    gc.freeze()


def _name(function: object) -> str:
    """How an error names a callable: its qualified name, else its repr."""
    name = getattr(function, "__qualname__", None)
    if isinstance(name, str):
        return name.rpartition("<locals>.")[2]
    return _short_repr(function)


def _short_repr(value: object) -> str:
    """``value``'s repr on one line, cut to a readable length, with its type."""
    text = " ".join(repr(value).split())
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _check_main(main: object, args: tuple[Any, ...]) -> None:
    """``main`` is something ``xds.run`` can call with ``args`` and await: a one-line
    ConfigError naming ``main`` (or ``args``) otherwise. What a plain callable returns is
    checked when the run calls it."""
    if inspect.isawaitable(main):
        name = _name(main)
        what = "a coroutine object" if inspect.iscoroutine(main) else _short_repr(main)
        if inspect.iscoroutine(main):
            main.close()  # it will never run: no "never awaited" warning
        raise ConfigError(
            f"main must be an async function; got {what}, so pass the function, not its "
            f"call: xds.run({name}), not xds.run({name}())",
            field="main",
        )
    if not callable(main):
        raise ConfigError(
            f"main must be an async function (or a function returning an awaitable); got "
            f"{_short_repr(main)}",
            field="main",
        )
    if inspect.isasyncgenfunction(main):
        raise ConfigError(
            f"main must be an async function; {_name(main)} is an async generator function "
            "(it yields), which xds.run cannot await",
            field="main",
        )
    try:
        signature = inspect.signature(main)
    except (TypeError, ValueError):  # no signature to check (some builtins)
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        given = ", ".join(" ".join(repr(arg).split())[:40] for arg in args)
        raise ConfigError(
            f"xds.run passes its extra positional arguments to main, and "
            f"{_name(main)}({given}) does not fit its signature: {exc}",
            field="args",
        ) from None


def _running_loop() -> bool:
    """Whether this thread is inside a running asyncio or trio loop."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    try:
        import trio

        trio.lowlevel.current_trio_token()
        return True
    except RuntimeError:
        return False


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _caller_level() -> int:
    """The ``stacklevel`` of a warning raised in :class:`Runtime` that points at the first
    caller outside this module (``xds.run(...)`` or ``Runtime(...)`` in the user's code)."""
    level, frame = 2, sys._getframe(2)  # 1: this function's caller, Runtime.__init__
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def run(
    main: Callable[..., Awaitable[T]],
    *args: Any,
    seed: int = 0,
    backend: Backend = "asyncio",
    event_log: bool = True,
    schedule_seed: int | None = None,
    livelock_limit: int = 1_000_000,
    time_limit_ns: int | None = None,
    time_step_limit: int | None = None,
) -> T:
    """Run ``main(*args)`` in virtual time and return its result.

    ``seed`` seeds every random stream of the run; ``backend`` is ``"asyncio"`` (xds's virtual
    loop, the default) or ``"trio"`` (``MockClock(autojump_threshold=0)``, deterministic
    scheduling seeded with ``schedule_seed``, default ``seed``). Raises
    :class:`xds.errors.ModelDeadlock` if the model can make no further progress, and
    :class:`xds.errors.ModelTimeLimit` if ``time_limit_ns`` is given and the next event is due
    after it (a hang kept alive by periodic tasks), and :class:`xds.errors.ModelTimeStepLimit`
    (a ``ModelTimeLimit``) if ``time_step_limit`` is given and virtual time would step forward
    (jump to the next pending timer) more often than that: a bound in wall time rather than
    virtual time, for fine-grained poll loops. All three name the waiting tasks.
    """
    rt = Runtime(
        seed=seed,
        backend=backend,
        event_log=event_log,
        schedule_seed=schedule_seed,
        livelock_limit=livelock_limit,
        time_limit_ns=time_limit_ns,
        time_step_limit=time_step_limit,
    )
    return rt.run(main, *args)


def current_runtime() -> Runtime:
    """The :class:`Runtime` of the run in progress (raises outside ``xds.run``)."""
    rt = _current.get()
    if rt is None:
        raise RuntimeError("no xds run in progress: call this inside xds.run(...)")
    return rt


def now_ns() -> int:
    """Virtual time of the current run, in integer nanoseconds."""
    return current_runtime().now_ns()


def _as_ns(value: object, name: str) -> int:
    """An integer number of nanoseconds (numpy integers accepted; floats are an error)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer number of nanoseconds, got {value!r}")
    return int(value)


async def sleep_ns(duration_ns: int) -> None:
    """Sleep ``duration_ns`` nanoseconds of virtual time."""
    if type(duration_ns) is not int:  # the hot path passes plain ints
        duration_ns = _as_ns(duration_ns, "duration_ns")
    if duration_ns < 0:
        raise ConfigError(
            f"cannot sleep a negative duration ({duration_ns} ns)", field="duration_ns"
        )
    rt = _current.get()
    if rt is None:
        raise RuntimeError("no xds run in progress: call this inside xds.run(...)")
    await rt.sleep_until_ns(rt.now_ns() + duration_ns)


async def sleep_until_ns(t_ns: int) -> None:
    """Sleep until virtual time ``t_ns``."""
    if type(t_ns) is not int:
        t_ns = _as_ns(t_ns, "t_ns")
    await current_runtime().sleep_until_ns(t_ns)


def call_at_ns(when_ns: int, callback: Callable[..., object], *args: Any) -> Any:
    """Run ``callback(*args)`` at virtual time ``when_ns`` in the current run (see Runtime)."""
    return current_runtime().call_at_ns(when_ns, callback, *args)


def rng(name: str) -> np.random.Generator:
    """The current run's random stream called ``name``."""
    return current_runtime().rng(name)


@contextlib.contextmanager
def waiting_for(what: str | Callable[[], str]) -> Iterator[None]:
    """Say what the current task waits for while inside the ``with`` block.

    ``what`` is text, or a function of no arguments returning text that is called only if a
    report needs it (so it can describe the state at the time of the report); anything else is
    a :class:`~xds.errors.ConfigError` at the call. Costs a list entry; if the run deadlocks or
    reaches a limit meanwhile, the report shows it beside the task, so a protocol's hang
    explains itself::

        with xds.waiting_for(lambda: f"credit from die {peer} (holds {credits[peer]})"):
            await credit.wait()

    Nested blocks add to the task's note, outermost first: ``with waiting_for("a repair"):``
    around ``with waiting_for("credit from die 3"):`` reports ``a repair > credit from die 3``,
    and leaving the inner block leaves ``a repair``. Outside :func:`run` it only checks
    ``what``.
    """
    _check_note(what)
    rt = _current.get()
    if rt is None:  # outside xds.run (e.g. an xds Barrier under plain anyio): nothing to label
        yield
        return
    if rt._loop is not None:
        key = id(asyncio.current_task(rt._loop))
    else:
        import trio

        key = id(trio.lowlevel.current_task())
    notes = rt.waiting_notes.setdefault(key, [])
    entry: NoteEntry = (what,)  # this block's own, found by identity
    notes.append(entry)
    try:
        yield
    finally:
        for i in range(len(notes) - 1, -1, -1):
            if notes[i] is entry:
                del notes[i]
                break
        if not notes and rt.waiting_notes.get(key) is notes:
            del rt.waiting_notes[key]


def _check_note(what: object) -> None:
    """``what`` is a str or a callable that can be called with no arguments."""
    if isinstance(what, str):
        return
    problem = None
    if not callable(what):
        problem = f"got {_short_repr(what)}"
    else:
        if isinstance(what, types.FunctionType):
            # the fast path (a lambda per wait in xds's own protocols): count the parameters
            # without defaults, positional and keyword-only
            code = what.__code__
            required = code.co_argcount - len(what.__defaults__ or ())
            required += code.co_kwonlyargcount - len(what.__kwdefaults__ or {})
            needs_args = required > 0
        else:
            try:
                inspect.signature(what).bind()
                needs_args = False
            except TypeError:
                needs_args = True
            except ValueError:  # no signature to check (some builtins): trust it
                needs_args = False
        if needs_args:
            problem = f"got a function that needs arguments ({_name(what)})"
    if problem is not None:
        raise ConfigError(
            f"what must be text (a str) or a function of no arguments returning text, {problem}",
            field="what",
        )


def emit(component: str, event: str, **fields: Any) -> None:
    """Append an event to the current run's event log."""
    current_runtime().events.emit(component, event, **fields)
