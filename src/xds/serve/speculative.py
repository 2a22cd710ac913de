"""Speculative evaluation for sequential searches: guess the next points, evaluate them in
worker processes while the current one runs, keep only the points the search asks for.

A search like :func:`~xds.serve.capacity.search_capacity` visits points one after another, each
decided by the last result. :class:`Speculator` lets it say which points it may ask for next
(:meth:`Speculator.ahead`) so idle cores evaluate them in advance; :meth:`Speculator.get` then
returns a point's value, from a worker if one computed it, else computed in this process. The
search sees exactly the values it would have computed alone, in the same order: only the wall
time changes with ``jobs``. Guesses that the search never asks for are thrown away.

Each guess runs in a process forked from this one for it (``multiprocessing`` "fork"
context), so ``evaluate`` may be a closure over anything, including user policies; each
evaluation must be deterministic and free of side effects the search relies on (a replay in
virtual time is). A guess sends its value back on a pipe of its own, so stopping a guess (a
kill) can never leave a lock held that another guess or this process waits on (a
``multiprocessing.Pool`` terminated while a worker writes a result can hang). Where fork is not
available, or with ``jobs=1``, everything runs in this process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_EVALUATE: Callable[[float], Any] | None = None
"""The function the forked workers call (set before they fork; a closure cannot be pickled)."""


def default_jobs() -> int:
    """One worker per core (at most 4: each worker holds a whole replay in memory)."""
    return max(1, min(4, os.cpu_count() or 1))


def _evaluate_in_worker(x: float, conn: multiprocessing.connection.Connection, parent: int) -> None:
    """A forked guess: its value (or that it failed) on ``conn``."""
    assert _EVALUATE is not None
    _die_with_parent(parent)
    try:
        value = _EVALUATE(x)
    except Exception:  # recomputed in the parent, where the error surfaces as itself
        conn.send((False, None))
    else:
        conn.send((True, value))
    finally:
        conn.close()


def _die_with_parent(parent: int) -> None:
    """In a forked guess: SIGTERM ends it plainly (not through a handler its parent set), and
    on Linux the kernel kills it when its parent dies (PR_SET_PDEATHSIG), so a parent killed
    without the chance to stop it leaves no orphan computing on."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no prctl here: the parent's kill still stops it
            return
        if os.getppid() != parent:  # it died before the call: nothing will signal this one
            os._exit(1)


class _Guess:
    """One guess running in a process of its own, its value coming back on its own pipe."""

    def __init__(self, context: Any, x: float):
        self._conn, send = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_evaluate_in_worker, args=(x, send, os.getpid()), daemon=True
        )
        self._process.start()
        send.close()  # (the child holds its end: EOF here once it is gone)

    def ready(self) -> bool:
        """Whether its value (or its end) has arrived."""
        return self._conn.poll()

    def get(self) -> tuple[bool, Any]:
        """(True, value), or (False, None) if it failed or died."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return False, None
        finally:
            self._conn.close()
            self._process.join()

    def stop(self) -> None:
        self._process.kill()
        self._process.join()
        self._conn.close()


class Speculator(Generic[T]):
    """``evaluate`` at points the caller asks for, ahead of time on up to ``jobs`` processes."""

    def __init__(self, evaluate: Callable[[float], T], jobs: int = 1):
        global _EVALUATE
        self.evaluate = evaluate
        self.jobs = jobs
        self._context: Any = None
        self._pending: dict[float, _Guess] = {}
        self.speculated = 0
        """Points evaluated in workers (used or not)."""
        if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
            _EVALUATE = evaluate
            self._context = multiprocessing.get_context("fork")

    def ahead(self, xs: Sequence[float]) -> None:
        """Points the search may ask for next, most likely first: start as many as there are
        idle workers (a point already started or done is not started again)."""
        if self._context is None:
            return
        running = sum(1 for r in self._pending.values() if not r.ready())
        for x in xs:
            if running >= self.jobs:
                break
            if x in self._pending:
                continue
            self._pending[x] = _Guess(self._context, x)
            self.speculated += 1
            running += 1

    def get(self, x: float) -> T:
        """The value at ``x``: a worker's if one computed it without error, else computed here
        (so an error is raised here, as itself)."""
        pending = self._pending.pop(x, None)
        if pending is not None:
            ok, value = pending.get()
            if ok:
                return value
        return self.evaluate(x)

    def close(self) -> None:
        """Stop the workers (guesses still running are abandoned)."""
        global _EVALUATE
        for guess in self._pending.values():
            guess.stop()
        self._pending.clear()
        if self._context is not None:
            self._context = None
            _EVALUATE = None

    def __enter__(self) -> Speculator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
