"""Fabric and XCCL configuration (SPEC 3.5 and Appendix B; every default an emulator choice).

Ring geometry: SPEC App. B suggests 8 slots of 256 KiB per pair. xds's default is 64 slots of
32 KiB (the same 2 MiB per pair): a slot is one MTE operation (at most half a 192 KiB UBuf,
SPEC 1.5), and 64 slots let all 48 AIVs of a die keep a chunk in flight. With 8 slots at most 8
AIVs could ever be busy on one pair, which contradicts the paper's 48-AIV speed-up (P037).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..errors import ConfigError
from ..units import KiB, MiB

PayloadMode = Literal["bytes", "size"]


class FabricConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    payload_mode: PayloadMode = "bytes"
    """``bytes`` moves real data; ``size`` only byte counts (same protocol and timing)."""
    app_bytes: Annotated[int, Meta(gt=0)] = 64 * MiB
    """Application region per die (allocated lazily, bytes mode only)."""
    ring_slots: Annotated[int, Meta(ge=1)] = 64
    """Managed-ring slots per (sender, receiver) pair."""
    slot_bytes: Annotated[int, Meta(ge=32, multiple_of=32)] = 32 * KiB
    """Bytes per ring slot; one chunk of a message occupies one slot."""
    mte_chunk_bytes: Annotated[int, Meta(ge=32, multiple_of=32)] | None = None
    """Largest chunk one AIV moves with one MTE2/MTE3 pair; default: one slot, at most half
    a UBuf."""
    min_chunk_bytes: Annotated[int, Meta(ge=32, multiple_of=32)] = 512
    """Smallest chunk: small messages use fewer AIVs rather than tinier chunks."""
    dma_chunk_bytes: Annotated[int, Meta(ge=32, multiple_of=32)] | None = None
    """Chunk of one DMA descriptor on the DMA path; default: one slot."""

    def __post_init__(self) -> None:
        check_fields(self)


def validated(config: FabricConfig, die_ubuf_bytes: int) -> FabricConfig:
    """Check constraints msgspec cannot express alone (the annotations were checked when the
    config was built); raise ConfigError naming the field."""
    if config.mte_chunk_bytes is None:
        chunk = min(config.slot_bytes, die_ubuf_bytes // 2) // 32 * 32
        config = msgspec.structs.replace(config, mte_chunk_bytes=chunk)
    if config.dma_chunk_bytes is None:
        config = msgspec.structs.replace(config, dma_chunk_bytes=config.slot_bytes)
    if config.mte_chunk_bytes > die_ubuf_bytes // 2:
        raise ConfigError(
            f"an MTE operation is at most half a UBuf ({die_ubuf_bytes // 2} bytes), "
            f"got {config.mte_chunk_bytes}",
            field="fabric.mte_chunk_bytes",
        )
    for name in ("mte_chunk_bytes", "dma_chunk_bytes", "min_chunk_bytes"):
        if getattr(config, name) > config.slot_bytes:
            raise ConfigError(
                f"must not exceed slot_bytes ({config.slot_bytes})", field=f"fabric.{name}"
            )
    return config


document_fields(FabricConfig)
