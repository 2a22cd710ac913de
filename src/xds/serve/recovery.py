"""Restart-the-world for a PD deployment (SPEC 11.2 stage 1, P118; 11.3 "Stage 1").

Small clusters such as 4P1D restart the whole engine on any fault. In a replay a
:class:`NodeFault` strikes one server; ``detect_ns`` later (the heartbeat's period plus
timeout, :mod:`xds.serve.reliability.heartbeat`) Kubernetes taints the node and the engine
restarts:

1. every request in flight fails with the reason (tokens already streamed are not taken back,
   P120 c); requests that arrive until the engine is back fail as "service unavailable";
2. the **Decode** TEs restart first (``decode_restart_ns``), on untainted servers, so the
   cross-node Decode stays runnable on the degraded cluster;
3. then the **Prefill** TEs (``prefill_restart_ns``), as many whole TEs as the untainted
   servers left over hold (:func:`restart_placement`);
4. serving resumes on the new layout. A tainted node is never scheduled until its repair
   (``repair_ns``) untaints it, and even then only at the next restart.

Restart times are [emulator choice]: the paper gives none (it says only that recovery is slow).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..units import MS, S


class RecoveryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a PD deployment recovers from a node fault."""

    mode: Literal["restart_world", "independent", "scale_down"] = "restart_world"
    """``restart_world``: stage 1 (P118), for small clusters such as 4P1D; ``independent``:
    stage 2 (P119), only the TE on the failed server goes down and restarts, with
    kill-P-to-preserve-D when a Decode TE lacks servers (:mod:`xds.serve.failover`);
    ``scale_down``: as ``independent``, but a Decode TE drops the failed server's DP groups
    and EP ranks and serves on with the rest (Decode vertical scale-down, P119), where every
    expert keeps a replica; where not, it restarts as in ``independent``."""
    detect_ns: Annotated[int, Meta(ge=0)] = 2_500 * MS
    """From the fault to the taint: the default heartbeat's DP period plus timeout."""
    decode_restart_ns: Annotated[int, Meta(ge=0)] = 180 * S
    """Decode TEs back (weights loaded, graphs captured). [emulator choice]"""
    prefill_restart_ns: Annotated[int, Meta(ge=0)] = 120 * S
    """Prefill TEs back, after the Decode TEs. [emulator choice]"""
    scale_down_ns: Annotated[int, Meta(ge=0)] = 20 * S
    """A Decode scale-down's pause: the EP communication domain rebuilt on the surviving dies
    and the failed dies' experts loaded into their redundant slots; also how long a repaired
    server's dies load their weights before the TE scales back up. [emulator choice]"""
    spare_servers: Annotated[int, Meta(ge=0)] = 0
    """Healthy idle servers in the cluster a restart may use."""

    def __post_init__(self) -> None:
        check_fields(self)


class NodeFault(msgspec.Struct, frozen=True, kw_only=True):
    """An NPU fault on server ``server`` at virtual time ``at_ns`` (servers are numbered
    Prefill TEs first, two per 910C TE of 32 dies, then the Decode TEs, then the spares)."""

    at_ns: Annotated[int, Meta(ge=0)]
    server: Annotated[int, Meta(ge=0)]
    repair_ns: Annotated[int, Meta(ge=0)] = 0
    """From the fault until the node is untainted (0: never)."""

    def __post_init__(self) -> None:
        check_fields(self)


class MemoryFault(msgspec.Struct, frozen=True, kw_only=True):
    """An on-chip memory fault in a Decode die's KV region at virtual time ``at_ns`` (SPEC
    11.2 stage 3, P120): CANN remaps the virtual memory around the bad blocks, which are masked
    for good; the requests whose KV lay there fail with the reason, everything else is
    unaffected. Blocks are numbered per DP group from 0 (lowest addresses are allocated
    first)."""

    at_ns: Annotated[int, Meta(ge=0)]
    dp: Annotated[int, Meta(ge=0)]
    """The Decode DP group (die) of the fault."""
    decode_te: Annotated[int, Meta(ge=0)] = 0
    first_block: Annotated[int, Meta(ge=0)] = 0
    blocks: Annotated[int, Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        check_fields(self)


class KVMask(msgspec.Struct, kw_only=True):
    """What one :class:`MemoryFault` did."""

    at_ns: int
    te: str
    dp: int
    first_block: int
    blocks: int
    failed: int
    """Requests whose KV lay in the masked blocks."""
    skipped: str = ""
    """Why nothing was masked (the TE or DP group was not in service), else ""."""
    server: int = -1
    """The server whose die holds the bad memory (-1 when skipped)."""
    remasked: list[str] = []
    """Decode DP groups (``D<d>/DP<dp>``) that a restarted TE placed on this die and whose KV
    was masked again, because the bad memory outlives the process (until the server's repair)."""


class TEFailover(msgspec.Struct, kw_only=True):
    """One TE taken down by an independent failover, or scaled down or up; times are -1 until
    reached."""

    te: str
    """``P<k>`` or ``D<d>``."""
    reason: str
    down_ns: int
    failed: int
    """Requests it held that failed."""
    back_ns: int = -1
    servers: list[int] = []
    """The servers it restarted on (a scale-down: the servers it serves on)."""
    kind: Literal["restart", "scale_down", "scale_up"] = "restart"
    """``scale_down``: a Decode TE dropped one server's DP groups and served on (P119);
    ``scale_up``: it took them back once the server was repaired (``down_ns``: the repair,
    ``back_ns``: serving on them again)."""
    dies: int = -1
    """A scale-down's or scale-up's dies after it."""


class Restart(msgspec.Struct, kw_only=True):
    """One restart-the-world; times are -1 until reached (the replay may end first)."""

    reason: str
    started_ns: int
    failed: int
    """Requests in flight that failed."""
    decode_up_ns: int = -1
    prefill_up_ns: int = -1
    prefill_tes: int = -1
    """Prefill TEs after the restart (0: the engine could not come back)."""
    placement: Placement | None = None
    """The servers each TE restarted on (a copy: later changes do not show here)."""
    attempts: int = 1
    """Restarts tried: more than one when too few servers were healthy and the engine stayed
    down until repairs gave it room."""


class Placement(msgspec.Struct, frozen=True):
    """Servers of each TE. A replay's live placement (``Replay.placement``) changes in place
    as TEs fail over, scale down or come back; a restart-the-world computes a new one on
    untainted servers (:func:`restart_placement`)."""

    decode: list[list[int]]
    prefill: list[list[int]]
    """Empty if the engine cannot come back (the Decode TEs, or a Prefill TE, do not fit)."""

    def copy(self) -> Placement:
        """A copy whose server lists do not change with this one."""
        return Placement([list(s) for s in self.decode], [list(s) for s in self.prefill])


def restart_placement(
    *,
    servers: int,
    tainted: set[int],
    prefill_tes: int,
    prefill_servers_per_te: int,
    decode_tes: int,
    decode_servers_per_te: int,
) -> Placement:
    """Where the TEs restart. Servers are numbered as in :class:`NodeFault`: Prefill TEs',
    then Decode TEs', then spares. Decode goes first (P118): each Decode TE keeps its own
    untainted servers and replaces tainted ones with spares, then with servers taken from the
    last Prefill TEs. The Prefill TEs then take whole groups of untainted servers from what is
    left, in order, up to their original number. Tainted servers are never used."""
    first_decode = prefill_tes * prefill_servers_per_te
    first_spare = first_decode + decode_tes * decode_servers_per_te
    free = [s for s in range(servers) if s not in tainted]
    spares = [s for s in free if s >= first_spare]
    prefill_pool = [s for s in free if s < first_decode]
    decode: list[list[int]] = []
    for d in range(decode_tes):
        own = range(
            first_decode + d * decode_servers_per_te, first_decode + (d + 1) * decode_servers_per_te
        )
        te = [s for s in own if s not in tainted]
        while len(te) < decode_servers_per_te and (spares or prefill_pool):
            te.append(spares.pop(0) if spares else prefill_pool.pop())
        if len(te) < decode_servers_per_te:
            return Placement([], [])
        decode.append(sorted(te))
    left = sorted(prefill_pool + spares)
    k = min(prefill_tes, len(left) // prefill_servers_per_te)
    if not k:
        return Placement([], [])
    n = prefill_servers_per_te
    return Placement(decode, [left[i * n : (i + 1) * n] for i in range(k)])


document_fields(RecoveryConfig, NodeFault, MemoryFault, KVMask, TEFailover, Restart, Placement)
