"""KV-cache blocks of one DP group (SPEC 6, 10.2).

Capacity is the HBM left after the model's weights and a reserved workspace, divided into
blocks of ``block_tokens`` tokens. A request holds ``ceil(tokens / block_tokens)`` blocks; it
grows one block at a time as it decodes and gives everything back when it ends. Blocks have
addresses: a request holds extents (runs of block indices), taken lowest address first (paged:
they need not be contiguous), so an on-chip memory fault can find whose KV lay in the bad range
(:meth:`KVBlockManager.mask`, SPEC 11.2 stage 3). Blocks are conserved: free + held + masked
(and not held) = capacity, always.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from ..errors import ConfigError
from ..hw import DieSpec
from ..model import ModelSpec

WORKSPACE_FRACTION = 0.1
"""HBM share kept for activations and communication buffers. [emulator choice]"""


def kv_capacity_blocks(
    model: ModelSpec,
    die: DieSpec,
    *,
    weight_bytes: int,
    block_tokens: int = 128,
    int8_nope: bool = True,
    workspace_fraction: float = WORKSPACE_FRACTION,
    mtp: bool = False,
    tp: int = 1,
) -> int:
    """Blocks that fit in one die's HBM after ``weight_bytes`` of weights and a workspace
    (activations, communication buffers: ``workspace_fraction`` of HBM, an emulator choice),
    the die being one of ``tp`` attention ranks that share a block's tokens
    (:meth:`~xds.model.ModelSpec.kv_rank_share`: MLA's latent is replicated on every rank,
    GQA's KV heads are split over them)."""
    free = die.hbm_bytes * (1 - workspace_fraction) - weight_bytes
    if free <= 0:
        raise ConfigError(
            f"{weight_bytes / 2**30:.1f} GiB of weights leave no room for KV on "
            f"a {die.hbm_bytes / 2**30:.0f} GiB die",
            field="weight_bytes",
        )
    per_block = model.kv_bytes_per_token(int8_nope=int8_nope, mtp=mtp) * block_tokens
    if tp > 1:
        per_block *= model.kv_rank_share(tp)
    return int(free // per_block)


class KVBlockManager:
    """Block accounting of one DP group."""

    def __init__(self, capacity_blocks: int, *, block_tokens: int = 128):
        if capacity_blocks < 0 or block_tokens < 1:
            raise ConfigError(
                "capacity must be >= 0 blocks and block size >= 1 token", field="capacity"
            )
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self.free = capacity_blocks
        self._held: dict[object, int] = {}
        self._tokens: dict[object, int] = {}
        self._free_runs: list[tuple[int, int]] = [(0, capacity_blocks)] if capacity_blocks else []
        """Free block runs ``(start, end)``, sorted and disjoint (adjacent ones merged)."""
        self._runs: dict[object, list[tuple[int, int]]] = {}
        self.masked: list[tuple[int, int]] = []
        """Block ranges an on-chip memory fault masked for good."""

    def _take(self, request: object, need: int) -> None:
        runs = self._runs.setdefault(request, [])
        while need:
            start, end = self._free_runs[0]
            n = min(need, end - start)
            if n == end - start:
                self._free_runs.pop(0)
            else:
                self._free_runs[0] = (start + n, end)
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + n)
            else:
                runs.append((start, start + n))
            need -= n

    def _give(self, start: int, end: int) -> None:
        """Return blocks ``start .. end - 1`` to the free runs, except masked ones."""
        for m_start, m_end in self.masked:
            if m_start < end and start < m_end:  # cut the masked part out
                if start < m_start:
                    self._give(start, m_start)
                if m_end < end:
                    self._give(m_end, end)
                return
        i = bisect.bisect_left(self._free_runs, (start, end))
        if i and self._free_runs[i - 1][1] == start:
            i -= 1
            start = self._free_runs.pop(i)[0]
        if i < len(self._free_runs) and self._free_runs[i][0] == end:
            end = self._free_runs.pop(i)[1]
        self._free_runs.insert(i, (start, end))

    @property
    def used(self) -> int:
        return self.capacity - self.free

    @property
    def held_blocks(self) -> int:
        """Blocks requests hold (``used`` also counts masked ones)."""
        return sum(self._held.values())

    @property
    def usable(self) -> int:
        """Blocks not masked by a memory fault (free or held)."""
        covered, end = 0, 0
        for s, e in sorted(self.masked):  # faults may overlap: count each block once
            covered += max(0, e - max(s, end))
            end = max(end, e)
        return self.capacity - covered

    def could_ever_admit(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` tokens fits once everything else is released."""
        return self.blocks_for(tokens) <= self.usable

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def can_admit(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.free

    def admit(self, request: object, tokens: int) -> None:
        """Hold blocks for ``tokens`` tokens of a new request (raises if they do not fit)."""
        if request in self._held:
            raise ConfigError(f"request {request!r} already holds KV blocks", field="request")
        if tokens < 0:
            raise ConfigError(f"tokens must be >= 0, got {tokens}", field="tokens")
        need = self.blocks_for(tokens)
        if need > self.free:
            raise ConfigError(
                f"request {request!r} needs {need} KV blocks, {self.free} free", field="tokens"
            )
        self.free -= need
        self._held[request] = need
        self._tokens[request] = tokens
        self._take(request, need)

    def extend(self, request: object, new_tokens: int) -> bool:
        """Append ``new_tokens`` tokens; False (nothing changed) if a needed block is not free."""
        if new_tokens < 0:
            raise ConfigError(f"new_tokens must be >= 0, got {new_tokens}", field="new_tokens")
        tokens = self._tokens[request] + new_tokens
        need = self.blocks_for(tokens) - self._held[request]
        if need > self.free:
            return False
        self.free -= need
        self._held[request] += need
        self._tokens[request] = tokens
        self._take(request, need)
        return True

    def release(self, request: object) -> int:
        """Free everything the request holds; returns the blocks freed."""
        blocks = self._held.pop(request)
        del self._tokens[request]
        for start, end in self._runs.pop(request, []):
            self._give(start, end)
        if self.masked:  # masked blocks among them stay out of the free runs
            self.free = sum(end - start for start, end in self._free_runs)
        else:
            self.free += blocks
        return blocks

    def blocks_of(self, request: object) -> list[tuple[int, int]]:
        """The block runs ``(start, end)`` the request holds."""
        return list(self._runs.get(request, []))

    def mask(self, first: int, count: int) -> list[object]:
        """An on-chip memory fault: blocks ``first .. first + count - 1`` are masked for good
        (CANN remaps the virtual memory around them; no later allocation lands there). Returns
        the requests whose KV lay there, in admission order: the caller fails them explicitly
        (their other blocks come back when they are released)."""
        end = first + count
        if count < 1 or first < 0 or end > self.capacity:
            raise ConfigError(
                f"blocks {first}..{end - 1} lie outside this DP's 0..{self.capacity - 1}",
                field="first_block",
            )
        hit = [r for r, runs in self._runs.items() if any(s < end and first < e for s, e in runs)]
        self.masked.append((first, end))
        runs, self._free_runs = self._free_runs, []
        for s, e in runs:  # rebuild without the masked range
            self._give(s, e)
        self.free = sum(e - s for s, e in self._free_runs)
        return hit

    def held(self, request: object) -> int:
        return self._held.get(request, 0)

    def holds(self, request: object) -> bool:
        """Whether the request was admitted and not yet released (even with 0 blocks)."""
        return request in self._held

    def check(self) -> None:
        """Conservation: free + held + masked-and-not-held == capacity; every block is in
        exactly one of them (no masked block is free)."""
        held = sum(self._held.values())
        owner = np.zeros(self.capacity + 1, dtype=np.int64)  # runs covering each block
        masked = np.zeros(self.capacity + 1, dtype=np.int64)
        for runs in (self._free_runs, *self._runs.values()):
            for s, e in runs:
                owner[s] += 1
                owner[e] -= 1
        for s, e in self.masked:
            masked[s] += 1
            masked[e] -= 1
        owner, masked = np.cumsum(owner)[:-1], np.cumsum(masked)[:-1] > 0
        free_masked = any(masked[s:e].any() for s, e in self._free_runs)
        unheld_masked = int((masked & (owner == 0)).sum())
        if (
            self.free + held + unheld_masked != self.capacity
            or self.free != sum(e - s for s, e in self._free_runs)
            or bool((owner > 1).any())
            or free_masked
            or held != sum(e - s for runs in self._runs.values() for s, e in runs)
        ):
            raise AssertionError(
                f"KV blocks not conserved: free {self.free} + held {held} + masked "
                f"{unheld_masked} != {self.capacity} (or a block is in two places)"
            )
