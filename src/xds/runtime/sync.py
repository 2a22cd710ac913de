"""Synchronisation primitives the models need and anyio does not provide."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..config import require_int
from .core import waiting_for

T = TypeVar("T")


@contextlib.asynccontextmanager
async def task_group_raising_single() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group that re-raises a lone failure as itself: a protocol error or a user
    policy's error reaches the caller as that error, not wrapped in an exception group
    (several failures still come as the group)."""
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        leaves = leaf_exceptions(group)
        if len(leaves) == 1:
            leaf = leaves[0]
            for note in _group_notes(group):  # what was said of the group holds for it
                if note not in getattr(leaf, "__notes__", ()):
                    leaf.add_note(note)
            raise leaf from None
        raise


def _group_notes(group: BaseExceptionGroup) -> list[str]:
    """The notes on ``group`` and on the groups nested in it, outermost first."""
    notes: list[str] = []
    stack: list[BaseException] = [group]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            notes.extend(getattr(e, "__notes__", ()))
            stack.extend(reversed(e.exceptions))
    return notes


class Streams:
    """The memory object streams a component creates, closed together when it is done: an
    end garbage-collected open makes anyio warn (``ResourceWarning``), and a test run with
    ``-W error`` fail."""

    def __init__(self) -> None:
        self._ends: list[MemoryObjectSendStream[Any] | MemoryObjectReceiveStream[Any]] = []

    def create(
        self, kind: type[T], max_buffer_size: float = 0
    ) -> tuple[MemoryObjectSendStream[T], MemoryObjectReceiveStream[T]]:
        """A stream of ``kind`` items (``anyio.create_memory_object_stream``), kept to close."""
        send, recv = anyio.create_memory_object_stream[kind](max_buffer_size)  # type: ignore[valid-type]
        self._ends += (send, recv)
        return send, recv

    def close(self) -> None:
        """Close every end created so far (once the tasks that use them are done)."""
        for end in self._ends:
            end.close()
        self._ends.clear()


def leaf_exceptions(group: BaseExceptionGroup) -> list[BaseException]:
    """The non-group exceptions inside ``group``, depth first."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(leaf_exceptions(exc))
        else:
            out.append(exc)
    return out


class Barrier:
    """A reusable barrier for ``parties`` tasks (e.g. the all-ranks metadata barrier).

    ``await barrier.wait()`` returns, for each party, its arrival rank in this generation
    (0 = first, ``parties - 1`` = the one that released everyone). A waiter cancelled before
    the release leaves the generation; one cancelled at the instant of the release has passed
    and returns its rank (its cancellation comes back at its next checkpoint). Ranks are given
    out at release time, so they are always ``0 .. parties - 1``. Works on both backends (on
    trio, waiters released together resume in trio's seeded order).
    """

    def __init__(self, parties: int):
        self.parties = require_int(parties, "parties", low=1)
        self.generation = 0
        self._waiters: list[object] = []
        self._release = anyio.Event()
        self._ranks: dict[object, int] = {}  # filled when this generation is released

    @property
    def waiting(self) -> int:
        """Parties currently waiting in this generation."""
        return len(self._waiters)

    async def wait(self) -> int:
        token = object()
        self._waiters.append(token)
        release, ranks = self._release, self._ranks
        if len(self._waiters) == self.parties:
            ranks.update((t, i) for i, t in enumerate(self._waiters))
            self._waiters = []
            self.generation += 1
            self._release, self._ranks = anyio.Event(), {}
            release.set()
            await anyio.lowlevel.checkpoint()
            return ranks.pop(token)
        try:
            with waiting_for(
                lambda: (
                    f"Barrier generation {self.generation}: "
                    f"{len(self._waiters)} of {self.parties} parties arrived"
                )
            ):
                await release.wait()
        except anyio.get_cancelled_exc_class():
            if not release.is_set():
                self._waiters.remove(token)  # a cancelled waiter leaves this generation
                raise
            # released at the instant it was cancelled: it passed (it was counted); the
            # cancellation, level-triggered, comes back at its next checkpoint
        except BaseException:
            if not release.is_set():
                self._waiters.remove(token)
            raise
        return ranks.pop(token)
