"""Per-die device memory: application, metadata and managed regions (SPEC 3.2).

Each die's memory is three regions. Buffers are allocated lazily, so a 768-die pod allocates
only what a run touches; in ``size`` payload mode nothing is allocated at all and only byte
counts move (same protocol, same timing; ARCHITECTURE.md "Payload modes").

* **application**: the serving engine's tensors (KV cache, activations); ``app_bytes`` per die.
* **metadata**: 32-byte fields (SPEC 3.2 layout, little-endian):
  ``u64 eventID | u32 chunkID | u32 flags | u64 tailPtr | u64 ack``, one per (peer die, AIV
  index, direction). SPEC 3.2 counts 384 x 2 x 48 x 2 fields and leaves the last x2 open
  (A6); xds reads it as the two directions: the ``RX`` field is written by the peer as a sender
  (eventID, chunkID, tailPtr of data coming in), the ``TX`` field by the peer as a receiver
  (the ``ack`` credits and final ACK of data going out). Without it, a die sending to and
  receiving from the same peer would overwrite its own protocol state.
* **managed**: a ring of ``ring_slots`` slots of ``slot_bytes`` per peer die.
"""

from __future__ import annotations

import mmap
import struct
from enum import IntEnum, StrEnum
from typing import Literal

import anyio

from ..errors import ConfigError

PayloadMode = Literal["bytes", "size"]
META_FORMAT = struct.Struct("<QIIQQ")
META_FIELD_BYTES = META_FORMAT.size  # 32
assert META_FIELD_BYTES == 32


class Region(StrEnum):
    APP = "app"
    META = "meta"
    MANAGED = "managed"


class Direction(IntEnum):
    RX = 0
    """Field written by the peer as sender: the state of data arriving from the peer."""
    TX = 1
    """Field written by the peer as receiver: credits and ACKs of data sent to the peer."""
    COLL = 2
    """Collective metadata written by the peer (SPEC 4.2): eventID, token count (in chunkID)
    and the offset of this die's block in the peer's managed area (in tailPtr)."""


class MetaField:
    """One 32-byte metadata field; readers can wait for it to change (no busy polling)."""

    __slots__ = ("_changed", "ack", "chunk_id", "event_id", "flags", "tail_ptr")

    def __init__(self) -> None:
        self.event_id = 0
        self.chunk_id = 0
        self.flags = 0
        self.tail_ptr = 0
        self.ack = 0
        self._changed: anyio.Event | None = None

    def pack(self) -> bytes:
        """The field's 32 bytes, in SPEC 3.2's little-endian layout."""
        return META_FORMAT.pack(self.event_id, self.chunk_id, self.flags, self.tail_ptr, self.ack)

    def notify(self) -> None:
        """Wake every task waiting for this field to change."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def changed(self) -> None:
        """Wait until the next visible write to this field."""
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()


class DieMemory:
    """Device memory of one die."""

    def __init__(
        self, die: int, *, mode: PayloadMode, app_bytes: int, ring_slots: int, slot_bytes: int
    ):
        self.die = die
        self.mode = mode
        self.app_bytes = app_bytes
        self.ring_slots = ring_slots
        self.slot_bytes = slot_bytes
        self._app: mmap.mmap | None = None
        self._slots: dict[tuple[int, int], bytearray] = {}
        self._meta: dict[tuple[int, int, int], MetaField] = {}

    # -- regions -----------------------------------------------------------------------------
    @property
    def app(self) -> memoryview:
        """The application region (bytes mode only): anonymous memory, zero-filled by the
        OS page by page as it is first touched, so a die costs host memory (and time to
        clear it) only for the bytes a run writes, not for the whole region."""
        self._require_bytes("the application region")
        if self._app is None:
            try:
                self._app = mmap.mmap(-1, self.app_bytes)
            except (MemoryError, OSError):
                raise ConfigError(
                    f"bytes mode holds each die's application region in host memory, and "
                    f"{self.app_bytes:,} bytes do not fit: a smaller app_bytes, or "
                    "payload_mode = 'size' (timing only)",
                    field="fabric.app_bytes",
                ) from None
        return memoryview(self._app)

    def slot(self, peer: int, slot: int) -> memoryview:
        """Slot ``slot`` of the managed ring this die holds for messages from ``peer``
        (bytes mode only; each slot is allocated when first touched)."""
        self._require_bytes("a managed ring")
        if not 0 <= slot < self.ring_slots:
            raise IndexError(f"ring slot {slot} out of range 0..{self.ring_slots - 1}")
        key = (peer, slot)
        buf = self._slots.get(key)
        if buf is None:
            buf = self._slots[key] = bytearray(self.slot_bytes)
        return memoryview(buf)

    def meta(self, peer: int, aiv: int, direction: Direction) -> MetaField:
        """The metadata field for (``peer``, ``aiv``, ``direction``), created on first use."""
        key = (peer, aiv, direction)
        field = self._meta.get(key)
        if field is None:
            field = self._meta[key] = MetaField()
        return field

    @property
    def allocated_bytes(self) -> int:
        """Bytes actually allocated so far (lazy allocation)."""
        app = len(self._app) if self._app is not None else 0
        return app + self.slot_bytes * len(self._slots) + META_FIELD_BYTES * len(self._meta)

    def _require_bytes(self, what: str) -> None:
        if self.mode != "bytes":
            from ..errors import ConfigError

            raise ConfigError(f"{what} holds no data in 'size' payload mode", field="payload_mode")
