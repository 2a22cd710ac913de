"""A colocated decode group with SPEC 11's detection and recovery, run layer by layer.

Tasks, as in FlowServe (SPEC 6.1) and named after it:

* **DP master** (one per DP group): a single sequential loop. Before each iteration it answers
  the heartbeat pings waiting for it, applies what the CANN runtime reported (memory faults),
  reserves this iteration's KV, then sends the step to its executor and *blocks* until the
  executor replies: no heartbeat is answered meanwhile (SPEC 11.3). On a rollback it
  discards the attempt, restores its KV checkpoint and acknowledges the epoch; on a commit it
  releases the iteration's tokens to its output processor.
* **Executor** (one per DP die): runs the forward pass, ``layers`` MoE layers of attention,
  dispatch, experts and combine, then the LM head, meeting every other executor at each
  dispatch, combine and the final commit (busy-polled :class:`~.rollback.PollBarrier`).
  Tokens come from a tiny content model (:class:`~.content.TinyDecoder`), greedy, so a run
  with faults can be compared token for token with a fault-free one.
* **Output processor** (one per DP): streams committed tokens to the frontend (output
  shortcutting, SPEC 6.2). Tokens reach it only after their iteration's global commit, so a
  rollback never streams a token twice or skips one.
* **TE-shell heartbeat and control plane** (:mod:`.heartbeat`), and the **rollback
  broadcaster** (:mod:`.rollback`).

Recovery: transient network errors roll back (stage 3); on-chip memory faults mask the bad
KV blocks and fail only the requests whose KV lay there (stage 3); a hang or crash is found by
the heartbeat and, like an escalated rollback, restarts the world (stage 1): the engine stops
and every request in flight fails with the reason. Whatever happens, every request ends
exactly once, completed or failed with a reason.
"""

from __future__ import annotations

from typing import Literal

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...config import require_instance
from ...runtime import emit, now_ns, rng, sleep_until_ns
from ...runtime.sync import Streams
from .config import (
    ExecutorCrash,
    ExecutorHang,
    Fault,
    MemoryFault,
    NetworkError,
    ReliabilityConfig,
    SlowIteration,
)
from .content import TinyDecoder
from .experts import ExpertPlacement
from .heartbeat import TEShellHeartbeat, Verdict, control_plane
from .kv_space import AddressedKV
from .rollback import RollbackCoordinator, RollbackRecord, RolledBack


class RequestOutcome(msgspec.Struct, kw_only=True):
    """How one request ended."""

    request: int
    dp: int
    state: Literal["completed", "failed"]
    reason: str = ""
    tokens: list[int]
    """Output tokens committed, in order (the first came from prefill)."""
    streamed: list[int]
    """What its output processor delivered to the frontend."""
    finished_ns: int


class ScaleDown(msgspec.Struct, frozen=True, kw_only=True):
    """One decode vertical scale-down."""

    at_ns: int
    removed: list[int]
    live_dps: int
    expert_scale: float
    """Expert time from now on, relative to the full group."""
    min_replicas: int
    """The fewest dies any expert is left on (at least 1)."""


class ReliabilityResult(msgspec.Struct, kw_only=True):
    outcomes: list[RequestOutcome]
    iterations: int
    """Iterations committed."""
    elapsed_ns: int
    rollbacks: list[RollbackRecord]
    verdicts: list[Verdict]
    """DPs the TE-shell marked unhealthy, in marking order."""
    stopped: str = ""
    """Why the engine stopped before the end ("": it ran to completion)."""
    masked_blocks: dict[int, list[int]] = {}
    """DP -> KV blocks masked after memory faults."""
    scale_downs: list[ScaleDown] = []
    unfired: list[int] = []
    """Positions in ``config.faults`` of the faults that never struck (their DP was gone, or
    the run stopped or ended before their iteration)."""

    def completed(self) -> int:
        return sum(o.state == "completed" for o in self.outcomes)

    def failed(self) -> list[RequestOutcome]:
        return [o for o in self.outcomes if o.state == "failed"]


class _Run(msgspec.Struct, frozen=True):
    iteration: int
    attempt: int


class _Reply(msgspec.Struct, frozen=True):
    rolled_back: bool
    tokens: dict[int, int] = {}


class _Seq:
    __slots__ = ("dp", "request", "rows", "tokens")

    def __init__(self, request: int, dp: int):
        self.request = request
        self.dp = dp
        self.rows: list[np.ndarray] = []
        """KV rows, one per position, written in place (truncated on rollback)."""
        self.tokens: list[int] = []


class ExecutorCrashed(Exception):
    """An injected executor crash (fail-stop)."""


class ReliableDecode:
    """Run with ``await ReliableDecode(config).run()`` inside :func:`xds.run`."""

    def __init__(self, config: ReliabilityConfig):
        require_instance(config, ReliabilityConfig, "config")
        self.config = config
        n = config.dps
        self.decoder = TinyDecoder(config.vocab, rng("reliability/content"))
        self._jitter = [rng(f"reliability/jitter/dp{dp}") for dp in range(n)]
        self.kv = [
            AddressedKV(config.kv_blocks_per_dp, block_tokens=config.block_tokens) for _ in range(n)
        ]
        self.active: list[list[_Seq]] = [[] for _ in range(n)]
        self.outcomes: dict[int, RequestOutcome] = {}
        self.streamed: dict[int, list[int]] = {}
        self._faults: dict[tuple[int, int], list[tuple[int, Fault]]] = {}
        for i, f in enumerate(config.faults):
            self._faults.setdefault((f.dp, f.iteration), []).append((i, f))
        self._fired: set[int] = set()
        """Positions in ``config.faults`` of the faults that struck."""
        self._struck: dict[int, int] = {}
        """DP -> when an injected hang or crash stopped its executor."""
        self.shell = TEShellHeartbeat(config.heartbeat, n, lambda dp: dp in self._struck)
        self.coord = RollbackCoordinator(config.rollback, n, config.poll_ns, self._stop)
        self.stopped = ""
        self._lost: set[int] = set()
        """DP groups whose executor died (their master answers nothing any more)."""
        self.commits = [0] * n
        self._scope: anyio.CancelScope | None = None
        self._dp_scopes = [anyio.CancelScope() for _ in range(n)]
        self.live = list(range(n))
        self.placement = ExpertPlacement.round_robin(config.n_experts, n, config.slots_per_die)
        self._share0 = self.placement.busiest_share()
        self.expert_scale = 1.0
        """Expert time relative to the full group (grows as scale-down concentrates load)."""
        self.scale_downs: list[ScaleDown] = []
        self._last_commit_ns = 0
        self._run_send: list[MemoryObjectSendStream[_Run]] = []
        self._run_recv: list[MemoryObjectReceiveStream[_Run]] = []
        self._reply_send: list[MemoryObjectSendStream[_Reply]] = []
        self._reply_recv: list[MemoryObjectReceiveStream[_Reply]] = []
        self._out_send: list[MemoryObjectSendStream[tuple[int, int]]] = []
        self._out_recv: list[MemoryObjectReceiveStream[tuple[int, int]]] = []

    # -- the run ----------------------------------------------------------------------------
    async def run(self) -> ReliabilityResult:
        cfg = self.config
        start = now_ns()
        self._prefill()
        streams = Streams()
        for send, recv in (streams.create(_Run, 1) for _ in range(cfg.dps)):
            self._run_send.append(send)
            self._run_recv.append(recv)
        for send, recv in (streams.create(_Reply, 1) for _ in range(cfg.dps)):
            self._reply_send.append(send)
            self._reply_recv.append(recv)
        for send, recv in (streams.create(tuple, float("inf")) for _ in range(cfg.dps)):
            self._out_send.append(send)
            self._out_recv.append(recv)
        try:
            return await self._serve(start)
        finally:
            streams.close()
            self.shell.streams.close()

    async def _serve(self, start: int) -> ReliabilityResult:
        cfg = self.config
        async with anyio.create_task_group() as outer:
            self._scope = outer.cancel_scope
            outer.start_soon(self._watchdog, name="watchdog")
            if cfg.heartbeat.enabled:
                for dp in range(cfg.dps):
                    outer.start_soon(self.shell.watch, dp, name=f"te-shell-heartbeat-{dp}")
                outer.start_soon(
                    control_plane, cfg.heartbeat, self.shell, self._unhealthy, name="control-plane"
                )
            async with anyio.create_task_group() as tg:
                for dp in range(cfg.dps):
                    tg.start_soon(self._dp_group, dp, name=f"dp-group-{dp}")
                    tg.start_soon(self._output_processor, dp, name=f"output-processor-{dp}")
            if self._lost & set(self.live):  # every DP group ended, some on a dead executor
                await anyio.sleep_forever()  # the heartbeat (or the watchdog) stops the engine
            outer.cancel_scope.cancel()  # the engine finished: stop the heartbeats
        return self._result(now_ns() - start)

    def _prefill(self) -> None:
        """Every request prefilled before decode starts: prompt KV rows and the first token."""
        cfg = self.config
        gen = rng("reliability/prompts")
        for dp in range(cfg.dps):
            for slot in range(cfg.batch_per_dp):
                s = _Seq(dp * cfg.batch_per_dp + slot, dp)
                prompt = gen.integers(0, cfg.vocab, cfg.prompt_tokens)
                s.rows = [self.decoder.kv_row(int(t), i) for i, t in enumerate(prompt)]
                s.tokens = [self.decoder.next_token(s.rows)]
                self.kv[dp].admit(s.request, cfg.prompt_tokens)
                self.streamed[s.request] = list(s.tokens)
                self.active[dp].append(s)

    async def _watchdog(self) -> None:
        """Stop the engine if no iteration commits for ``stall_limit_ns``."""
        limit = self.config.stall_limit_ns
        while True:
            seen = self._last_commit_ns
            await sleep_until_ns(seen + limit)
            if self._last_commit_ns == seen:
                stuck = [d for d in self.live if not self.coord.is_polling(d)]
                self._stop(
                    f"watchdog: no iteration committed for {limit / 1e9:g} s; DPs stopped "
                    f"outside a global barrier: {', '.join(map(str, stuck)) or 'none'}"
                )
                return

    def _result(self, elapsed: int) -> ReliabilityResult:
        self._drain_outputs()
        for dp, seqs in enumerate(self.active):  # restart-the-world: the rest fail
            for s in seqs:
                self._end(s, "failed", self.stopped or "engine stopped")
                self.kv[dp].release(s.request)
            seqs.clear()
        for kv in self.kv:
            kv.check()
        for record in self.coord.records:  # the same run reads the same on every backend
            record.observed_ns = dict(sorted(record.observed_ns.items()))
        return ReliabilityResult(
            outcomes=[self.outcomes[r] for r in sorted(self.outcomes)],
            iterations=max(self.commits),
            elapsed_ns=elapsed,
            rollbacks=self.coord.records,
            verdicts=sorted(self.shell.verdicts, key=lambda v: (v.marked_ns, v.dp)),
            stopped=self.stopped,
            masked_blocks={dp: sorted(kv.masked) for dp, kv in enumerate(self.kv) if kv.masked},
            scale_downs=self.scale_downs,
            unfired=[i for i in range(len(self.config.faults)) if i not in self._fired],
        )

    def _end(self, s: _Seq, state: Literal["completed", "failed"], reason: str = "") -> None:
        self.outcomes[s.request] = RequestOutcome(
            request=s.request,
            dp=s.dp,
            state=state,
            reason=reason,
            tokens=list(s.tokens),
            streamed=self.streamed[s.request],
            finished_ns=now_ns(),
        )
        emit("reliability", state, request=s.request, dp=s.dp, reason=reason)

    def _stop(self, reason: str) -> None:
        """Restart-the-world (stage 1), or component failover after an escalation."""
        if not self.stopped:
            self.stopped = reason
            emit("reliability", "stopped", reason=reason)
            assert self._scope is not None
            self._scope.cancel()

    def _unhealthy(self, verdicts: list[Verdict]) -> None:
        mode = self.config.heartbeat.on_unhealthy
        if mode == "report":
            return
        dps = ", ".join(str(v.dp) for v in verdicts)
        who = f"DP {dps}" if len(verdicts) == 1 else f"DPs {dps}"
        why = (
            f"{who} missed a heartbeat (unanswered for "
            f"{self.config.heartbeat.timeout_ns / 1e6:g} ms; first ping at "
            f"{verdicts[0].ping_ns / 1e6:g} ms)"
        )
        if mode == "restart":
            self._stop(f"restart-the-world: {why}")
            return
        # scale-down: remove the DPs stopped outside a global barrier; the others are stalled
        # behind them at a barrier and will answer once the group goes on without them
        culprits = [
            d for d in self.live if d in self.shell.unhealthy and not self.coord.is_polling(d)
        ]
        if not culprits:
            return  # everyone marked is waiting at a barrier: nothing to remove (yet)
        survivors = [d for d in self.live if d not in culprits]
        orphans = self.placement.orphans(set(culprits))
        if not survivors or orphans:
            lost = f"experts {orphans} without a replica" if orphans else "no DP"
            self._stop(
                f"restart-the-world: {why}; removing DP {', '.join(map(str, culprits))} "
                f"would leave {lost}"
            )
            return
        self._scale_down(culprits, survivors)

    def _scale_down(self, culprits: list[int], survivors: list[int]) -> None:
        """Decode vertical scale-down (P119): fewer DP groups and EP ranks, every expert kept."""
        self.placement = self.placement.without(set(culprits))
        self.expert_scale = self.placement.busiest_share() / self._share0
        self.live = survivors
        self.coord.remove(culprits)
        reason = "DP {} removed by decode scale-down after it stopped answering; its KV is lost"
        for dp in culprits:
            self._dp_scopes[dp].cancel()
            self.shell.retire(dp)
            for s in list(self.active[dp]):
                self._fail(s, reason.format(dp))
        self.coord.abort(culprits[0], "SCALE_DOWN")  # the survivors redo the iteration
        self.scale_downs.append(
            ScaleDown(
                at_ns=now_ns(),
                removed=culprits,
                live_dps=len(survivors),
                expert_scale=self.expert_scale,
                min_replicas=self.placement.min_replicas(),
            )
        )
        emit("reliability", "scale-down", removed=culprits, live=len(survivors))

    # -- DP master ----------------------------------------------------------------------------
    async def _dp_group(self, dp: int) -> None:
        """A DP group's master and executor, in a scope a scale-down can cancel."""
        with self._dp_scopes[dp]:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._master, dp, name=f"dp-master-{dp}")
                tg.start_soon(self._executor, dp, name=f"executor-{dp}")

    async def _master(self, dp: int) -> None:
        cfg = self.config
        kv = self.kv[dp]
        out = self._out_send[dp]
        with out:
            for it in range(cfg.output_tokens - 1):  # fixed lengths: every DP steps together
                self.shell.serve(dp)
                self._memory_faults(dp, it)
                attempt = 0
                while True:
                    self._reserve(dp)
                    self.coord.current = (it, attempt)
                    await self._run_send[dp].send(_Run(it, attempt))
                    try:
                        reply = await self._reply_recv[dp].receive()  # blocks the loop
                    except anyio.EndOfStream:
                        emit("dp-master", "executor-lost", dp=dp, iteration=it)
                        self._lost.add(dp)
                        return  # fail-stop: this master answers nothing any more
                    if not reply.rolled_back:
                        break
                    kv.restore()  # discard the attempt: KV back to the end of it - 1
                    for s in self.active[dp]:
                        del s.rows[kv.tokens(s.request) :]
                    await self.coord.epoch_barrier.wait(dp)
                    attempt += 1
                self._commit(dp, reply.tokens, out)
                await self._gap(dp)
            self._run_send[dp].close()

    def _memory_faults(self, dp: int, iteration: int) -> None:
        for i, f in self._faults.get((dp, iteration), ()):
            if not isinstance(f, MemoryFault):
                continue
            self._fired.add(i)
            last = f.first_block + f.blocks - 1
            victims = set(self.kv[dp].mask(f.first_block, f.blocks))
            emit("cann", "remap", dp=dp, first=f.first_block, last=last, victims=len(victims))
            for s in [s for s in self.active[dp] if s.request in victims]:
                self._fail(
                    s, f"KV lost to an on-chip memory fault (blocks {f.first_block}..{last})"
                )

    def _reserve(self, dp: int) -> None:
        """Hold this iteration's KV slot of every active sequence (written by the executor)."""
        for s in list(self.active[dp]):
            if not self.kv[dp].append(s.request, 1):
                self._fail(s, "no KV block left for its next token (capacity lost to masking)")

    def _fail(self, s: _Seq, reason: str) -> None:
        self.active[s.dp].remove(s)
        self.kv[s.dp].release(s.request)
        self._end(s, "failed", reason)

    def _commit(self, dp: int, tokens: dict[int, int], out: MemoryObjectSendStream) -> None:
        """The iteration committed globally: checkpoint the KV, release the tokens."""
        self.kv[dp].commit()
        self.commits[dp] += 1
        self._last_commit_ns = now_ns()
        for s in list(self.active[dp]):
            s.tokens.append(tokens[s.request])
            out.send_nowait((s.request, tokens[s.request]))
            if len(s.tokens) == self.config.output_tokens:
                self.active[dp].remove(s)
                self.kv[dp].release(s.request)
                self._end(s, "completed")

    async def _gap(self, dp: int) -> None:
        """The scheduler gap: the loop is free, so pings are answered as they come."""
        deadline = now_ns() + self.config.scheduler_gap_ns
        while (left := deadline - now_ns()) > 0:
            with anyio.move_on_after(left / 1e9):
                self.shell.pong(dp, await self.shell.inbox[dp].receive())
        self.shell.serve(dp)

    # -- executor -----------------------------------------------------------------------------
    async def _executor(self, dp: int) -> None:
        reply = self._reply_send[dp]
        with reply:
            async for step in self._run_recv[dp]:
                try:
                    tokens = await self._forward(dp, step)
                except RolledBack:
                    await reply.send(_Reply(True))
                except ExecutorCrashed:
                    emit("executor", "crashed", dp=dp, iteration=step.iteration)
                    return  # closing the reply stream is all the master will see
                else:
                    await reply.send(_Reply(False, tokens))

    async def _forward(self, dp: int, step: _Run) -> dict[int, int]:
        cfg, t, coord = self.config, self.config.times, self.coord
        it, attempt = step.iteration, step.attempt
        faults = self._faults.get((dp, it), ())
        extra = 0
        for i, f in faults:
            if not isinstance(f, MemoryFault | NetworkError):
                self._fired.add(i)
            if isinstance(f, ExecutorHang):
                self._struck[dp] = now_ns()
                emit("executor", "hang", dp=dp, iteration=it)
                await anyio.sleep_forever()
            if isinstance(f, ExecutorCrash):
                self._struck[dp] = now_ns()
                raise ExecutorCrashed
            if isinstance(f, SlowIteration):
                extra += f.extra_ns
        if cfg.host_jitter_mean_ns:
            extra += int(self._jitter[dp].exponential(cfg.host_jitter_mean_ns))
        seqs = list(self.active[dp])

        async def kernel(ns: int) -> None:
            await coord.compute(dp, it, attempt, ns)

        for layer in range(cfg.layers):
            await kernel(t.attention_ns + (extra if layer == 0 else 0))
            if layer == 0:  # attention writes this position's KV, in place
                for s in seqs:
                    s.rows.append(self.decoder.kv_row(s.tokens[-1], len(s.rows)))
            for i, f in faults:
                if isinstance(f, NetworkError) and f.layer == layer and attempt < f.attempts:
                    self._fired.add(i)
                    coord.report(dp, it, attempt, f.code)
                    raise RolledBack
            await coord.barrier(it, attempt, f"dispatch-{layer}").wait(dp)
            await kernel(t.dispatch_ns + round(t.expert_ns * self.expert_scale))
            await coord.barrier(it, attempt, f"combine-{layer}").wait(dp)
            await kernel(t.combine_ns)
        await kernel(t.head_ns)
        tokens = {s.request: self.decoder.next_token(s.rows) for s in seqs}
        await coord.barrier(it, attempt, "commit").wait(dp)
        return tokens

    # -- output processor ---------------------------------------------------------------------
    async def _output_processor(self, dp: int) -> None:
        async for request, token in self._out_recv[dp]:
            self.streamed[request].append(token)

    def _drain_outputs(self) -> None:
        """Tokens committed at the instant the engine stopped: the output subprocess still
        delivers them (they were released to it)."""
        for stream in self._out_recv:
            while True:
                try:
                    request, token = stream.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                self.streamed[request].append(token)
