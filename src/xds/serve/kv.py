"""KV-cache blocks of one DP group (SPEC 6, 10.2).

Capacity is the HBM left after the model's weights and a reserved workspace, divided into
blocks of ``block_tokens`` tokens. A request holds ``ceil(tokens / block_tokens)`` blocks; it
grows one block at a time as it decodes and gives everything back when it ends. Blocks are
conserved: free + held = capacity, always.
"""

from __future__ import annotations

import math

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
) -> int:
    """Blocks that fit in one die's HBM after ``weight_bytes`` of weights and a workspace
    (activations, communication buffers: ``workspace_fraction`` of HBM, an emulator choice)."""
    free = die.hbm_bytes * (1 - workspace_fraction) - weight_bytes
    if free <= 0:
        raise ConfigError(
            f"{weight_bytes / 2**30:.1f} GiB of weights leave no room for KV on "
            f"a {die.hbm_bytes / 2**30:.0f} GiB die",
            field="weight_bytes",
        )
    per_block = model.kv_bytes_per_token(int8_nope=int8_nope) * block_tokens
    return int(free // per_block)


class KVBlockManager:
    """Block accounting of one DP group."""

    def __init__(self, capacity_blocks: int, *, block_tokens: int = 128):
        if capacity_blocks < 0 or block_tokens < 1:
            raise ConfigError("capacity and block size must be positive", field="capacity")
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self.free = capacity_blocks
        self._held: dict[object, int] = {}
        self._tokens: dict[object, int] = {}

    @property
    def used(self) -> int:
        return self.capacity - self.free

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
        return True

    def release(self, request: object) -> int:
        """Free everything the request holds; returns the blocks freed."""
        blocks = self._held.pop(request)
        del self._tokens[request]
        self.free += blocks
        return blocks

    def held(self, request: object) -> int:
        return self._held.get(request, 0)

    def holds(self, request: object) -> bool:
        """Whether the request was admitted and not yet released (even with 0 blocks)."""
        return request in self._held

    def check(self) -> None:
        """Conservation: free + held == capacity."""
        held = sum(self._held.values())
        if self.free + held != self.capacity or self.free < 0:
            raise AssertionError(
                f"KV blocks not conserved: free {self.free} + held {held} != {self.capacity}"
            )
