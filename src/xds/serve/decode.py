"""Colocated decode on FlowServe: DP groups, the TE-shell, MTP steps, the iteration clock.

A *decode instance* runs DP attention on every die and EP for the MoE layers across all of
them (SPEC 6.1). Requests enter through the TE-shell, which routes each one once
(:mod:`xds.serve.routing`); each DP group is a self-contained stack: its DP master admits
requests into its KV blocks under a batch limit, its executor runs one forward pass per
iteration, and its output processor streams committed tokens straight to the frontend
(output shortcutting, SPEC 6.2), never through the TE-shell.

One iteration (SPEC 8.3, P123): MTP forward + sampling, then the main model verifies
``1 + k`` tokens per sequence through all layers + final sampling and the accept check, then
the scheduler gap; :mod:`xds.serve.decode_model` prices it (and holds :class:`DecodeConfig`,
re-exported here).

Two fidelity tiers (ARCHITECTURE.md): ``layer`` - every die is a task that sleeps through its
own per-layer work and meets the others at each dispatch barrier; ``iteration`` - the same
quantities for all dies at once in numpy, one event per iteration. Both draw the same random
numbers (routing counts, jitter, MTP acceptance) from the same named streams.
"""

from __future__ import annotations

import functools

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..config import require_instance, require_int
from ..docfields import document_fields
from ..errors import ConfigError
from ..hw import CloudMatrix384
from ..runtime import Barrier, emit, now_ns, rng, sleep_ns
from ..runtime.sync import task_group_raising_single
from .decode_model import (
    Breakdown,
    CommCosts,
    DecodeConfig,
    DecodeModel,
    IterationOutcome,
    decode_kv_capacity,
    decode_weight_bytes,
    measure_comm,
)
from .eplb.online import OnlineEPLB
from .jitter import sample
from .kv import KVBlockManager
from .mtp import tokens_per_step
from .routing import DecodeRouter, DecodeRouting, lowest_kv

__all__ = [
    "Breakdown",
    "CommCosts",
    "DecodeConfig",
    "DecodeInstance",
    "DecodeModel",
    "DecodeResult",
    "IterationOutcome",
    "decode_kv_capacity",
    "decode_weight_bytes",
    "measure_comm",
]


class DecodeResult(msgspec.Struct):
    iterations: int
    elapsed_ns: int
    tokens: int
    requests: int
    mean_iteration_ns: float
    mean_tokens_per_step: float
    breakdown: Breakdown
    first_dispatch_max_over_min: float
    """The largest, over steady-state iterations (every DP at the same batch), of max/min
    over dies of the first dispatch's duration (the paper's "up to 10x")."""
    iteration_ns: list[int]
    rebalances: int = 0
    """Expert re-placements the online EPLB started during the run (0 without EPLB)."""


def check_batch_fits(config: DecodeConfig, capacity: int | None = None) -> None:
    """A fixed batch (``batch_per_die`` sequences of ``input_tokens + output_tokens``) fits a
    die's KV blocks (``capacity``, default: what the die's HBM leaves); else ConfigError."""
    if capacity is None:
        capacity = config.kv_blocks_per_die or decode_kv_capacity(config, CloudMatrix384())
    total = config.input_tokens + config.output_tokens
    need = -(-total // config.block_tokens) * config.batch_per_die
    if need > capacity:
        raise ConfigError(
            f"a DP's {config.batch_per_die} sequences of {total} tokens need {need} KV blocks; "
            f"a die has {capacity}",
            field="batch_per_die",
        )


def _check_comm_tokens(config: DecodeConfig, comm: CommCosts, comm_mtp: CommCosts | None) -> None:
    """The costs price the passes they were measured for: the main pass carries
    ``batch_per_die * (1 + k)`` tokens per die, the MTP pass ``batch_per_die`` (else
    ConfigError naming the argument and the ``measure_comm`` call that fits)."""
    b, k = config.batch_per_die, config.mtp_config.k
    wanted = [("comm", comm, b * (1 + k), "the main pass")]
    if k:
        if comm_mtp is None:
            raise ConfigError(
                f"MTP (k={k}) runs a pass of {b} tokens per die: pass its costs too, "
                f"comm_mtp=measure_comm(config, {b})",
                field="comm_mtp",
            )
        wanted.append(("comm_mtp", comm_mtp, b, "the MTP pass"))
    for name, costs, tokens, what in wanted:
        if costs.dies and costs.dies != config.dies:
            raise ConfigError(
                f"measured on {costs.dies} dies, but this deployment has {config.dies}: use "
                f"measure_comm(config, {tokens})",
                field=name,
            )
        if costs.tokens_per_die != tokens:
            raise ConfigError(
                f"measured at {costs.tokens_per_die} tokens per die, but {what} carries "
                f"{tokens} (batch_per_die={b}, MTP k={k}): use measure_comm(config, {tokens})",
                field=name,
            )


class DecodeInstance:
    """A colocated decode instance running as tasks: TE-shell, DP groups, output processors."""

    def __init__(
        self,
        config: DecodeConfig,
        comm: CommCosts,
        comm_mtp: CommCosts | None = None,
        *,
        tier: str = "iteration",
        routing: DecodeRouting = lowest_kv,
    ):
        """``comm``: one MoE layer's dispatch/combine at the main pass's tokens per die
        (``batch_per_die * (1 + k)``); ``comm_mtp``: the MTP pass's (``batch_per_die``; needed
        when MTP is on; unused when it is off); both as :func:`measure_comm` gives them, for
        this deployment's dies (costs measured on another EP size are refused). ``routing``:
        the TE-shell's choice among DPs below their batch limit (:mod:`xds.serve.routing`)."""
        if tier not in ("iteration", "layer"):
            raise ConfigError(f"unknown tier {tier!r}; choose iteration or layer", field="tier")
        require_instance(config, DecodeConfig, "config")
        require_instance(comm, CommCosts, "comm")
        if comm_mtp is not None:
            require_instance(comm_mtp, CommCosts, "comm_mtp")
        _check_comm_tokens(config, comm, comm_mtp)
        if config.reserve_output_tokens:
            raise ConfigError(
                "applies to a PD replay's Decode TE (xds replay), whose "
                "requests' lengths vary; colocated decode serves fixed lengths, each sequence "
                "holding exactly its blocks",
                field="reserve_output_tokens",
            )
        self.config = config
        self.tier = tier
        self.model = DecodeModel(config, comm, comm_mtp)
        self.eplb: OnlineEPLB | None = None
        if config.eplb is not None:
            m = config.spec
            self.eplb = OnlineEPLB(
                config.eplb,
                layers=m.layers - m.dense_layers,
                experts=m.routed_experts,
                dies=config.dies,
                shared_dies=config.shared_expert_dies,
                gen=rng("decode/eplb"),
            )
            self.model.online = self.eplb
        n = config.dies
        self.router = DecodeRouter(
            n, config.batch_per_die, block_tokens=config.block_tokens, routing=routing
        )
        cap = config.kv_blocks_per_die or self._kv_capacity()
        self.kv = [KVBlockManager(cap, block_tokens=config.block_tokens) for _ in range(n)]
        self.remaining = np.zeros((n, config.batch_per_die), dtype=np.int64)
        self.context = np.zeros((n, config.batch_per_die), dtype=np.int64)
        self.request_of: dict[tuple[int, int], int] = {}
        self.streamed = np.zeros((n, config.batch_per_die), dtype=np.int64)
        """Tokens each sequence's output processor delivered to the frontend."""

    def _kv_capacity(self) -> int:
        return decode_kv_capacity(self.config, self.model.pod)

    # -- the TE-shell, DP masters and output processors --
    async def serve(self, n_requests: int, *, max_iterations: int | None = None) -> DecodeResult:
        """Route ``n_requests`` through the TE-shell to the DP groups, let every DP master
        admit its share (all prefills done before decode starts, SPEC 12.2), then decode."""
        cfg = self.config
        n = cfg.dies
        check_batch_fits(cfg, self.kv[0].capacity)
        n_requests = require_int(n_requests, "n_requests", low=1)
        if n_requests > n * cfg.batch_per_die:
            raise ConfigError(
                f"{n_requests} requests exceed {n} DPs x batch {cfg.batch_per_die}: all must be "
                "admitted before decode starts",
                field="n_requests",
            )
        if max_iterations is not None:
            max_iterations = require_int(max_iterations, "max_iterations", low=1)
        inbox = [
            anyio.create_memory_object_stream[int](max_buffer_size=float("inf")) for _ in range(n)
        ]
        outbox = [
            anyio.create_memory_object_stream[np.ndarray](max_buffer_size=float("inf"))
            for _ in range(n)
        ]
        async with task_group_raising_single() as tg:  # a policy's error as itself
            admitted = anyio.Event()
            pending = [n]

            async def master(dp: int) -> None:
                await self._dp_master(dp, inbox[dp][1])
                pending[0] -= 1
                if not pending[0]:
                    admitted.set()

            for dp in range(n):
                tg.start_soon(master, dp, name=f"dp-master-{dp}")
                tg.start_soon(
                    self._output_processor, dp, outbox[dp][1], name=f"output-processor-{dp}"
                )
            for req in range(n_requests):  # the TE-shell touches each request once
                dp = self.router.route(req, cfg.output_tokens, input_tokens=cfg.input_tokens)
                assert isinstance(dp, int)  # capacity was checked above: never backpressure
                inbox[dp][0].send_nowait(req)
            for send, _ in inbox:
                send.close()
            await admitted.wait()
            self._tg = tg
            try:
                return await self._decode([send for send, _ in outbox], max_iterations)
            finally:
                for send, _ in outbox:
                    send.close()

    async def _dp_master(self, dp: int, requests: MemoryObjectReceiveStream[int]) -> None:
        """One DP master: admit routed requests into KV blocks and free batch slots."""
        cfg = self.config
        slot = 0
        async with requests:
            async for req in requests:
                # ignore-eos, fixed length: the whole sequence's blocks are held from admission
                self.kv[dp].admit(req, cfg.input_tokens + cfg.output_tokens)
                self.router.admitted(req)
                self.remaining[dp, slot] = cfg.output_tokens - 1  # prefill emitted token 1
                self.context[dp, slot] = cfg.input_tokens + 1
                self.request_of[(dp, slot)] = req
                self.streamed[dp, slot] = 1
                slot += 1

    async def _output_processor(
        self, dp: int, stream: MemoryObjectReceiveStream[np.ndarray]
    ) -> None:
        """Output shortcutting: one DP's committed tokens go straight to the frontend."""
        async with stream:
            async for committed in stream:
                self.streamed[dp] += committed

    # -- the iteration loop --
    async def _decode(
        self, outbox: list[MemoryObjectSendStream[np.ndarray]], max_iterations: int | None
    ) -> DecodeResult:
        cfg = self.config
        n = cfg.dies
        start = now_ns()
        bd = Breakdown()
        iteration_ns: list[int] = []
        tokens = 0
        steps = 0.0
        ratios: list[float] = []
        jit_gens = [rng(f"decode/jitter/dp{r}") for r in range(n)]
        mtp_gens = [rng(f"decode/mtp/dp{r}") for r in range(n)]
        routing_gen = rng("decode/routing")
        barrier = Barrier(n) if self.tier == "layer" else None
        it = 0
        while (self.remaining > 0).any() and (max_iterations is None or it < max_iterations):
            live = self.remaining > 0
            seqs = live.sum(axis=1)
            ctx = np.where(seqs > 0, (self.context * live).sum(axis=1) // np.maximum(seqs, 1), 0)
            draws = [sample(cfg.jitter, jit_gens[r], it) for r in range(n)]
            jitter = np.array([d.before_dispatch_ns for d in draws], dtype=np.int64)
            between = max(d.between_passes_ns for d in draws)
            t_iter = now_ns()
            # online EPLB: the passes take the expert mapping now and hold it until they end
            mapping = self.eplb.table.begin_pass() if self.eplb is not None else None
            try:
                if self.tier == "iteration":
                    out = self.model.iteration(seqs, ctx, jitter, routing_gen)
                    await sleep_ns(out.time_ns)
                else:
                    out = await self._layer_iteration(seqs, ctx, jitter, routing_gen, barrier)
            finally:
                if mapping is not None:
                    self.eplb.table.end_pass(mapping)  # type: ignore[union-attr]
            bd.add(out.breakdown)
            fd = out.first_dispatch_ns
            if (seqs == seqs.max()).all():  # steady state only: not the drain at the end,
                # where DPs that already finished wait for the busy ones at every barrier
                ratios.append(float(fd.max() / max(1, fd.min())))
            committed = np.stack(
                [tokens_per_step(cfg.mtp_config, mtp_gens[r], cfg.batch_per_die) for r in range(n)]
            )
            committed = np.minimum(committed, self.remaining) * live
            self.remaining -= committed
            self.context += committed
            tokens += int(committed.sum())
            steps += float(committed.sum() / max(1, live.sum()))
            for r in range(n):
                if committed[r].any():
                    outbox[r].send_nowait(committed[r].copy())
            self._retire(live)
            if self.eplb is not None:
                plans = self.eplb.window_plans(now_ns())
                if plans is not None:  # rebalance in the background; passes never wait
                    self.eplb.reconfigurations += 1
                    self._tg.start_soon(
                        functools.partial(
                            self.eplb.table.reconfigure,
                            plans,
                            prefetch_ns=cfg.eplb.prefetch_ns,
                            load_ns=cfg.eplb.load_ns,
                        )
                    )
            await sleep_ns(cfg.scheduler_gap_ns + between)
            iteration_ns.append(now_ns() - t_iter)
            it += 1
        return DecodeResult(
            iterations=len(iteration_ns),
            elapsed_ns=now_ns() - start,
            tokens=tokens,
            requests=len(self.request_of),
            mean_iteration_ns=float(np.mean(iteration_ns)) if iteration_ns else 0.0,
            mean_tokens_per_step=steps / max(1, len(iteration_ns)),
            breakdown=bd,
            first_dispatch_max_over_min=float(np.max(ratios)) if ratios else 0.0,
            iteration_ns=iteration_ns,
            rebalances=self.eplb.reconfigurations if self.eplb is not None else 0,
        )

    async def _layer_iteration(
        self,
        seqs: np.ndarray,
        ctx: np.ndarray,
        jitter: np.ndarray,
        gen: np.random.Generator,
        barrier: Barrier | None,
    ) -> IterationOutcome:
        """The layer tier: every die a task, meeting the others at each dispatch barrier."""
        cfg, dm = self.config, self.model
        m = dm.model
        eff = cfg.efficiency
        n = cfg.dies
        mtp_experts, main_experts = dm.draw_experts(seqs, gen)
        mtp_proj = dm.cost.mtp_projection(float(seqs.max())).time_ns
        first_dispatch = np.zeros(n, dtype=np.int64)
        t0 = now_ns()

        async def die(r: int) -> None:
            assert barrier is not None
            s = int(seqs[r])
            passes = [(1.0, 0, 0, [e], dm.comm_mtp, m.layers) for e in mtp_experts]
            passes.append(
                (1.0 + cfg.mtp_config.k, m.dense_layers, int(jitter[r]), main_experts, dm.comm, 0)
            )
            for tps, dense, jit, experts, comm, first in passes:

                def layer_ns(x: int, tps: float = tps) -> int:  # attention side, BF16/INT8
                    return sum(dm.attention_part(s, tps, int(ctx[r]), x))

                dmlp = dm.dense_mlp_ns(float(s) * tps)
                gate = dm.attention_part(s, tps, int(ctx[r]))[2]
                mtp_pass = first == m.layers  # (a main pass may also carry 1 token, no dense)
                await sleep_ns(eff.graph_launch_ns + (mtp_proj if mtp_pass else 0))
                lead = sum(layer_ns(first + i) - gate + dmlp for i in range(dense))
                await sleep_ns(lead + layer_ns(first + dense) + jit)
                arrived = now_ns()
                for layer, expert_ns in enumerate(experts):
                    await barrier.wait()  # the dispatch barrier
                    if layer == 0 and first == 0:  # the main pass (a model may have no
                        # dense layers: Qwen3's first layer is MoE)
                        first_dispatch[r] = now_ns() - arrived + comm.dispatch_ns
                    await sleep_ns(comm.dispatch_ns + expert_ns + comm.combine_ns)
                    if layer + 1 < len(experts):
                        await sleep_ns(layer_ns(first + dense + layer + 1))
                        # the next dispatch waits for the slowest DP's attention
                head, samp = dm.head_ns(float(seqs.max()) * tps)
                await sleep_ns(head + samp)
                await barrier.wait()

        async with anyio.create_task_group() as tg:
            for r in range(n):
                tg.start_soon(die, r)
        accounted = dm.account(seqs, ctx, jitter, mtp_experts, main_experts)
        return IterationOutcome(now_ns() - t0, accounted.breakdown, first_dispatch)

    def _retire(self, live_before: np.ndarray) -> None:
        done = live_before & (self.remaining == 0)
        for dp, s in zip(*np.nonzero(done), strict=True):
            req = self.request_of[(int(dp), int(s))]
            self.kv[int(dp)].release(req)
            self.router.finished(req)
            emit("decode", "finished", request=req, dp=int(dp))


document_fields(DecodeResult)
