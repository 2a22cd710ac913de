"""AIV occupancy: a die's vector cores as a weighted FIFO semaphore (SPEC 3.7)."""

from __future__ import annotations

from collections import deque

import anyio

from ...errors import ConfigError


class AivPool:
    """The AIVs of one die. A kernel takes ``n`` of them at launch and gives them back at
    return; kernels that cannot get their AIVs wait, first come first served."""

    def __init__(self, die: int, total: int):
        self.die = die
        self.total = total
        self.free = total
        self._waiters: deque[tuple[int, anyio.Event]] = deque()

    @property
    def busy(self) -> int:
        return self.total - self.free

    async def acquire(self, n: int) -> None:
        if not 1 <= n <= self.total:
            raise ConfigError(
                f"n_aiv must be 1..{self.total} on die {self.die}, got {n}", field="n_aiv"
            )
        if not self._waiters and self.free >= n:
            # a cancellation must not land between taking the AIVs and returning them
            await anyio.lowlevel.checkpoint_if_cancelled()
            self.free -= n
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return
        granted = anyio.Event()
        entry = (n, granted)
        self._waiters.append(entry)
        try:
            await granted.wait()
        except BaseException:
            if granted.is_set():
                self.release(n)
            else:
                self._waiters.remove(entry)
                self._grant()
            raise

    def release(self, n: int) -> None:
        self.free += n
        if self.free > self.total:
            raise RuntimeError(f"die {self.die}: released more AIVs than were taken")
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            n, granted = self._waiters.popleft()
            self.free -= n
            granted.set()
