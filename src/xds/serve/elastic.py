"""Elastic decode in a PD replay: Decode vertical scale-down and scale-up (SPEC 11.2 stage 2,
P119) and on-chip memory faults (stage 3, P120).

:class:`Elastic` is the part of :class:`~xds.serve.failover.Failover` (itself mixed into
:class:`~xds.serve.replay.Replay`) that shrinks a Decode TE instead of restarting it, grows it
back when the failed server is repaired, and masks KV blocks a memory fault spoils. Whether a
scale-down is possible is :func:`~xds.serve.scale_down.scaled_down_config`'s call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..runtime import emit, now_ns, sleep_ns, sleep_until_ns
from .recovery import KVMask, MemoryFault, TEFailover
from .scale_down import resized_config, scaled_down_config

if TYPE_CHECKING:
    from .decode_model import CommCosts, DecodeConfig
    from .decode_te import DecodeTE
    from .failover import Where
    from .recovery import Placement
    from .replay import PDConfig


class Elastic:
    """Scale-down, scale-up and memory faults; mixed into :class:`~xds.serve.failover.Failover`."""

    config: PDConfig
    decode: list[DecodeTE]
    placement: Placement
    failovers: list[TEFailover]
    down: str
    kv_masks: list[KVMask]
    _bad_memory: dict[tuple[int, int], list[KVMask]]
    _scaled_out: dict[int, tuple[int, DecodeTE]]
    _spares: list[int]
    _grid: Sequence[CommCosts]

    if TYPE_CHECKING:  # provided by Failover and Replay

        @property
        def tainted(self) -> set[int]: ...
        def _live_decode(self, te: DecodeTE | None) -> bool: ...
        def _fail_held(self, held: Callable[[int, Where], bool], reason: str) -> int: ...
        def _free_servers(self) -> None: ...
        def _grid_of(self, config: DecodeConfig) -> Sequence[CommCosts]: ...
        def _struck(self, fault: object) -> None: ...

    async def _memory_fault(self, fault: MemoryFault) -> None:
        """Stage 3 (P120): an on-chip memory fault masks KV blocks of one Decode DP group; the
        requests whose KV lay there fail, nothing else is touched."""
        await sleep_until_ns(fault.at_ns)
        self._struck(fault)
        d, dp = fault.decode_te, fault.dp
        rec = KVMask(
            at_ns=now_ns(),
            te=f"D{d}",
            dp=dp,
            first_block=fault.first_block,
            blocks=fault.blocks,
            failed=0,
        )
        self.kv_masks.append(rec)
        te = self.decode[d]
        live = self._live_decode(te) and not self.down
        if not live or not te.alive[dp]:
            what = f"Decode TE {d}" if not live else f"Decode TE {d} DP {dp} (scaled down)"
            rec.skipped = f"{what} was not in service (no KV of it to mask)"
            emit("node", "memory-fault-skipped", te=rec.te, dp=dp)
            return
        emit("node", "memory-fault", te=rec.te, dp=dp, first=fault.first_block)
        last = fault.first_block + fault.blocks - 1
        victims = set(te.memory_fault(dp, fault.first_block, fault.blocks))
        rec.server = te.dp_server[dp]
        self._bad_memory.setdefault(te.die_of(dp), []).append(rec)
        reason = (
            f"KV lost to an on-chip memory fault on Decode TE {d} DP {dp} (blocks "
            f"{fault.first_block}..{last} masked)"
        )
        rec.failed = self._fail_held(lambda r, w: r in victims, reason)

    def _remask(self, te: DecodeTE) -> None:
        """A Decode TE (re)started: mask again the bad memory under any of its DP groups (the
        remap is CANN's, per die; a new process on the die inherits it). Its DP groups are
        empty, so nothing fails."""
        if not self._bad_memory:
            return
        for dp in range(te.config.dies):
            for rec in self._bad_memory.get(te.die_of(dp), ()):
                te.memory_fault(dp, rec.first_block, rec.blocks)
                rec.remasked.append(f"D{te.index}/DP{dp}")
                emit("node", "memory-remasked", te=f"D{te.index}", dp=dp, first=rec.first_block)

    def _repaired_memory(self, server: int) -> None:
        """``server`` was repaired (its faulty parts replaced): its dies' masks go."""
        for die in [die for die in self._bad_memory if die[0] == server]:
            del self._bad_memory[die]

    async def _scale_down(self, d: int, server: int, why: str) -> str:
        """Decode vertical scale-down (P119): Decode TE ``d`` drops its DP groups and EP ranks
        on ``server`` (their requests fail), pauses ``scale_down_ns`` to rebuild its EP domain
        and load the lost dies' experts into redundant slots, and serves on with the rest.
        Returns "" when done, else why not (the TE is down, or some expert would be left
        without a replica): the caller restarts the TE instead."""
        te = self.decode[d]
        if not self._live_decode(te):
            return "the TE is not in service"
        lost = te.dps_on(server)
        smaller, refusal = scaled_down_config(self.config.decode, te.alive, lost, te.kv_capacity)
        if smaller is None:
            emit("failover", "scale-down-refused", te=f"D{d}", reason=refusal)
            return refusal
        reason = (
            f"Decode TE {d} scaled down after an {why}: its DP groups there were lost "
            f"({int(te.alive.sum())} -> {smaller.dies} dies)"
        )
        rec = TEFailover(te=f"D{d}", reason=reason, down_ns=now_ns(), failed=0, kind="scale_down")
        self.failovers.append(rec)
        emit("failover", "scale-down", te=rec.te, server=server, dies=smaller.dies)
        gone = set(lost)
        rec.failed = self._fail_held(lambda r, w: w.decode == d and w.decode_dp in gone, reason)
        te.scale_down(server, smaller, self._grid_of(smaller))
        self.placement.decode[d] = [s for s in self.placement.decode[d] if s != server]
        self._scaled_out[server] = (d, te)
        await sleep_ns(self.config.recovery.scale_down_ns)
        if not self._live_decode(te):  # a later fault took the TE down meanwhile
            return ""
        rec.back_ns, rec.servers, rec.dies = now_ns(), self.placement.decode[d], smaller.dies
        emit("failover", "scaled-down", te=rec.te, dies=smaller.dies)
        return ""

    async def _scale_up(self, server: int) -> None:
        """The repaired ``server`` rejoins the Decode TE that scaled down without it: its dies
        load their weights (``scale_down_ns``), then the TE takes their DP groups back, empty,
        from the next iteration (empty, they take no part in the one in flight). If the TE was
        restarted meanwhile the server is a spare."""
        d, te = self._scaled_out.pop(server)
        start = now_ns()
        if self._live_decode(te):  # (a TE down or restarted gets the server as a spare)
            await sleep_ns(self.config.recovery.scale_down_ns)
        if server in self.tainted:  # it failed again: its next repair brings it back
            self._scaled_out[server] = (d, te)
            return
        if not self._live_decode(te):  # the TE restarted meanwhile: a spare for the pool
            self._spares.append(server)
            return
        keep = te.alive.copy()
        keep[te.dps_on(server, alive=False)] = True
        bigger = resized_config(self.config.decode, keep, te.kv_capacity)
        grid = self._grid if keep.all() else self._grid_of(bigger)
        te.scale_up(server, bigger, grid)
        self.placement.decode[d] = sorted([*self.placement.decode[d], server])
        rec = TEFailover(
            te=f"D{d}",
            reason=f"Decode TE {d} scaled back up on the repaired server {server}",
            down_ns=start,
            failed=0,
            kind="scale_up",
            back_ns=now_ns(),
            servers=self.placement.decode[d],
            dies=bigger.dies,
        )
        self.failovers.append(rec)
        emit("failover", "scaled-up", te=rec.te, server=server, dies=bigger.dies)
