"""Worker threads have no place in a virtual-time run.

A model that hands work to a worker thread (``anyio.to_thread.run_sync``, asyncio's
``run_in_executor`` / ``asyncio.to_thread``) gets the result back when the thread finishes in
wall-clock time: meanwhile virtual time may jump any distance, or the run may be judged
deadlocked, depending on how fast the machine is. Such a run cannot be reproduced, so during an
xds run the call itself is refused (:func:`no_worker_threads`) with a :class:`ConfigError`
raised in the calling task, at a virtual instant that is the same on every run.

The refusal patches anyio's two backends' ``run_sync_in_worker_thread`` (a private detail of
anyio, which is pinned) and ``trio.to_thread.run_sync`` (a model on the trio backend may call
it directly; trio's own thread helpers, e.g. ``trio.open_file``, look it up there too) the first
time a run starts; outside runs, and in other threads, both behave as shipped.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError
from .run_depth import RunDepth

_PATCHED_ATTR = "_xds_no_worker_threads"
_runs = RunDepth()


def worker_thread_refused(what: str) -> ConfigError:
    """The error a model gets for waiting on a worker thread through ``what``."""
    return ConfigError(
        f"a model cannot wait on a worker thread ({what}): the thread's result would come back "
        "at a wall-clock moment, so virtual time (or a deadlock verdict) would depend on the "
        "machine's speed; call the function directly (it takes no virtual time) and model its "
        "duration with xds.sleep_ns if it has one",
        field="to_thread",
    )


def _install() -> None:
    from anyio._backends import _asyncio, _trio

    for backend in (_asyncio.AsyncIOBackend, _trio.TrioBackend):
        original = backend.__dict__["run_sync_in_worker_thread"].__func__
        if getattr(original, _PATCHED_ATTR, False):
            continue

        def run_sync_in_worker_thread(
            cls: Any, func: Any, *args: Any, _original: Any = original, **kwargs: Any
        ) -> Any:
            if _runs.on:
                raise worker_thread_refused("anyio.to_thread.run_sync")
            return _original(cls, func, *args, **kwargs)

        setattr(run_sync_in_worker_thread, _PATCHED_ATTR, True)
        run_sync_in_worker_thread.__wrapped__ = original  # type: ignore[attr-defined]
        backend.run_sync_in_worker_thread = classmethod(run_sync_in_worker_thread)  # type: ignore[method-assign, assignment]


def _install_trio() -> None:
    import trio.to_thread

    original = trio.to_thread.run_sync
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    async def run_sync(*args: Any, **kwargs: Any) -> Any:
        if _runs.on:
            raise worker_thread_refused("trio.to_thread.run_sync")
        return await original(*args, **kwargs)

    setattr(run_sync, _PATCHED_ATTR, True)
    trio.to_thread.run_sync = run_sync  # type: ignore[assignment]


@contextmanager
def no_worker_threads() -> Iterator[None]:
    """While an xds run is on in this thread: anyio's worker threads are refused."""
    _install()
    _install_trio()
    with _runs.entered():
        yield
