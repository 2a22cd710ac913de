"""The UB fabric: per-die device memory, remote access with injected latency, XCCL.

Built on :mod:`xds.hw` (costs) and :mod:`xds.runtime` (virtual time). See SPEC.md sections 1
and 3-5 and ARCHITECTURE.md "Layers".

* :class:`UBFabric` - die memories (application, metadata, managed regions), posted writes that
  become visible at their modelled completion time, MTE and DMA costs with contention.
* :mod:`xds.fabric.xccl` - XCCL point-to-point send/receive (sync and async).
"""

from .config import FabricConfig, PayloadMode
from .memory import META_FIELD_BYTES, DieMemory, Direction, MetaField, Region
from .ports import Port
from .ub import ENGINES, Engine, FabricStats, Transfer, UBFabric

__all__ = [
    "ENGINES",
    "META_FIELD_BYTES",
    "DieMemory",
    "Direction",
    "Engine",
    "FabricConfig",
    "FabricStats",
    "MetaField",
    "PayloadMode",
    "Port",
    "Region",
    "Transfer",
    "UBFabric",
]
