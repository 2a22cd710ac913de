"""MoE-attention disaggregated decode (SPEC 10.3, P105-P111, Figures 18-19).

Attention dies hold the KV cache and run MLA; expert dies run the MoE layers; the two pools meet
through A2E/E2A (:mod:`xds.fabric.xccl.a2e`). Three mechanisms keep both pools busy:

* **DP domains.** The attention dies form ``domains`` groups. Only one domain talks to the expert
  dies at a time: turns go in rotation order d0 -> d1 -> d2 -> d0 to the domains with a batch
  ready (P111's HAS_READY_DOMAIN), one layer's microbatches in order per turn (A27); while one
  domain communicates, the others compute MLA. ``domain_turns="relaxed"`` lets the next
  domain's A2E start while the previous domain's E2A is still in flight. Domains start a
  fraction of an iteration apart (``domain_start``), so they interleave.
* **Microbatches.** Each attention die splits its batch in ``microbatches``; while one
  microbatch's tokens are at the experts, the die computes the other's attention (ping-pong).
* **Persistent kernels.** The expert dies run three long-lived streams, A2E receive -> MoE
  compute -> E2A send, linked by bounded queues (``queue_depth``), with no CPU launch per batch
  (P111). An idle stream busy-polls: it notices new work at its next poll (``poll_ns``).

Tiers: A2E and E2A are collectives over a domain and all expert dies, so this module runs on the
collective tier: one task per DP domain stands for its attention dies (priced at the slowest
die: most live sequences, then longest context), and one task per stream stands for that
stream on every expert die (a collective finishes when its slowest die does; MoE compute is the
busiest expert die of a multinomial routing draw). A2E/E2A costs are measured once on the full
768-die pod at the run's two microbatch sizes and at 1 token per die
(:func:`~xds.serve.ma_config.measure_ae`) and interpolated linearly in between for the
shrinking batches at the end of a run.

Timing of one iteration on a domain: the scheduler gap, then per MTP draft a pass over the MTP
layer, then the main pass over every decoder layer verifying ``1 + k`` tokens per sequence.
Within a pass, per layer and microbatch: wait for that microbatch's previous E2A, run the
attention-side stage (MLA prolog, attention, output, gating; the dense MLP on dense layers),
hand the microbatch to the expert dies; the pass ends with the LM head and sampling, once for
the whole batch. One graph launch per pass. The last microbatch of the last MoE layer is exposed
(P124).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..config import require_instance, require_int
from ..docfields import document_fields
from ..errors import ConfigError, ProtocolError
from ..fabric.xccl.moe import ExpertMap
from ..hw import ASCEND_910C_DIE
from ..runtime import emit, now_ns, rng, sleep_ns, sleep_until_ns
from ..runtime.nested import run_nested
from ..runtime.sync import Streams, task_group_raising_single
from .decode_model import KernelTimes
from .ma_config import AECosts, MADecodeConfig, ae_layout, measure_ae
from .mtp import tokens_per_step

STREAMS = ("a2e", "moe", "e2a")
"""The expert dies' persistent kernels, in pipeline order."""


class MoEBatch(msgspec.Struct):
    """One (domain, layer, microbatch) on its way through the expert dies."""

    domain: int
    layer: int
    microbatch: int
    tokens_per_die: int
    """Tokens per attention die of the domain in this microbatch."""
    done: anyio.Event
    queued_ns: int = 0
    """When it last entered a queue (the kernel taking it notices it from then)."""
    started: bool = False
    """Its A2E has begun (it counts as in flight until delivered or dropped)."""
    dropped: bool = False
    """The pool stopped before the batch came back (its owner raises)."""


class Span(msgspec.Struct, frozen=True):
    """One piece of work: an expert-die kernel's (``a2e``, ``moe``, ``e2a``) or an attention
    domain's stage (``attention``) on (domain, layer, microbatch)."""

    kind: str
    domain: int
    layer: int
    microbatch: int
    start_ns: int
    end_ns: int


class StreamStats(msgspec.Struct):
    """What one persistent kernel did."""

    items: int = 0
    busy_ns: int = 0


class AECurve:
    """A2E/E2A latency at any token count: linear between the measured points, along the last
    segment beyond them; 0 at 0 tokens (nothing to send)."""

    def __init__(self, points: list[AECosts], *, layout: tuple[object, ...] | None = None):
        """``layout``: :func:`~xds.serve.ma_config.ae_layout` of the deployment the points
        were measured on (:func:`ae_curve` sets it; a decode instance of another layout
        refuses the curve); None for points from elsewhere."""
        self.layout = layout
        pts = sorted({p.tokens_per_die: p for p in points}.values(), key=lambda p: p.tokens_per_die)
        self._x = np.array([0] + [p.tokens_per_die for p in pts], dtype=np.float64)
        self._a2e = np.array([0] + [p.a2e_ns for p in pts], dtype=np.float64)
        self._e2a = np.array([0] + [p.e2a_ns for p in pts], dtype=np.float64)
        self.points = pts

    def _at(self, ys: np.ndarray, tokens: int) -> int:
        if tokens <= 0:
            return 0
        x = self._x
        if tokens >= x[-1] and len(x) > 2:  # extrapolate along the last segment
            slope = (ys[-1] - ys[-2]) / (x[-1] - x[-2])
            return round(ys[-1] + slope * (tokens - x[-1]))
        return round(float(np.interp(tokens, x, ys)))

    def a2e_ns(self, tokens: int) -> int:
        return self._at(self._a2e, tokens)

    def e2a_ns(self, tokens: int) -> int:
        return self._at(self._e2a, tokens)


class MoEPool:
    """The expert dies: three persistent kernels linked by bounded queues (P111).

    Attention domains :meth:`submit` batches; the A2E kernel gives turns in rotation order to
    the domains with a batch ready, the MoE kernel computes, the E2A kernel returns them and
    sets each batch's ``done``. :meth:`run` hosts the kernels in one task group: a failure in
    one cancels its siblings and propagates. :meth:`close` ends a domain's input (once every
    domain has closed, the kernels drain, then exit). :meth:`stop` is SYSTEM_STATE = STOPPED:
    each kernel finishes the batch in flight and exits, idle ones at once, and batches still
    queued come back ``dropped``.
    """

    def __init__(
        self, config: MADecodeConfig, times: KernelTimes, curve: AECurve, *, record: bool = False
    ):
        self.config = config
        self.spans: list[Span] | None = [] if record else None
        """With ``record``: every kernel's work, in order (for tests and plots)."""
        self.times = times
        self.curve = curve
        self.gen = rng("ma-decode/expert-routing")
        self.stats = {name: StreamStats() for name in STREAMS}
        self.state = "running"
        self.streams = Streams()
        """Every stream of the pool (closed when the instance has served)."""
        inboxes = [self.streams.create(MoEBatch, math.inf) for _ in range(config.domains)]
        self._inbox_send = [s for s, _ in inboxes]
        self._inbox_recv = [r for _, r in inboxes]
        self._to_moe = self.streams.create(MoEBatch, config.queue_depth)
        self._to_e2a = self.streams.create(MoEBatch, config.queue_depth)
        self._in_flight = 0
        """Batches whose A2E started and whose E2A has not delivered."""
        self._drained: anyio.Event | None = None
        self._arrival = anyio.Event()
        """Set when a domain submits or closes (wakes an idle A2E kernel)."""
        m = config.spec
        self._n_shared = config.shared_expert_dies
        emap = ExpertMap(m.routed_experts + self._n_shared, config.expert_dies)
        self._die_of = np.array([emap.slots_rank[reps[0]] for reps in emap.replicas])
        """Expert die of each logical expert (routed, then shared instances): A2E's map."""
        self._waiting: dict[str, anyio.CancelScope] = {}
        """Kernels blocked on a queue (cancelled by :meth:`stop`)."""
        self.stopped_ns = 0
        """When the kernels exited (:meth:`run`)."""

    # -- the attention side's interface -----------------------------------------------------------
    def submit(self, domain: int, layer: int, microbatch: int, tokens_per_die: int) -> MoEBatch:
        """Hand a microbatch to the expert dies (never blocks: the domain's A2E waits for its
        turn); await ``batch.done`` for its E2A."""
        if self.state != "running":
            raise ProtocolError(f"MoE pool is {self.state}: domain {domain} cannot submit")
        batch = MoEBatch(domain, layer, microbatch, tokens_per_die, anyio.Event(), now_ns())
        self._inbox_send[domain].send_nowait(batch)
        self._arrival.set()
        return batch

    def close(self, domain: int) -> None:
        """Domain ``domain`` sends no more batches (the rotation skips it from now on)."""
        self._inbox_send[domain].close()
        self._arrival.set()

    def stop(self) -> None:
        """SYSTEM_STATE = STOPPED (see the class docstring)."""
        if self.state == "stopped":
            return
        self.state = "stopped"
        for scope in list(self._waiting.values()):
            scope.cancel()
        for recv in (*self._inbox_recv, self._to_moe[1], self._to_e2a[1]):
            while True:
                try:
                    self._drop(recv.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break

    def utilisation(self, span_ns: int) -> dict[str, float]:
        """Busy share of each kernel over ``span_ns``."""
        return {n: s.busy_ns / span_ns if span_ns else 0.0 for n, s in self.stats.items()}

    # -- the kernels ------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._a2e_kernel, name="expert dies: A2E receive kernel")
                tg.start_soon(self._moe_kernel, name="expert dies: MoE compute kernel")
                tg.start_soon(self._e2a_kernel, name="expert dies: E2A send kernel")
        finally:
            self.stopped_ns = now_ns()

    async def _a2e_kernel(self) -> None:
        """Turns: the next domain in rotation order with a batch ready (P111's
        HAS_READY_DOMAIN) sends its microbatches of one layer, in order."""
        cfg = self.config
        send = self._to_moe[0]
        open_domains = list(range(cfg.domains))
        last = cfg.domains - 1
        async with send:
            while (turn := await self._next_turn(open_domains, last)) is not None:
                d, batch = turn
                last = d
                for mb in range(cfg.microbatches):
                    if mb:
                        batch = await self._take("a2e", self._inbox_recv[d])
                        if batch is None:  # stopped, or the domain closed
                            break
                    if mb == 0 and cfg.domain_turns == "exclusive":
                        await self._wait_drained()  # the previous domain's E2A has delivered
                    if self.state != "running":
                        self._drop(batch)
                        return
                    self._in_flight += 1
                    batch.started = True
                    await self._work("a2e", self.curve.a2e_ns(batch.tokens_per_die), batch)
                    if not await self._forward("a2e", send, batch):
                        return

    async def _moe_kernel(self) -> None:
        cfg = self.config
        send, recv = self._to_e2a[0], self._to_moe[1]
        async with send:
            while (batch := await self._take("moe", recv)) is not None:
                tokens = batch.tokens_per_die * cfg.attention_dies_per_domain
                await self._work("moe", self._expert_ns(tokens), batch)
                if not await self._forward("moe", send, batch):
                    return

    async def _e2a_kernel(self) -> None:
        recv = self._to_e2a[1]
        while (batch := await self._take("e2a", recv)) is not None:
            await self._work("e2a", self.curve.e2a_ns(batch.tokens_per_die), batch)
            emit("ma", "e2a", domain=batch.domain, layer=batch.layer, microbatch=batch.microbatch)
            self._delivered(batch)

    def _expert_ns(self, tokens_total: int) -> int:
        """MoE compute of one batch: the busiest expert die, the batch's routed copies drawn
        over the routed experts (multinomial, uniform gating), each token also visiting one
        shared-expert instance; experts sit where the A2E/E2A expert map puts them."""
        if not tokens_total:
            return 0
        m = self.config.spec
        routed = self.gen.multinomial(
            tokens_total * m.top_k, np.full(m.routed_experts, 1.0 / m.routed_experts)
        )
        per_expert = self.times.expert_ns_of(routed)
        if self._n_shared:
            shared = self.times.expert_ns(tokens_total / self._n_shared)
            per_expert = np.concatenate([per_expert, np.full(self._n_shared, float(shared))])
        die_ns = np.bincount(self._die_of, weights=per_expert, minlength=self.config.expert_dies)
        return round(float(die_ns.max()))

    # -- helpers ----------------------------------------------------------------------------
    async def _next_turn(self, open_domains: list[int], last: int) -> tuple[int, MoEBatch] | None:
        """The first batch of the next turn: from the first domain after ``last`` in rotation
        order that has one ready, waiting (and noticing at the next poll) if none has; None
        once every domain has closed or the pool stopped."""
        n = self.config.domains
        free = now_ns()
        while self.state == "running":
            for d in sorted(open_domains, key=lambda x: (x - last - 1) % n):
                try:
                    batch = self._inbox_recv[d].receive_nowait()
                except anyio.WouldBlock:
                    continue
                except anyio.EndOfStream:
                    open_domains.remove(d)
                    continue
                if await self._notice(batch, free):
                    return d, batch
                return None
            if not open_domains:
                return None
            self._arrival = anyio.Event()
            if not await self._wait("a2e", self._arrival.wait):
                return None
        return None

    async def _take(
        self, kernel: str, recv: MemoryObjectReceiveStream[MoEBatch]
    ) -> MoEBatch | None:
        """The next batch, or None once the queue ended or the pool stopped. A kernel that had
        to wait notices the batch at its next poll (a batch it holds when the pool stops there
        is dropped)."""
        if self.state != "running":
            return None
        free = now_ns()
        got: list[MoEBatch] = []
        try:
            got.append(recv.receive_nowait())
        except anyio.WouldBlock:

            async def receive() -> None:
                got.append(await recv.receive())

            try:
                if not await self._wait(kernel, receive):
                    return None
            except anyio.EndOfStream:
                return None
        except anyio.EndOfStream:
            return None
        return got[0] if await self._notice(got[0], free) else None

    async def _notice(self, batch: MoEBatch, free_ns: int) -> bool:
        """A kernel free since ``free_ns`` takes ``batch``: queued by then, it sees it at once;
        queued later, at its first poll from then (the same on every backend, whatever order
        same-instant events run in). False, the batch dropped, if the pool stopped meanwhile."""
        poll = self.config.poll_ns
        q = batch.queued_ns
        if q > free_ns:
            seen = -(-q // poll) * poll if poll else q
            if seen > now_ns():
                await sleep_until_ns(seen)
        if self.state != "running":
            self._drop(batch)
            return False
        return True

    async def _wait(self, kernel: str, fn: Callable[[], Awaitable[object]]) -> bool:
        """Await ``fn()`` as a wait :meth:`stop` can interrupt; False if it did."""
        with anyio.CancelScope() as scope:
            self._waiting[kernel] = scope
            try:
                await fn()
            finally:
                del self._waiting[kernel]
        return not scope.cancelled_caught

    async def _forward(
        self, kernel: str, send: MemoryObjectSendStream[MoEBatch], batch: MoEBatch
    ) -> bool:
        """Pass ``batch`` downstream (waiting while the bounded queue is full); False if the
        pool stopped meanwhile (the batch is dropped)."""
        batch.queued_ns = now_ns()
        if self.state == "running" and await self._wait(
            kernel, functools.partial(send.send, batch)
        ):
            return True
        self._drop(batch)
        return False

    async def _work(self, kernel: str, cost_ns: int, batch: MoEBatch) -> None:
        s = self.stats[kernel]
        s.items += 1
        s.busy_ns += cost_ns
        start = now_ns()
        await sleep_ns(cost_ns)
        if self.spans is not None:
            self.spans.append(
                Span(kernel, batch.domain, batch.layer, batch.microbatch, start, now_ns())
            )

    async def _wait_drained(self) -> None:
        while self._in_flight and self.state == "running":
            self._drained = anyio.Event()
            await self._wait("a2e", self._drained.wait)

    def _delivered(self, batch: MoEBatch) -> None:
        batch.done.set()
        if batch.started:
            batch.started = False
            self._in_flight -= 1
            if self._in_flight == 0 and self._drained is not None:
                self._drained.set()

    def _drop(self, batch: MoEBatch) -> None:
        batch.dropped = True
        self._delivered(batch)


class DomainRun(msgspec.Struct):
    """One DP domain's iterations."""

    iteration_ns: list[int] = []
    tokens: list[int] = []
    """Tokens committed by the domain's attention dies in each iteration."""
    tokens_per_step: list[float] = []
    """Mean tokens committed per live sequence in each iteration."""


class MADecodeResult(msgspec.Struct):
    """What a MoE-attention disaggregated decode run did. Iteration times, tokens per step,
    rates and the stage and MTP-pass means skip each domain's first ``warmup`` iterations
    (:meth:`MADecodeInstance.serve`); the busy shares and the MoE mean cover the whole run."""

    domains: list[DomainRun]
    warmup: int
    elapsed_ns: int
    requests: int
    chips: float
    mean_mtp_pass_ns: float
    mean_stage_ns: float
    """Attention-side stage of one layer and microbatch (MLA prolog, attention, output,
    gating; P124's 0.7 ms), averaged over the MoE layers of main passes."""
    attention_busy: float
    """Share of the run a domain's slowest attention die computes (the rest it waits on E2A,
    the scheduler or launches)."""
    stream_busy: dict[str, float]
    """Busy share of each expert-die kernel (a2e, moe, e2a) over the run."""
    ae: list[AECosts]
    """The measured A2E/E2A points."""
    mean_moe_ns: float
    """MoE compute per batch (busiest expert die)."""

    @property
    def iterations(self) -> int:
        """Iterations of the longest-running domain (MTP acceptance can finish one domain's
        sequences an iteration before another's; the rotation then skips it)."""
        return max((len(d.iteration_ns) for d in self.domains), default=0)

    @property
    def tokens(self) -> int:
        return sum(sum(d.tokens) for d in self.domains)

    def _steady(self, values: list) -> list:
        return values[self.warmup :] or values

    @property
    def mean_iteration_ns(self) -> float:
        """Per domain: scheduler gap + MTP passes + main pass (SPEC 12.3's 93 ms includes the
        gap)."""
        its = [t for d in self.domains for t in self._steady(d.iteration_ns)]
        return float(np.mean(its)) if its else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        steps = [x for d in self.domains for x in self._steady(d.tokens_per_step)]
        return float(np.mean(steps)) if steps else 0.0

    @property
    def tpot_ns(self) -> float:
        return self.mean_iteration_ns / self.mean_tokens_per_step if self.domains else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Steady throughput: each domain's tokens over its own iterations' time, summed."""
        return sum(
            sum(self._steady(d.tokens)) / (sum(self._steady(d.iteration_ns)) / 1e9)
            for d in self.domains
            if sum(d.iteration_ns)
        )

    @property
    def tokens_per_s_per_chip(self) -> float:
        """Over every chip of the deployment, expert dies included (A28)."""
        return self.tokens_per_s / self.chips


class MADecodeInstance:
    """A MoE-attention disaggregated decode deployment serving its fixed workload: every
    attention die holds ``batch_per_die`` sequences from the start (prefilled elsewhere) and
    decodes them to ``output_tokens`` with MTP (ignore-eos, greedy)."""

    def __init__(
        self,
        config: MADecodeConfig,
        curve: AECurve | None = None,
        *,
        seed: int = 0,
        record: bool = False,
    ):
        require_instance(config, MADecodeConfig, "config")
        if curve is not None:
            require_instance(curve, AECurve, "curve")
            if curve.layout is not None and curve.layout != ae_layout(config):
                raise ConfigError(
                    "curve was measured on another layout (model, pools, wire formats or "
                    f"mode): {curve.layout} against this deployment's {ae_layout(config)}; "
                    "measure it with ae_curve(config)",
                    field="curve",
                )
        self.config = config
        self.times = KernelTimes(
            config.spec,
            ASCEND_910C_DIE,
            precision=config.precision,
            efficiency=config.efficiency,
        )
        if curve is None:  # measured now: runs of their own, outside this run's time
            curve = run_nested(lambda: ae_curve(config, seed=seed), name="xds-ae-curve")
        self.curve = curve
        self.pool = MoEPool(config, self.times, self.curve, record=record)
        self._stage: list[int] = []
        self._mtp_pass: list[int] = []
        self._compute_ns = np.zeros(config.domains, dtype=np.int64)
        self._windows_done = 0
        """Domains that have recorded their window (see :meth:`serve`)."""
        self._served = False

    async def serve(
        self, *, max_iterations: int | None = None, from_token: int = 0, warmup: int = 1
    ) -> MADecodeResult:
        """Decode every sequence to ``output_tokens`` (or for ``max_iterations``), starting
        ``from_token`` tokens into the output (a window mid-run: contexts start at
        ``input_tokens + from_token``). Prefill made each sequence's first output token, so
        decode starts at token 1 at the earliest (``from_token`` 0 means 1) and runs the
        rest, as colocated decode does. Means and rates skip each domain's first ``warmup``
        iterations, where the domains start together rather than in their rotation; a warmup
        that would leave none (``max_iterations`` or the tokens to decode at most as many)
        skips none, and the result's ``warmup`` says 0."""
        cfg = self.config
        from_token = max(1, require_int(from_token, "from_token", high=cfg.output_tokens - 1))
        warmup = require_int(warmup, "warmup")
        if max_iterations is not None:
            max_iterations = require_int(max_iterations, "max_iterations", low=1)
        most = cfg.output_tokens - from_token if max_iterations is None else max_iterations
        if warmup >= most:  # nothing would be left: every iteration counts (and the result
            warmup = 0  # says so), as when a domain ends within its warmup
        if self._served:
            raise ProtocolError(
                "this MADecodeInstance has served its workload (its expert dies' kernels have "
                "exited): make a new instance (pass it the same AECurve to skip re-measuring)"
            )
        self._served = True
        start = now_ns()
        runs = [DomainRun() for _ in range(cfg.domains)]
        try:
            async with task_group_raising_single() as tg:  # one failure arrives as itself
                tg.start_soon(self.pool.run, name="expert dies")
                async with task_group_raising_single() as domains:
                    for d in range(cfg.domains):
                        domains.start_soon(
                            self._domain,
                            d,
                            runs[d],
                            max_iterations,
                            from_token,
                            warmup,
                            name=f"attention domain {d}",
                        )
        finally:
            self.pool.streams.close()
        elapsed = now_ns() - start
        moe = self.pool.stats["moe"]
        return MADecodeResult(
            domains=runs,
            warmup=warmup,
            elapsed_ns=elapsed,
            requests=cfg.attention_dies * cfg.batch_per_die,
            chips=cfg.chips,
            mean_mtp_pass_ns=float(np.mean(self._mtp_pass)) if self._mtp_pass else 0.0,
            mean_stage_ns=float(np.mean(self._stage)) if self._stage else 0.0,
            attention_busy=float(self._compute_ns.mean() / elapsed) if elapsed else 0.0,
            stream_busy=self.pool.utilisation(elapsed),
            ae=self.curve.points,
            mean_moe_ns=moe.busy_ns / max(1, moe.items),
        )

    async def _domain(
        self, d: int, run: DomainRun, max_iterations: int | None, from_token: int, warmup: int
    ) -> None:
        """Domain ``d``'s decode loop, recorded into ``run``."""
        cfg, m = self.config, self.config.spec
        k = cfg.mtp_config.k
        shape = (cfg.attention_dies_per_domain, cfg.batch_per_die)
        remaining = np.full(shape, cfg.output_tokens - from_token, dtype=np.int64)
        context = np.full(shape, cfg.input_tokens + from_token, dtype=np.int64)
        gen = rng(f"ma-decode/mtp/{d}")
        if cfg.domain_start == "staggered" and d:
            await sleep_ns(d * self._iteration_estimate_ns(remaining > 0, context) // cfg.domains)
        try:
            # a window (max_iterations) records that many iterations per domain; a domain
            # that has its window keeps decoding, unrecorded, until every domain has, so the
            # recorded iterations all see the same contention
            while remaining.any() and (max_iterations is None or self._windows_done < cfg.domains):
                n = len(run.iteration_ns)
                recording = max_iterations is None or n < max_iterations
                steady = recording and n >= warmup
                t0 = now_ns()
                live = remaining > 0
                mbs = self._microbatches(live, context)
                await sleep_ns(cfg.scheduler_gap_ns)
                for _ in range(k):  # each draft depth is its own pass over the MTP layer
                    t_mtp = now_ns()
                    await self._pass(d, mbs, 1.0, m.layers, dense=0, moe=1, mtp=True)
                    if steady:
                        self._mtp_pass.append(now_ns() - t_mtp)
                await self._pass(
                    d, mbs, 1.0 + k, 0, dense=m.dense_layers, moe=m.moe_layers, steady=steady
                )
                committed = tokens_per_step(cfg.mtp_config, gen, remaining.size).reshape(shape)
                committed = np.minimum(committed, remaining) * live
                remaining -= committed
                context += committed
                if recording:
                    run.tokens.append(int(committed.sum()))
                    run.tokens_per_step.append(float(committed.sum() / live.sum()))
                    run.iteration_ns.append(now_ns() - t0)
                    if len(run.iteration_ns) == max_iterations:
                        self._windows_done += 1
        finally:
            self.pool.close(d)  # the rotation skips this domain from now on

    def _iteration_estimate_ns(self, live: np.ndarray, context: np.ndarray) -> int:
        """A domain's attention-side work in one iteration from this state: scheduler gap,
        launches, every layer's stage per microbatch, MTP projection, LM head and sampling
        (no waiting on the expert dies)."""
        cfg, m, times = self.config, self.config.spec, self.times
        k = cfg.mtp_config.k
        mbs = self._microbatches(live, context)
        total = sum(seqs for seqs, _ in mbs)
        t = cfg.scheduler_gap_ns + (k + 1) * cfg.efficiency.graph_launch_ns
        for tps, layers, dense in ((1.0, range(m.layers, m.layers + 1), 0),) * k + (
            (1.0 + k, range(m.layers), m.dense_layers),
        ):
            for i, layer in enumerate(layers):
                for seqs, ctx in mbs:
                    t += self._stage_ns(seqs, tps, ctx, layer, dense_layer=i < dense)
            t += sum(times.head_ns(total * tps))
        return t + k * times.cost.mtp_projection(float(total)).time_ns

    def _stage_ns(
        self, seqs: int, tokens_per_seq: float, context: int, layer: int, *, dense_layer: bool
    ) -> int:
        """The attention-side stage of one layer and microbatch: MLA prolog, attention and
        output, then gating (MoE layer) or the dense MLP (dense layer)."""
        attn, other, gate = self.times.attention_part(seqs, tokens_per_seq, context, layer)
        if dense_layer:
            return attn + other + self.times.dense_mlp_ns(float(round(seqs * tokens_per_seq)))
        return attn + other + gate

    def _microbatches(self, live: np.ndarray, context: np.ndarray) -> list[tuple[int, int]]:
        """(sequences, mean context) of each microbatch of the domain's slowest die: the one
        with the most live sequences, then the longest mean context."""
        seqs = live.sum(axis=1)
        mean_ctx = (context * live).sum(axis=1) // np.maximum(seqs, 1)
        die = int(np.lexsort((mean_ctx, seqs))[-1])
        ctx = context[die][live[die]]
        return [
            (len(part), int(part.mean()) if len(part) else 0)
            for part in np.array_split(ctx, self.config.microbatches)
        ]

    async def _pass(
        self,
        d: int,
        mbs: list[tuple[int, int]],
        tokens_per_seq: float,
        first_layer: int,
        *,
        dense: int,
        moe: int,
        mtp: bool = False,
        steady: bool = False,
    ) -> None:
        cfg = self.config
        times = self.times
        await sleep_ns(cfg.efficiency.graph_launch_ns)
        total = sum(seqs for seqs, _ in mbs)
        compute = 0
        if mtp and total:  # the MTP layer's input projection, once for the whole batch
            proj = times.cost.mtp_projection(float(total)).time_ns
            compute += proj
            await sleep_ns(proj)
        pending: list[MoEBatch | None] = [None] * len(mbs)
        for i in range(dense + moe):
            layer = first_layer + i
            for mb, (seqs, ctx) in enumerate(mbs):
                batch = pending[mb]
                if batch is not None:
                    await self._returned(d, batch)
                tokens = round(seqs * tokens_per_seq)
                stage = self._stage_ns(seqs, tokens_per_seq, ctx, layer, dense_layer=i < dense)
                if steady and seqs and i >= dense:
                    self._stage.append(stage)
                compute += stage
                start = now_ns()
                await sleep_ns(stage)
                if self.pool.spans is not None:
                    self.pool.spans.append(Span("attention", d, layer, mb, start, now_ns()))
                pending[mb] = self.pool.submit(d, layer, mb, tokens) if i >= dense else None
        for batch in pending:
            if batch is not None:
                await self._returned(d, batch)
        if total:  # LM head and sampling, once for the whole batch (one graph)
            head, samp = times.head_ns(total * tokens_per_seq)
            compute += head + samp
            await sleep_ns(head + samp)
        self._compute_ns[d] += compute

    @staticmethod
    async def _returned(d: int, batch: MoEBatch) -> None:
        """Wait for ``batch``'s E2A; a batch the stopped pool dropped is an error here."""
        await batch.done.wait()
        if batch.dropped:
            raise ProtocolError(
                f"domain {d}: layer {batch.layer} microbatch {batch.microbatch} was dropped: "
                "the MoE pool stopped"
            )


def ae_curve(config: MADecodeConfig, *, seed: int = 0) -> AECurve:
    """A2E/E2A measured at the token counts of a full microbatch in the main pass and in an
    MTP pass (the run's steady state), and at 1 token per die (the fixed costs, for the
    small batches at the end of a run)."""
    first = config.microbatch_seqs[0]
    counts = sorted({1, first * (1 + config.mtp_config.k), first})
    return AECurve([measure_ae(config, n, seed=seed) for n in counts], layout=ae_layout(config))


document_fields(MADecodeResult, DomainRun, Span, MoEBatch)
