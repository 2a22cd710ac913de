"""pytest plugin: run ``async def`` tests in xds virtual time.

Mark a coroutine test with ``@pytest.mark.xds`` (optionally ``seed=``, ``backend=``) and it runs
under :func:`xds.run`: ``anyio.sleep(3600)`` takes no wall time, and the same seed gives the same
run. A test that takes the ``xds_backend`` fixture runs once per backend (asyncio and trio), or
only on the marker's ``backend=`` if it names one::

    @pytest.mark.xds(seed=7)
    async def test_barrier(xds_backend):
        ...

The marker takes keywords only (those of :class:`xds.Runtime`). Misuse -- a positional argument,
an unknown keyword or backend, the marker written on a plain ``def`` test, an async fixture --
is reported as that test's error at setup, in one line, before its fixtures run. A marker
inherited from a class or module (``pytestmark``) applies to the ``async def`` tests there and
leaves plain tests alone. Markers stacked on one test, class or module combine, and may repeat a
keyword only with the same value; conflicting ones are that test's error too.

A marked test's failure is shown from the test's own code: a model failure (``ModelDeadlock``,
``ModelLivelock``, ``ModelTimeLimit``) as its report alone, other errors from the test's first
frame inward, without the frames of xds's runtime, anyio, trio and asyncio that ran it
(``--full-trace`` shows every frame).

The plugin is registered through the ``pytest11`` entry point when xds is installed.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

import pytest

from xds.errors import ConfigError, ModelDeadlock, ModelLivelock, ModelTimeLimit
from xds.runtime import BACKENDS, Runtime
from xds.runtime.diagnose import library_dirs

TEST_TIME_LIMIT_NS = 86_400 * 10**9
"""A marked test's default ``time_limit_ns``: one virtual day, so a hang kept alive by a
periodic task ends as ``ModelTimeLimit`` in seconds; ``time_limit_ns=None`` in the marker lifts
it."""

TEST_TIME_STEP_LIMIT = 1_000_000
"""A marked test's default ``time_step_limit``: virtual time may step forward (jump to the next
pending timer) a million times. The one-day limit takes ~12 wall minutes to reach behind a 1 ms
heartbeat and days behind a 1 us poll; a million steps take ~10 s of wall time on asyncio
(~30 s on trio) for a single poller, and match the day at a 100 ms period. Existing marked
tests take at most 86,400 steps (a 1 s heartbeat for a day). ``time_step_limit=None`` in the
marker lifts it."""

MODEL_FAILURES = (ModelDeadlock, ModelLivelock, ModelTimeLimit)
"""What the runtime raises when a model cannot finish; a marked test shows their report alone."""

MARKER = "xds"
FIXTURE = "xds_backend"
#: The marker's keywords: those of :class:`xds.Runtime`.
MARKER_KEYWORDS: tuple[str, ...] = tuple(
    name
    for name, param in inspect.signature(Runtime.__init__).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "xds(seed=0, backend='asyncio', event_log=True, schedule_seed=None, "
        "livelock_limit=1000000, time_limit_ns=86400e9, time_step_limit=1000000): run this "
        "async def test in xds virtual time "
        "(keywords only; the xds_backend fixture parametrises over the backends)",
    )


@pytest.fixture
def xds_backend(request: pytest.FixtureRequest) -> str:
    """The xds backend this test runs on.

    The plugin parametrises a test that takes this fixture over xds's backends (asyncio, trio),
    or over the marker's ``backend=`` only if it names one.
    """
    param = getattr(request, "param", None)
    if param is not None:
        return str(param)
    return str(_options(request.node).get("backend") or "asyncio")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    definition = metafunc.definition
    if FIXTURE not in metafunc.fixturenames or _parametrized_directly(definition, FIXTURE):
        return
    backend = _options(definition).get("backend")
    metafunc.parametrize(FIXTURE, [backend] if backend else list(BACKENDS), indirect=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Report misuse of the marker as this test's error, before any of its fixtures run."""
    if (
        isinstance(item, pytest.Function)
        and item.get_closest_marker(MARKER) is None
        and FIXTURE in item.fixturenames
        and _is_async_test(item.obj)
        and "anyio_backend" not in item.fixturenames
    ):
        pytest.fail(
            f"this async test takes the {FIXTURE} fixture but has no @pytest.mark.{MARKER}: "
            "mark it (or its class or module) so xds runs it in virtual time on that backend",
            pytrace=False,
        )
    if isinstance(item, pytest.Function) and item.get_closest_marker(MARKER) is not None:
        _check_markers(item)
        if _is_async_test(item.obj):
            _check_fixtures(item)
            if "anyio_backend" in item.fixturenames:  # anyio's plugin would run it first
                _fail(
                    "this test also uses anyio's pytest plugin (@pytest.mark.anyio or the "
                    "anyio_backend fixture), which would run it on a real event loop in "
                    "wall-clock time; drop that marker or fixture: xds runs the test through "
                    "anyio itself (the xds_backend fixture picks asyncio or trio)"
                )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None or not _is_async_test(pyfuncitem.obj):
        return None
    __tracebackhide__ = True  # a model failure is the test's failure: show the report
    options = _options(pyfuncitem)
    funcargs = pyfuncitem.funcargs
    kwargs = {name: funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    backend = funcargs.get(FIXTURE) or options.pop("backend", None) or "asyncio"
    options.pop("backend", None)  # the fixture's value, itself parametrised from the marker
    if backend != "trio":  # a marker's schedule seed is for the trio run of the test
        options.pop("schedule_seed", None)
    options.setdefault("time_limit_ns", TEST_TIME_LIMIT_NS)  # a periodic task cannot hang it
    options.setdefault("time_step_limit", TEST_TIME_STEP_LIMIT)  # nor can a fine-grained poll
    try:
        result = Runtime(backend=backend, **options).run(
            functools.partial(pyfuncitem.obj, **kwargs)
        )
    except Exception as exc:
        if pyfuncitem.config.getoption("fulltrace", False):
            raise
        _drop_runner_frames(exc)
        # Raised afresh from this (hidden) frame: pytest then has no visible frame to show for
        # a model failure and prints its report alone, rather than falling back to every frame.
        raise exc
    if result is not None:
        warnings.warn(
            pytest.PytestReturnNotNoneWarning(
                f"Test functions should return None, but {pyfuncitem.nodeid} returned "
                f"{type(result)!r}.\nDid you mean to use `assert` instead of `return`?"
            ),
            stacklevel=1,
        )
    return True


_XDS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The xds package: a ConfigError's traceback stops before it (at the caller's line)."""


def _drop_runner_frames(exc: BaseException) -> None:
    """Trim what pytest shows of a marked test's failure to the test's own story.

    ``exc``'s traceback (and those of the exceptions chained to it or grouped in it) starts at
    its first frame outside the machinery that runs a test (this plugin, xds's runtime, anyio,
    trio, asyncio): an error raised in the test keeps every frame from the test's own code
    inward. A model failure (``ModelDeadlock``, ``ModelLivelock``, ``ModelTimeLimit``), raised
    by the runtime itself, keeps none, as its report says where each task waits, and the
    cancellation the runtime delivered to stop the model is left out of its chain. A
    ``ConfigError`` ends at the last frame outside xds and that machinery: the line that passed
    the bad argument. ``--full-trace`` skips all this."""
    dirs = (*library_dirs(), os.path.dirname(__file__) + os.sep)
    cancelled = _cancellation_classes() if isinstance(exc, MODEL_FAILURES) else ()
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(dirs):
            tb = tb.tb_next
        if isinstance(current, ConfigError):  # ends at the caller's line, not inside xds
            last_own = None
            entry = tb
            while entry is not None:
                if not entry.tb_frame.f_code.co_filename.startswith((*dirs, _XDS_DIR)):
                    last_own = entry
                entry = entry.tb_next
            if last_own is not None:
                last_own.tb_next = None
        current.__traceback__ = tb
        if cancelled and isinstance(current.__context__, cancelled):
            current.__suppress_context__ = True
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)


def _cancellation_classes() -> tuple[type[BaseException], ...]:
    """The exceptions that deliver cancellation on the backends loaded."""
    classes: list[type[BaseException]] = [asyncio.CancelledError]
    trio = sys.modules.get("trio")
    if trio is not None:
        classes.append(trio.Cancelled)
    return tuple(classes)


def _options(item: pytest.Item) -> dict[str, Any]:
    """The marker keywords in force on ``item``: a test's own marker, then its class's, then
    its module's, each key taken from the closest marker that sets it."""
    options: dict[str, Any] = {}
    for node in reversed(item.listchain()):  # the test, then its class, module, ...
        marks = [m for m in node.own_markers if m.name == MARKER]
        if isinstance(node, pytest.Class):
            marks.reverse()  # pytest lists a class's inherited marks first: its own are closer
        for marker in marks:
            for key, value in marker.kwargs.items():
                options.setdefault(key, value)
    return options


def _is_async_test(obj: object) -> bool:
    return inspect.iscoroutinefunction(obj)


def _check_markers(item: pytest.Function) -> None:
    """Fail (one line, no traceback) on any misuse of the xds marker on this test."""
    for marker in item.iter_markers(MARKER):
        if marker.args:
            args = ", ".join(repr(arg) for arg in marker.args)
            hint = (
                f"; write @pytest.mark.xds(seed={marker.args[0]!r})"
                if len(marker.args) == 1 and isinstance(marker.args[0], int)
                else ""
            )
            _fail(f"takes keywords only, got positional {args}{hint}")
        for key in marker.kwargs:
            if key not in MARKER_KEYWORDS:
                close = difflib.get_close_matches(key, MARKER_KEYWORDS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                _fail(
                    f"got an unknown keyword {key!r}{hint}; "
                    f"it accepts {', '.join(MARKER_KEYWORDS)}",
                )
        backend = marker.kwargs.get("backend")
        if backend is not None and backend not in BACKENDS:
            _fail(f"got an unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    _check_stacked(item)
    options = _options(item)
    bad = None
    try:  # values too: one line now, not a traceback when the test runs
        Runtime(**{"backend": "asyncio", **options})
    except ConfigError as exc:
        bad = str(exc)
    if bad is not None:
        _fail(f"got a bad value: {bad}")
    own = any(marker.name == MARKER for marker in item.own_markers)
    inner = getattr(getattr(item.obj, "hypothesis", None), "inner_test", None)
    if own and inner is not None and _is_async_test(inner):
        _fail(
            "cannot drive a Hypothesis @given test (each example would need its own xds.run); "
            "write a plain `def` test with @given that calls xds.run(...) per example",
        )
    if own and not _is_async_test(item.obj):
        _fail(
            "needs an `async def` test, but this is a plain function; "
            "make it `async def` or remove the marker",
        )


def _check_stacked(item: pytest.Function) -> None:
    """Markers stacked on one test, class or module may repeat a keyword only with the same
    value: ``@pytest.mark.xds(seed=1)`` over ``@pytest.mark.xds(seed=2)`` is an error naming
    where they are. (Different keywords combine; a test's marker still overrides its class's
    and its module's, and a class's its base classes'.)"""
    for node in item.listchain():
        if isinstance(node, pytest.Class):
            marks = node.obj.__dict__.get("pytestmark", [])  # its own, not its bases'
            marks = [getattr(m, "mark", m) for m in (marks if isinstance(marks, list) else [marks])]
        else:
            marks = node.own_markers
        seen: dict[str, Any] = {}
        for marker in marks:
            if marker.name != MARKER:
                continue
            for key, value in marker.kwargs.items():
                if key in seen and not _same(seen[key], value):
                    # in sorted order: pytest stores decorators bottom-up, pytestmark top-down
                    first, second = sorted((f"{key}={value!r}", f"{key}={seen[key]!r}"))
                    _fail(
                        f"is stacked on {node.name} with conflicting {first} and {second}; "
                        "keep one marker (stacked markers combine, and may "
                        "repeat a keyword only with the same value)"
                    )
                seen.setdefault(key, value)


def _same(a: object, b: object) -> bool:
    """Whether two marker values agree (same type and equal; a value that cannot be compared
    is not the same)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _check_fixtures(item: pytest.Function) -> None:
    """Fail on async fixtures: each xds test is its own ``xds.run``, set up inside the test."""
    name2fixturedefs = item._fixtureinfo.name2fixturedefs
    for name in item.fixturenames:
        fixturedefs = name2fixturedefs.get(name)
        if not fixturedefs:
            continue
        func = fixturedefs[-1].func
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            _fail(
                f"does not support async fixtures, and {name!r} is one; make it a plain "
                "fixture (returning, say, a factory) and await the setup inside the test",
            )


def _parametrized_directly(definition: pytest.Function, argname: str) -> bool:
    """Whether the test's own ``@pytest.mark.parametrize`` names ``argname`` (it then wins)."""
    for marker in definition.iter_markers("parametrize"):
        argnames: str | Sequence[str] = (
            marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        )
        names = argnames.split(",") if isinstance(argnames, str) else argnames
        if argname in (name.strip() for name in names):
            return True
    return False


def _fail(message: str) -> NoReturn:
    pytest.fail(f"@pytest.mark.xds {message}", pytrace=False)
