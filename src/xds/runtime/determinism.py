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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

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


def install_ordered_cancel_scopes() -> None:
    """Make anyio's asyncio cancel scopes iterate their tasks in insertion order (idempotent)."""
    from anyio._backends import _asyncio

    scope_cls: Any = _asyncio.CancelScope
    if getattr(scope_cls.__init__, _PATCHED_ATTR, False):
        return
    original_init = scope_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._tasks = OrderedSet()
        self._child_scopes = OrderedSet()

    setattr(__init__, _PATCHED_ATTR, True)
    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    scope_cls.__init__ = __init__


def ordered_cancel_scopes_installed() -> bool:
    """True if new anyio asyncio cancel scopes use :class:`OrderedSet` (checked by tests)."""
    from anyio._backends import _asyncio

    return bool(getattr(_asyncio.CancelScope.__init__, _PATCHED_ATTR, False))


def seed_trio_scheduler(seed: int) -> None:
    """Switch trio to deterministic scheduling and seed its scheduler's RNG."""
    from trio._core import _run

    _run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    _run._r.seed(seed)
