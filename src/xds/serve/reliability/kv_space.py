"""A DP's KV blocks by address: iteration checkpoints and memory-fault masking (SPEC 11.2-11.3).

:class:`xds.serve.kv.KVBlockManager` (the replay's) also knows which blocks a request holds,
in runs, and masks them; this one adds what token rollback needs: a request's blocks are a
list, and what it wrote in the current iteration is tentative until the iteration's global
commit, so a rollback can truncate it back to the last checkpoint (KV is overwritable, SPEC
11.2's idempotence condition). An on-chip memory fault masks a range of blocks for good
(CANN remaps the virtual memory around them): no later allocation lands there, and the requests
whose KV overlapped the range are returned so the caller fails them explicitly.

Blocks are conserved: free + held + masked = capacity, always (:meth:`AddressedKV.check`).
"""

from __future__ import annotations

import bisect

from ...errors import ConfigError


class AddressedKV:
    """Block-addressed KV space of one DP die. Allocation takes the lowest free block."""

    def __init__(self, capacity_blocks: int, *, block_tokens: int):
        if capacity_blocks < 1 or block_tokens < 1:
            raise ConfigError("capacity and block size must be positive", field="capacity")
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self._free = list(range(capacity_blocks))  # sorted
        self.masked: set[int] = set()
        self._blocks: dict[int, list[int]] = {}
        self._tokens: dict[int, int] = {}
        self._checkpoint: dict[int, int] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_of(self, request: int) -> list[int]:
        return list(self._blocks[request])

    def tokens(self, request: int) -> int:
        return self._tokens[request]

    def admit(self, request: int, tokens: int) -> None:
        """A new request's first ``tokens`` tokens (its prefill), committed at once."""
        if request in self._blocks:
            raise ConfigError(f"request {request} already holds KV blocks", field="request")
        self._blocks[request] = []
        self._tokens[request] = 0
        if not self.append(request, tokens):
            del self._blocks[request], self._tokens[request]
            raise ConfigError(f"request {request}: no KV blocks left for {tokens} tokens")
        self._checkpoint[request] = tokens

    def append(self, request: int, tokens: int) -> bool:
        """Write ``tokens`` more tokens (tentative until :meth:`commit`); False and no change
        if the blocks they need are not free."""
        total = self._tokens[request] + tokens
        need = -(-total // self.block_tokens) - len(self._blocks[request])
        if need > len(self._free):
            return False
        taken, self._free = self._free[:need], self._free[need:]
        self._blocks[request].extend(taken)
        self._tokens[request] = total
        return True

    def commit(self) -> None:
        """The iteration's global commit: everything written so far becomes the checkpoint."""
        self._checkpoint = dict(self._tokens)

    def restore(self) -> None:
        """Rollback: every request back to its checkpoint, blocks beyond it freed."""
        for request, tokens in self._checkpoint.items():
            keep = -(-tokens // self.block_tokens)
            extra = self._blocks[request][keep:]
            del self._blocks[request][keep:]
            self._tokens[request] = tokens
            for b in extra:
                bisect.insort(self._free, b)

    def release(self, request: int) -> None:
        """Free every (unmasked) block the request holds."""
        for b in self._blocks.pop(request):
            if b not in self.masked:
                bisect.insort(self._free, b)
        del self._tokens[request]
        self._checkpoint.pop(request, None)

    def mask(self, first: int, count: int) -> list[int]:
        """Mask blocks ``first .. first + count - 1`` for good; returns the requests whose KV
        lay there (the caller fails them; their other blocks are freed by :meth:`release`)."""
        bad = set(range(first, first + count))
        if not bad <= set(range(self.capacity)):
            raise ConfigError(
                f"blocks {first}..{first + count - 1} lie outside 0..{self.capacity - 1}",
                field="first_block",
            )
        self.masked |= bad
        self._free = [b for b in self._free if b not in bad]
        return sorted(r for r, blocks in self._blocks.items() if bad.intersection(blocks))

    def check(self) -> None:
        """Conservation and isolation: free + held + masked = capacity; no masked block is
        free or newly held; no block is held twice."""
        held = [b for blocks in self._blocks.values() for b in blocks if b not in self.masked]
        if len(held) != len(set(held)) or set(held) & set(self._free):
            raise AssertionError("a KV block is held twice or held and free")
        if self.masked & set(self._free):
            raise AssertionError("a masked KV block is free")
        if len(held) + len(self._free) + len(self.masked) != self.capacity:
            raise AssertionError(
                f"KV blocks not conserved: held {len(held)} + free {len(self._free)} + masked "
                f"{len(self.masked)} != {self.capacity}"
            )
