"""Naming the tasks that wait when a model deadlocks."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from xds.errors import WaitingTask

_LIBRARY_PACKAGES = ("asyncio", "anyio", "trio", "outcome", "sniffio")
_RUNTIME_DIR = os.path.dirname(__file__) + os.sep
_XDS_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep


_LIBRARY_MODULES = ("contextlib", "functools")
"""Standard-library modules whose frames are plumbing too (async context managers)."""


def library_dirs() -> tuple[str, ...]:
    """Directory (and file) prefixes of frames that are not the model's own."""
    dirs = [_RUNTIME_DIR]
    for name in _LIBRARY_PACKAGES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(module.__file__) + os.sep)
    for name in _LIBRARY_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(module.__file__)
    return tuple(dirs)


def _is_library(filename: str, dirs: tuple[str, ...]) -> bool:
    return filename.startswith(dirs)


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_qualname}"


def _describe_frames(frames: list[FrameType]) -> tuple[str, str, str, bool, bool]:
    """(innermost model frame, innermost library call, innermost frame of the user's own
    code when the model frame is inside xds, whether any frame is the user's own, whether any
    frame is the model's) for a task's await chain. A task with no model frame (started
    directly on a library call: ``tg.start_soon(event.wait)``) is placed at its entry: the
    first frame outside the async libraries (an xds primitive such as ``Barrier.wait``), or
    the innermost one."""
    dirs = library_dirs()
    waiting_in = ""
    waiting_on = ""
    user = ""
    for frame in frames:
        code = frame.f_code
        if _is_library(code.co_filename, dirs):
            if waiting_on:
                continue  # keep the outermost library call below the model's frame
            waiting_on = code.co_qualname
        else:
            waiting_in = _where(frame)
            waiting_on = ""
            if not code.co_filename.startswith(_XDS_DIR):
                user = waiting_in
    model = bool(waiting_in)
    if not model:
        plumbing = tuple(d for d in dirs if d != _RUNTIME_DIR)
        entry = next((f for f in frames if not _is_library(f.f_code.co_filename, plumbing)), None)
        if entry is None and frames:  # the call the task was started on, below the
            entry = frames[1] if len(frames) > 1 else frames[0]  # task runner's wrapper
        waiting_in = _where(entry) if entry is not None else "<unknown>"
        inner = frames[-1].f_code.co_qualname if frames else ""
        waiting_on = inner if entry is not None and inner != entry.f_code.co_qualname else ""
    called_from = user if user and user != waiting_in else ""
    return waiting_in, waiting_on, called_from, bool(user), model


def _coroutine_frames(coro: Any) -> list[FrameType]:
    frames: list[FrameType] = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


NoteEntry = tuple[str | Callable[[], str]]
"""One open :func:`xds.waiting_for` block's note (a 1-tuple, so each block's entry is found by
identity even when two blocks say the same text)."""

Notes = dict[int, list[NoteEntry]]
"""Task id -> what it waits for (:func:`xds.waiting_for`): one entry per open block, outermost
first."""

NOTE_SEPARATOR = " > "
"""Between nested notes of one task, outermost first."""


def _note(what: str | Callable[[], str]) -> str:
    """A waiting note as text; a note that fails to render says so instead of hiding the
    deadlock report behind its own error."""
    if isinstance(what, str):
        return what
    try:
        return str(what())
    except Exception as exc:  # the report must still be raised
        return f"<the note could not be rendered: {type(exc).__name__}: {exc}>"


def _notes(entries: list[NoteEntry]) -> str:
    """A task's nested notes as one line, outermost first (empty notes left out)."""
    texts = (_note(entry[0]) for entry in entries)
    return NOTE_SEPARATOR.join(text for text in texts if text)


Waiting = tuple[WaitingTask, bool]
"""A waiting task and whether it is the model's (see :func:`_model_tasks`)."""


def _waiting(name: str, where: tuple[str, str, str, bool, bool], notes: list[NoteEntry]) -> Waiting:
    waiting_in, waiting_on, called_from, own, model = where
    task = WaitingTask(name, waiting_in, waiting_on, called_from, _notes(notes), own)
    return task, model or bool(task.waiting_for) or not _plumbing_named(name)


def _model_tasks(tasks: list[Waiting]) -> list[WaitingTask]:
    """Drop tasks that are pure event-loop plumbing (no frame of the model's code, nothing
    said about what they wait for, and a name the event loop gave them: asyncio's ``Task-N``,
    trio's ``<...>``), unless nothing else is left. A task started on a library call
    (``tg.start_soon(event.wait)``, named by anyio after it) is the model's: it is kept."""
    tasks.sort(key=lambda t: (t[0].name, t[0].waiting_in, t[0].waiting_for, t[0].called_from))
    model = [w for w, keep in tasks if keep]
    return model or [w for w, _ in tasks]


def _plumbing_named(name: str) -> bool:
    """asyncio's ``Task-N`` and trio's ``<...>`` system tasks."""
    return name.startswith(("Task-", "<"))


def waiting_asyncio_tasks(
    loop: asyncio.AbstractEventLoop, notes: Notes | None = None
) -> list[WaitingTask]:
    """Every unfinished asyncio task of ``loop``, sorted by name (deterministic message), with
    what it said it waits for (``notes``: task id -> text, :func:`xds.waiting_for`)."""
    notes = notes or {}
    out = []
    for task in asyncio.all_tasks(loop):
        if task.done():
            continue
        where = _describe_frames(_coroutine_frames(task.get_coro()))
        out.append(_waiting(task.get_name(), where, notes.get(id(task), [])))
    return _model_tasks(out)


def _trio_tasks() -> list[Any]:
    import trio

    tasks = []
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        if task is None:
            continue
        tasks.append(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return tasks


def interrupt_blocked_trio_tasks(make_error: Callable[[], BaseException]) -> None:
    """Raise ``make_error()`` inside every blocked model task, through shields.

    Last resort after a deadlock the root cancel scope could not reach (private trio API:
    ``Task._attempt_abort``, the path trio itself uses to deliver cancellation).
    """
    for task in sorted(_trio_tasks(), key=lambda t: t.name):
        if task.name.startswith("<") or task._abort_func is None:
            continue

        def raise_error() -> None:
            raise make_error()

        task._attempt_abort(raise_error)


def waiting_trio_tasks(notes: Notes | None = None) -> list[WaitingTask]:
    """Every task below trio's root task, sorted by name (called from inside the run loop),
    with what it said it waits for (``notes``, as for :func:`waiting_asyncio_tasks`)."""
    notes = notes or {}
    out = []
    for task in _trio_tasks():
        if task.name.startswith("<"):
            continue  # trio's own system tasks (<init>, <TrioToken.run_sync_soon task>)
        frames = [frame for frame, _ in task.iter_await_frames()]
        if not frames:
            continue
        out.append(_waiting(task.name, _describe_frames(frames), notes.get(id(task), [])))
    return _model_tasks(out)
