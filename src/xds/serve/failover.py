"""Node faults in a PD replay: restart-the-world and independent P/D failover (SPEC 11.2).

:class:`Failover` is the part of :class:`xds.serve.replay.Replay` that reacts to a
:class:`~xds.serve.recovery.NodeFault`. It tracks, for every request in flight, which Prefill
and Decode TE hold its state (:class:`Where`), which servers each TE runs on
(:class:`~xds.serve.recovery.Placement`) and which are tainted, and recovers in one of three
ways (:attr:`RecoveryConfig.mode <xds.serve.recovery.RecoveryConfig.mode>`):

* ``restart_world`` (stage 1, P118): see :mod:`xds.serve.recovery`.
* ``independent`` (stage 2, P119): only the TE on the failed server goes down.

  - A **Prefill** TE's fault fails the requests whose KV it holds (prefilling, or waiting for
    their transfer) and nothing else: **killing a Prefill never kills its Decodes**, and the
    other Prefill TEs keep serving. It restarts after ``prefill_restart_ns`` on its untainted
    servers plus spares, or stays down until repairs return enough servers.
  - A **Decode** TE's fault fails the requests it holds (decoding, or reserved and in
    transfer); requests that finish prefill meanwhile keep their KV on the Prefill side and
    wait for a Decode TE (backpressure). It restarts after ``decode_restart_ns`` on its
    untainted servers plus spares; if that is not enough, **kill-P-to-preserve-D**: the Prefill
    TEs holding the fewest requests are killed, as many as it takes (their requests fail), and
    their servers go to the Decode TE; a killed Prefill TE comes back when repairs free
    servers, or when the Decode TE cannot restart after all and gives its healthy servers
    back.

* ``scale_down`` (stage 2 with EPLB, P119): as ``independent``, except that a **Decode** TE
  drops the failed server's DP groups and EP ranks and serves on with the rest, and takes
  them back once the server is repaired (:mod:`xds.serve.elastic`, which also handles
  on-chip memory faults). Refused when some expert would be left without a replica
  (:func:`~xds.serve.scale_down.scaled_down_config`); the TE then restarts as in
  ``independent``.

From the fault until it is handled (``detect_ns``), the struck TE hangs: its next all-to-all
includes the dead dies, so the iteration or prefill step in flight never completes. A
detection (the taint, a repair's bookkeeping, a spare leaving the pool) is a timed callback,
so every detection due at an instant lands before any task decides a layout then.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.lowlevel

from ..runtime import call_at_ns, emit, now_ns, sleep_ns, sleep_until_ns, waiting_for
from .decode_te import DecodeLoad
from .elastic import Elastic
from .recovery import KVMask, NodeFault, Placement, Restart, TEFailover, restart_placement

if TYPE_CHECKING:
    from ..trace.metrics import RequestRecord
    from .decode_te import DecodeTE
    from .distflow import DistFlow, Transfer
    from .prefill import PrefillJob, PrefillTE
    from .replay import PDConfig


class Where:
    """Which TEs hold a request's state (-1 / None: none yet)."""

    __slots__ = (
        "decode_dp",
        "decode_te",
        "flow",
        "job",
        "prefill_dp",
        "prefill_te",
        "transfer",
        "transferred",
    )

    def __init__(self) -> None:
        self.prefill_te: PrefillTE | None = None
        self.job: PrefillJob | None = None
        """The request's prefill job while it is with a Prefill TE (its step start)."""
        self.prefill_dp = -1
        self.decode_te: DecodeTE | None = None
        self.decode_dp = -1
        self.transferred = False
        """The KV reached the Decode side (the Prefill side frees it on the completion)."""
        self.flow: DistFlow | None = None
        self.transfer: Transfer | None = None
        """The registered KV transfer (kept after it ends)."""

    @property
    def prefill(self) -> int:
        return -1 if self.prefill_te is None else self.prefill_te.index

    @property
    def decode(self) -> int:
        return -1 if self.decode_te is None else self.decode_te.index


class Failover(Elastic):
    """Mixed into :class:`~xds.serve.replay.Replay` (which provides the TEs and requests)."""

    config: PDConfig
    prefill: list[PrefillTE]
    decode: list[DecodeTE]
    distflow: dict[tuple[int, int], DistFlow]
    records: dict[int, RequestRecord]
    _system: anyio.abc.TaskGroup | None
    _inflight: dict[int, anyio.CancelScope]
    _ended_ids: set[int]

    def _init_failover(self) -> None:
        cfg = self.config
        self._engine_scopes: list[anyio.CancelScope] = []
        self._te_scopes: dict[tuple[str, int], list[anyio.CancelScope]] = {}
        self.down = ""
        """Why the whole engine is not serving ("" while it is; restart-the-world): while set,
        the TEs in ``prefill``/``decode`` are the torn-down ones."""
        self._taints: dict[int, int] = {}
        """Unrepaired faults per server: a repair untaints it only when none is left."""
        self.restarts: list[Restart] = []
        self.failovers: list[TEFailover] = []
        self._where: dict[int, Where] = {}
        self.failed_by_failover: set[int] = set()
        """Requests a node fault failed (their tasks undo what they hold elsewhere)."""
        self._prefill_down: set[int] = set()
        self._decode_down: set[int] = set()
        self._decode_back = anyio.Event()
        self._decode_lost: dict[int, str] = {}
        """Decode TEs that cannot come back (too few healthy servers, no repair pending)."""
        self._decode_waiting: set[int] = set()
        """Decode TEs waiting for servers to restart on (they go before any Prefill TE)."""
        self._pending_repairs = 0
        self._prefill_restarting = 0
        self._detections: dict[int, list[int]] = {}
        """Servers whose faults were detected, by instant (handlers decide in server order)."""
        self._prefill_gave_up: dict[int, TEFailover] = {}
        """Prefill TEs down whose comeback found nothing that could free servers for them:
        they look again whenever servers return to the pool."""
        self._servers_freed = anyio.Event()
        """Set (and replaced) when servers return to the pool (a repair, a TE left down)."""
        self._taint_seen = anyio.Event()
        """Set (and replaced) when Kubernetes taints a server (a restart on it stops)."""
        per_p, per_d = cfg.prefill_servers_per_te, cfg.decode_servers // cfg.decode_tes
        first_d = cfg.prefill.tes * per_p
        self.placement = Placement(
            [
                list(range(first_d + d * per_d, first_d + (d + 1) * per_d))
                for d in range(cfg.decode_tes)
            ],
            [list(range(k * per_p, (k + 1) * per_p)) for k in range(cfg.prefill.tes)],
        )
        self._spares = list(range(first_d + cfg.decode_tes * per_d, cfg.servers))
        self._retired_steps = 0
        self._retired_decode = DecodeLoad()
        """The iteration-loop totals of Decode TEs replaced since (a restart or failover)."""
        self._retired_busy: dict[int, int] = {}
        self.kv_masks: list[KVMask] = []
        self._bad_memory: dict[tuple[int, int], list[KVMask]] = {}
        """(server, die on it) -> the memory faults masked there; the mask outlives a restart of
        the TE on that die and goes when the server is repaired (:mod:`xds.serve.elastic`)."""
        self._scaled_out: dict[int, tuple[int, DecodeTE]] = {}
        """Servers a Decode TE scaled down without: server -> (TE index, that TE)."""

    # -- hooks the replay calls --------------------------------------------------------------
    @property
    def tainted(self) -> set[int]:
        """Servers Kubernetes has tainted: those with a fault not yet repaired."""
        return {server for server, faults in self._taints.items() if faults}

    async def _engine_task(self, key: tuple[str, int], fn: Callable[[], Awaitable[None]]) -> None:
        """Run one engine task (a TE, a completion-queue poller) in a scope a failover of its
        TE, or a restart-the-world, cancels."""
        with anyio.CancelScope() as scope:
            self._engine_scopes.append(scope)
            self._te_scopes.setdefault(key, []).append(scope)
            await fn()

    def _where_of(self, request_id: int) -> Where:
        w = self._where.get(request_id)
        if w is None:
            w = self._where[request_id] = Where()
        return w

    async def _await_decode(self) -> str:
        """While every Decode TE is down: wait (the KV stays on the Prefill side). Returns why
        none will come back, or "" once one is in service."""
        while len(self._decode_down) == len(self.decode):
            if len(self._decode_lost) == len(self.decode):
                return "; ".join(self._decode_lost[d] for d in sorted(self._decode_lost))
            await self._decode_back.wait()
        return ""

    def _live_prefill(self, te: PrefillTE | None) -> bool:
        return (
            te is not None and te.index not in self._prefill_down and self.prefill[te.index] is te
        )

    def _live_decode(self, te: DecodeTE | None) -> bool:
        return te is not None and te.index not in self._decode_down and self.decode[te.index] is te

    def _retire_decode(self, te: DecodeTE) -> None:
        """Keep a Decode TE's iteration-loop totals once its loop is gone; the TE object may
        stay listed until its replacement is built, so its own totals restart from zero."""
        self._retired_decode.add(te.load)
        te.load = DecodeLoad()

    def _undo(self, request_id: int) -> None:
        """A request failed by a failover gives back what it holds on TEs still in service
        (called by its own task once it has stopped: the task may have run on past the
        failure up to its next checkpoint). A transferred request's Decode side is undone by
        the completion poller, which sees the completion."""
        w = self._where.get(request_id)
        if w is None or w.transferred:
            return
        if self._live_prefill(w.prefill_te) and w.prefill_dp >= 0:
            w.prefill_te.release(w.prefill_dp, request_id)  # type: ignore[union-attr]
        if self._live_decode(w.decode_te) and w.decode_dp >= 0:
            w.decode_te.abandon(w.decode_dp, self.records[request_id])  # type: ignore[union-attr]
        if w.flow is not None and w.transfer is not None:
            w.flow.withdraw(w.transfer)  # out of the pair's FIFO (probes queue behind it)

    # -- node faults ---------------------------------------------------------------------------
    async def _node_fault(self, fault: NodeFault) -> None:
        await sleep_until_ns(fault.at_ns)
        self._struck(fault)
        emit("node", "npu-fault", server=fault.server)
        # the TE on that server hangs at its next all-to-all until the fault is handled
        decode = [d for d, servers in enumerate(self.placement.decode) if fault.server in servers]
        prefill = [k for k, ss in enumerate(self.placement.prefill) if fault.server in ss]
        hung = [self.decode[d] for d in decode if self._live_decode(self.decode[d])]
        for te in hung:
            te.hang()
        for k in prefill:
            if self._live_prefill(self.prefill[k]):
                self.prefill[k].hang()
        try:
            await self._handle_node_fault(fault)
        finally:
            for te in hung:  # a TE taken down meanwhile is replaced: it stays hung
                if self._live_decode(te):
                    te.resume()

    def _detected(self, fault: NodeFault, idle: list[bool]) -> None:
        """Kubernetes taints the server (a timed callback: it runs before any task that wakes
        at the same instant, so every decision then sees every taint due then)."""
        self._taints[fault.server] = self._taints.get(fault.server, 0) + 1
        self._detections.setdefault(now_ns(), []).append(fault.server)
        emit("k8s", "taint", server=fault.server)
        self._taint_seen.set()
        self._taint_seen = anyio.Event()
        if fault.repair_ns:
            assert self._system is not None
            self._pending_repairs += 1
            self._system.start_soon(self._repair, fault)
        if fault.server in self._spares:
            self._spares.remove(fault.server)
            idle.append(True)

    async def _handle_node_fault(self, fault: NodeFault) -> None:
        rc = self.config.recovery
        idle: list[bool] = []
        if rc.detect_ns:
            detection = call_at_ns(now_ns() + rc.detect_ns, self._detected, fault, idle)
            try:
                await sleep_ns(rc.detect_ns)
            except BaseException:  # cancelled before the detection (the replay ended, say)
                detection.cancel()
                raise
        else:  # detected as it strikes: the faults striking now all detect before a decision
            self._detected(fault, idle)
            await anyio.lowlevel.checkpoint()
        why = f"NPU fault on server {fault.server}"
        if idle:  # an idle server: nothing to recover
            return
        # faults detected together are handled in server order, one decision a scheduling
        # round, whatever order they were given in and whichever backend runs
        for _ in range(sorted(set(self._detections[now_ns()])).index(fault.server)):
            await anyio.lowlevel.checkpoint()
        if rc.mode == "restart_world":
            await self._restart_world(f"restart-the-world after an {why}")
            return
        for k, servers in enumerate(self.placement.prefill):
            if fault.server in servers:
                await self._prefill_failover(k, f"Prefill TE {k} lost to an {why}")
                return
        for d, servers in enumerate(self.placement.decode):
            if fault.server in servers:
                refusal = ""
                if rc.mode == "scale_down":
                    refusal = await self._scale_down(d, fault.server, why)
                    if not refusal:
                        return
                    refusal = f" (no scale-down: {refusal})"
                await self._decode_failover(d, f"Decode TE {d} lost to an {why}{refusal}")
                return

    async def _repair(self, fault: NodeFault) -> None:
        await sleep_until_ns(fault.at_ns + fault.repair_ns)
        self._taints[fault.server] -= 1
        if self._taints[fault.server]:  # another fault of it is still unrepaired
            self._pending_repairs -= 1
            self._free_servers()  # (a TE waiting for servers re-checks its options)
            return
        emit("k8s", "untaint", server=fault.server)
        self._repaired_memory(fault.server)
        if fault.server in self._scaled_out:  # its Decode TE scaled down: scale back up
            try:  # still a pending repair while it rejoins (a TE waiting for servers waits)
                await self._scale_up(fault.server)
            finally:
                self._pending_repairs -= 1
                self._free_servers()
            return
        self._pending_repairs -= 1
        used = {s for te in self.placement.prefill + self.placement.decode for s in te}
        if fault.server not in used and fault.server not in self._spares:
            self._spares.append(fault.server)  # back in the pool for the next restart
        self._free_servers()

    def _free_servers(self) -> None:
        self._servers_freed.set()
        self._servers_freed = anyio.Event()
        if self._prefill_gave_up:  # a Prefill TE that stopped waiting looks again
            assert self._system is not None
            for k in sorted(self._prefill_gave_up):
                rec = self._prefill_gave_up.pop(k)
                self._system.start_soon(
                    self._prefill_comeback, k, rec, name=f"prefill-comeback-{k}"
                )

    # -- stage 1 ---------------------------------------------------------------------------------
    async def _restart_world(self, reason: str) -> None:
        """Stage 1 (P118): every request in flight fails; Decode restarts, then Prefill, on
        the untainted servers; serving resumes on what fits."""
        if self.down:
            return  # already restarting: the taint counts when the layout is chosen
        cfg, rc = self.config, self.config.recovery
        started = now_ns()
        self.down = reason
        emit("engine", "restart-the-world", reason=reason)
        failed = self._fail_held(lambda r, w: True, reason)
        for scope in self._engine_scopes:
            scope.cancel()
        self._engine_scopes, self._te_scopes = [], {}
        if self.monitor is not None:  # type: ignore[attr-defined]
            self.monitor.flows = []  # type: ignore[attr-defined]
        for k in range(len(self.prefill)):
            self._retire_prefill(k)
        for te in self.decode:
            self._retire_decode(te)
        restart = Restart(reason=reason, started_ns=started, failed=failed)
        self.restarts.append(restart)
        while True:
            await sleep_ns(rc.decode_restart_ns)  # Decode first (P118)
            restart.decode_up_ns = now_ns()
            emit("engine", "decode-restarted")
            await sleep_ns(rc.prefill_restart_ns)
            placement = self._world_placement()
            tes = len(placement.prefill)
            restart.prefill_tes, restart.placement = tes, placement.copy()
            if tes:
                break
            self.down = (
                f"{reason}: {cfg.servers - len(self.tainted)} untainted servers cannot hold "
                f"the Decode TEs ({cfg.decode_servers} servers) and a Prefill TE "
                f"({cfg.prefill_servers_per_te})"
            )
            emit("engine", "down", reason=self.down)
            # down until repairs give it room: then it restarts (Decode, then Prefill) again
            if not await self._await_servers(lambda: bool(self._world_placement().prefill)):
                return
            restart.attempts += 1
            self.down = f"{reason} (restarting again: repairs gave it room)"
            emit("engine", "restart-after-repair")
        restart.prefill_up_ns = now_ns()
        emit("engine", "prefill-restarted", prefill_tes=tes)
        self.placement = placement
        used = {s for te in placement.prefill + placement.decode for s in te}
        self._spares = [s for s in range(cfg.servers) if s not in used and s not in self.tainted]
        self._build_tes(tes)  # type: ignore[attr-defined]
        self._failed_pairs = {}
        self._build_distflow(None)  # type: ignore[attr-defined]
        self._start_engine()  # type: ignore[attr-defined]
        self.down = ""

    def _world_placement(self) -> Placement:
        """Where a restart of the world would put the TEs now (untainted servers only)."""
        cfg = self.config
        return restart_placement(
            servers=cfg.servers,
            tainted=self.tainted,
            prefill_tes=cfg.prefill.tes,
            prefill_servers_per_te=cfg.prefill_servers_per_te,
            decode_tes=cfg.decode_tes,
            decode_servers_per_te=cfg.decode_servers // cfg.decode_tes,
        )

    async def _await_servers(self, enough: Callable[[], bool]) -> bool:
        """Wait until ``enough()`` (re-checked whenever servers return to the pool or a Decode
        TE stops waiting for them); False once it is not and nothing can change it: no repair
        pending, no Decode TE waiting (which may leave spares when it is served) and none
        restarting (which gives its healthy servers back if it cannot come back)."""
        while not enough():
            restarting = self._decode_down - self._decode_lost.keys()  # may give servers back
            if not self._pending_repairs and not self._decode_waiting and not restarting:
                return False
            with waiting_for(
                f"a repair ({self._pending_repairs} pending) or a restarting Decode TE "
                "freeing servers"
            ):
                await self._servers_freed.wait()
        return True

    # -- stage 2 ---------------------------------------------------------------------------------
    async def _prefill_failover(self, k: int, reason: str) -> None:
        if k in self._prefill_down:
            return
        rec = self._prefill_down_now(k, reason)
        self._prefill_restarting += 1
        try:
            await sleep_ns(self.config.recovery.prefill_restart_ns)
        finally:
            self._prefill_restarting -= 1
        servers = self._servers_for(self.placement.prefill[k], self.config.prefill_servers_per_te)
        if servers is None:
            self._release_prefill_servers(k)
            self._free_servers()
            emit("failover", "stays-down", te=f"P{k}")
            await self._prefill_comeback(k, rec)
            return
        self._prefill_up(k, rec, servers)

    async def _prefill_comeback(self, k: int, rec: TEFailover) -> None:
        """A Prefill TE left down for want of servers (or killed to preserve a Decode TE)
        restarts once repairs give it a whole group of servers that no Decode TE is waiting
        for (Decode has priority, P118-P119); with nothing pending that could free them it
        stops waiting, and looks again when servers next return to the pool."""
        need = self.config.prefill_servers_per_te
        while True:
            if not await self._await_servers(
                lambda: not self._decode_waiting and len(self._spares) >= need
            ):
                self._prefill_gave_up[k] = rec
                return
            servers = self._servers_for([], need)
            assert servers is not None
            self.placement.prefill[k] = servers
            emit("failover", "restart-after-repair", te=f"P{k}")
            self._prefill_restarting += 1
            try:
                restarted = await self._restart_on(servers, self.config.recovery.prefill_restart_ns)
            finally:
                self._prefill_restarting -= 1
            if restarted:
                break
            self._release_prefill_servers(k)  # a server failed meanwhile: try again
            self._free_servers()
        self._prefill_up(k, rec, servers)

    def _prefill_up(self, k: int, rec: TEFailover, servers: list[int]) -> None:
        """Prefill TE ``k`` serves again on ``servers``."""
        self.placement.prefill[k] = servers
        self.prefill[k] = self._new_prefill_te(k)  # type: ignore[attr-defined]
        self._start_prefill_te(k)
        self._prefill_down.discard(k)
        for d in range(len(self.decode)):
            self._build_pair(k, d)
        rec.back_ns, rec.servers = now_ns(), servers
        self._free_servers()  # a Decode TE waiting for servers may kill it now
        emit("failover", "back", te=f"P{k}")

    async def _decode_failover(self, d: int, reason: str) -> None:
        if d in self._decode_down:
            return  # already restarting: it re-checks its servers before coming back
        cfg = self.config
        rec = self._take_down("D", d, reason)
        self._decode_down.add(d)
        rec.failed = self._fail_held(lambda r, w: w.decode == d, reason)
        self._retire_decode(self.decode[d])
        need = cfg.decode_servers // cfg.decode_tes
        while True:
            servers = self._decode_servers(d, need)
            if servers is None:
                if not self._pending_repairs and not self._prefill_restarting:
                    self._decode_lost[d] = f"{reason}; too few healthy servers to restart it"
                    # its healthy servers (a killed Prefill TE's among them) idle as spares,
                    # for a Prefill TE that waits to come back
                    self._spares.extend(
                        s for s in self.placement.decode[d] if s not in self.tainted
                    )
                    self.placement.decode[d] = []
                    self._stop_waiting(d)
                    self._free_servers()
                    self._decode_back.set()  # waiting requests learn it
                    self._decode_back = anyio.Event()
                    emit("failover", "stays-down", te=f"D{d}")
                    return
                self._decode_waiting.add(d)
                with waiting_for(f"servers to restart Decode TE {d} on"):
                    await self._servers_freed.wait()  # a repair may bring one back
                continue
            self._stop_waiting(d)
            self.placement.decode[d] = servers
            if await self._restart_on(servers, cfg.recovery.decode_restart_ns):
                break
            emit("failover", "restart-again", te=f"D{d}")  # a server failed meanwhile
        self.decode[d] = self._new_decode_te(d)  # type: ignore[attr-defined]
        self._start_decode_te(d)
        self._decode_down.discard(d)
        for k in range(len(self.prefill)):
            self._build_pair(k, d)
        rec.back_ns, rec.servers = now_ns(), self.placement.decode[d]
        self._decode_back.set()
        self._decode_back = anyio.Event()
        self._free_servers()  # a Prefill TE waiting to come back looks again
        emit("failover", "back", te=f"D{d}")

    async def _restart_on(self, servers: list[int], restart_ns: int) -> bool:
        """A TE's restart on ``servers``, ``restart_ns`` long: True once done, False as soon
        as one of them is tainted meanwhile (the restart starts again then, on other servers,
        rather than after running its course on a failed one)."""
        end = now_ns() + restart_ns
        while True:
            if set(servers) & self.tainted:
                return False
            if now_ns() >= end:
                return True
            seen = self._taint_seen
            async with anyio.create_task_group() as tg:

                async def restart_done() -> None:
                    await sleep_until_ns(end)
                    tg.cancel_scope.cancel()

                tg.start_soon(restart_done)
                await seen.wait()
                tg.cancel_scope.cancel()

    def _stop_waiting(self, d: int) -> None:
        """Decode TE ``d`` no longer waits for servers: Prefill TEs waiting behind it (they
        give Decode priority) look again."""
        if d in self._decode_waiting:
            self._decode_waiting.discard(d)
            self._free_servers()

    def _decode_servers(self, d: int, need: int) -> list[int] | None:
        """Decode TE ``d``'s healthy servers topped up from the spares, and if that is not
        enough, kill-P-to-preserve-D (P119): the Prefill TEs in service holding the fewest
        requests are killed, only if that frees enough servers."""
        servers = self._servers_for(self.placement.decode[d], need)
        if servers is not None:
            return servers
        short = need - len([s for s in self.placement.decode[d] if s not in self.tainted])
        short -= len(self._spares)
        live = [k for k in range(len(self.prefill)) if k not in self._prefill_down]
        held = {k: 0 for k in live}
        for rid, w in self._where.items():
            if w.prefill in held and not w.transferred and rid not in self._ended_ids:
                held[w.prefill] += 1
        victims: list[int] = []
        for k in sorted(live, key=lambda k: (held[k], k)):
            if short <= 0:
                break
            victims.append(k)
            short -= len([s for s in self.placement.prefill[k] if s not in self.tainted])
        if short > 0:
            return None  # even killing every Prefill TE would not do
        for k in victims:
            emit("failover", "kill-p-to-preserve-d", prefill_te=k, decode_te=d)
            self._kill_prefill(k, f"Prefill TE {k} killed to preserve Decode TE {d}")
        return self._servers_for(self.placement.decode[d], need)

    def _kill_prefill(self, k: int, reason: str) -> None:
        """Take Prefill TE ``k`` down; its healthy servers become spares. It comes back when
        repairs give it servers again (:meth:`_prefill_comeback`)."""
        rec = self._prefill_down_now(k, reason)
        self._release_prefill_servers(k)
        assert self._system is not None
        self._system.start_soon(self._prefill_comeback, k, rec, name=f"prefill-comeback-{k}")

    def _prefill_down_now(self, k: int, reason: str) -> TEFailover:
        """Prefill TE ``k`` stops: its tasks end and the requests whose KV it holds fail."""
        rec = self._take_down("P", k, reason)
        self._prefill_down.add(k)
        rec.failed = self._fail_held(lambda r, w: w.prefill == k and not w.transferred, reason)
        self._retire_prefill(k)
        return rec

    def _release_prefill_servers(self, k: int) -> None:
        """A Prefill TE that stays down: its healthy servers idle as spares."""
        self._spares.extend(s for s in self.placement.prefill[k] if s not in self.tainted)
        self.placement.prefill[k] = []

    # -- pieces ------------------------------------------------------------------------------------
    def _take_down(self, side: str, index: int, reason: str) -> TEFailover:
        for scope in self._te_scopes.pop((side, index), []):
            scope.cancel()
        rec = TEFailover(te=f"{side}{index}", reason=reason, down_ns=now_ns(), failed=0)
        self.failovers.append(rec)
        emit("failover", "down", te=rec.te, reason=reason)
        return rec

    def _retire_prefill(self, k: int) -> None:
        te = self.prefill[k]
        self._retired_steps += te.steps
        self._retired_busy[k] = self._retired_busy.get(k, 0) + te.busy_ns
        te.steps = te.busy_ns = 0

    def _servers_for(self, own: list[int], need: int) -> list[int] | None:
        """A TE's untainted servers topped up from the spares (taken only if enough)."""
        servers = [s for s in own if s not in self.tainted]
        spares = [s for s in self._spares if s not in self.tainted]  # (a spare is untainted
        if len(servers) + len(spares) < need:  # once detected; never place one that is not)
            return None
        while len(servers) < need:
            spare = spares.pop(0)
            self._spares.remove(spare)
            servers.append(spare)
        return sorted(servers)

    def _fail_held(self, held: Callable[[int, Where], bool], reason: str) -> int:
        """Fail every request in flight that ``held(request id, where)`` says the lost part
        holds; each one's task is cancelled and gives back what it holds elsewhere
        (:meth:`_undo`)."""
        failed = 0
        for rid in sorted(set(self._inflight) | set(self._where)):
            w = self._where.get(rid) or Where()
            if rid in self._ended_ids or not held(rid, w):
                continue
            scope = self._inflight.get(rid)
            if scope is not None:
                scope.cancel()
            self.failed_by_failover.add(rid)
            self._fail(self.records[rid], reason)  # type: ignore[attr-defined]
            failed += 1
        return failed

    def _start_prefill_te(self, k: int) -> None:
        assert self._system is not None
        self._system.start_soon(
            self._engine_task, ("P", k), self.prefill[k].run, name=f"prefill-te-{k}"
        )

    def _start_decode_te(self, d: int) -> None:
        assert self._system is not None
        self._system.start_soon(
            self._engine_task, ("D", d), self.decode[d].run, name=f"decode-te-{d}"
        )

    def _start_pollers(
        self, p: int, d: int, flow: DistFlow, *, prefill: bool, decode: bool
    ) -> None:
        assert self._system is not None
        cfg = self.config
        if prefill:
            for dp in range(cfg.prefill.dps_per_te):
                self._system.start_soon(
                    self._engine_task,
                    ("P", p),
                    functools.partial(self._prefill_poller, flow, dp),  # type: ignore[attr-defined]
                    name=f"cq-P{p}-D{d}-prefill-DP{dp}",  # pair (P p, D d)
                )
        if decode:
            for dp in range(cfg.decode.dies):
                self._system.start_soon(
                    self._engine_task,
                    ("D", d),
                    functools.partial(self._decode_poller, flow, self.decode[d], dp),  # type: ignore[attr-defined]
                    name=f"cq-P{p}-D{d}-decode-DP{dp}",
                )

    def _build_pair(self, p: int, d: int) -> None:
        """A fresh DistFlow instance for (Prefill TE ``p``, Decode TE ``d``) after either came
        back; its pollers start on the sides that are up. The old instance's pollers keep
        draining what it already completed, and end when it has ended everything it held
        (:meth:`~xds.serve.distflow.DistFlow.retire`)."""
        old = self.distflow.get((p, d))
        if old is not None:
            old.retire()  # its pollers end once what it holds has ended
        flow = self.distflow[(p, d)] = self._new_flow(p, d)  # type: ignore[attr-defined]
        self._failed_pairs.pop((p, d), None)
        self._start_pollers(
            p, d, flow, prefill=p not in self._prefill_down, decode=d not in self._decode_down
        )
        if self.monitor is not None:  # type: ignore[attr-defined]
            self.monitor.flows = list(self.distflow.values())  # type: ignore[attr-defined]

    _failed_pairs: dict[tuple[int, int], int]
