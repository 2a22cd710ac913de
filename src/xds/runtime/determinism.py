"""Making the two backends' scheduling deterministic (ARCHITECTURE.md, "Determinism").

Two measured traps, each fixed here and checked by tests:

1. anyio's asyncio backend keeps a cancel scope's tasks and child scopes in ``set``s and delivers
   cancellation by iterating them, i.e. in memory-address order, which changes from run to run.
   :func:`install_ordered_cancel_scopes` makes new cancel scopes keep both collections in
   insertion order, so cancellation is delivered in the order tasks entered the scope. This
   relies on a private detail of anyio (the ``_tasks`` / ``_child_scopes`` attributes set in
   ``CancelScope.__init__``); the anyio version is pinned and a test fails if the detail moves.
2. trio shuffles each batch of runnable tasks with a module-level ``random.Random`` and breaks
   deadline ties by object id. Its deterministic scheduling mode (the one its own test suite and
   its Hypothesis plugin use) sorts each batch by task creation order before a *seeded* shuffle,
   which makes both irrelevant. :func:`seed_trio_scheduler` turns it on and seeds it; sweeping
   that seed is a cheap schedule fuzzer.

Both fixes hold only while an xds run is on (:func:`asyncio_run_scope`, :func:`trio_run_scope`):
outside runs anyio's cancel scopes and trio's scheduler behave as the libraries ship them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from .run_depth import RunDepth

T = TypeVar("T")


class OrderedSet(Generic[T]):
    """The subset of ``set`` that anyio's cancel scopes use, iterating in insertion order."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[T] = ()):
        self._items: dict[T, None] = dict.fromkeys(items)

    def add(self, item: T) -> None:
        self._items[item] = None

    def discard(self, item: T) -> None:
        self._items.pop(item, None)

    def remove(self, item: T) -> None:
        del self._items[item]

    def pop(self) -> T:
        item = next(iter(self._items))
        del self._items[item]
        return item

    def clear(self) -> None:
        self._items.clear()

    def copy(self) -> OrderedSet[T]:
        return OrderedSet(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __repr__(self) -> str:
        return f"OrderedSet({list(self._items)!r})"


_PATCHED_ATTR = "__xds_ordered__"
_runs = RunDepth()
"""``depth``: xds asyncio runs on in this thread (a run's loop runs in the thread that called
it; a nested measurement runs in a helper thread of its own)."""


def install_ordered_cancel_scopes() -> None:
    """Make anyio's asyncio cancel scopes created during an xds run (:func:`asyncio_run_scope`)
    iterate their tasks in insertion order; others are anyio's own (idempotent)."""
    from anyio._backends import _asyncio

    scope_cls: Any = _asyncio.CancelScope
    if getattr(scope_cls.__init__, _PATCHED_ATTR, False):
        return
    original_init = scope_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if _runs.on:
            self._tasks = OrderedSet()
            self._child_scopes = OrderedSet()

    setattr(__init__, _PATCHED_ATTR, True)
    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    scope_cls.__init__ = __init__


def ordered_cancel_scopes_installed() -> bool:
    """True if anyio's asyncio cancel scopes are patched (checked by tests); they use
    :class:`OrderedSet` only while an xds run is on (:func:`ordered_cancel_scopes_active`)."""
    from anyio._backends import _asyncio

    return bool(getattr(_asyncio.CancelScope.__init__, _PATCHED_ATTR, False))


def ordered_cancel_scopes_active() -> bool:
    """True if cancel scopes created now, in this thread, keep their tasks in order."""
    return ordered_cancel_scopes_installed() and _runs.on


@contextmanager
def asyncio_run_scope() -> Iterator[None]:
    """While an xds asyncio run is on: anyio cancel scopes it creates keep insertion order."""
    install_ordered_cancel_scopes()
    with _runs.entered():
        yield


def seed_trio_scheduler(seed: int) -> None:
    """Switch trio to deterministic scheduling and seed its scheduler's RNG."""
    from trio._core import _run

    _run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    _run._r.seed(seed)


@contextmanager
def trio_run_scope(seed: int) -> Iterator[None]:
    """While an xds trio run is on: trio's deterministic scheduling, seeded with ``seed``.
    Leaving restores the flag and the scheduler RNG's state as they were (so a nested run, in a
    helper thread while the outer run waits, leaves the outer run's schedule as it was)."""
    from trio._core import _run

    flag, state = _run._ALLOW_DETERMINISTIC_SCHEDULING, _run._r.getstate()
    seed_trio_scheduler(seed)
    try:
        yield
    finally:
        _run._ALLOW_DETERMINISTIC_SCHEDULING = flag  # type: ignore[misc]
        _run._r.setstate(state)
