"""Synchronisation primitives the models need and anyio does not provide."""

from __future__ import annotations

import anyio


class Barrier:
    """A reusable barrier for ``parties`` tasks (e.g. the all-ranks metadata barrier).

    ``await barrier.wait()`` returns, for each party, its arrival rank in this generation
    (0 = first, ``parties - 1`` = the one that released everyone). Works on both backends and
    releases waiters in arrival order.
    """

    def __init__(self, parties: int):
        if not isinstance(parties, int) or parties < 1:
            raise ValueError(f"a barrier needs at least one party, got {parties!r}")
        self.parties = parties
        self.generation = 0
        self._arrived = 0
        self._release = anyio.Event()

    @property
    def waiting(self) -> int:
        """Parties currently waiting in this generation."""
        return self._arrived

    async def wait(self) -> int:
        rank = self._arrived
        self._arrived += 1
        if self._arrived == self.parties:
            release = self._release
            self._arrived = 0
            self.generation += 1
            self._release = anyio.Event()
            release.set()
            await anyio.lowlevel.checkpoint()
            return rank
        release = self._release
        try:
            await release.wait()
        except BaseException:
            if not release.is_set():
                self._arrived -= 1  # a cancelled waiter leaves this generation
            raise
        return rank
