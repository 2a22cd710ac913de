"""Dispatch and combine for colocated MoE: count, then pull (SPEC 4).

An :class:`EPGroup` is the set of ranks (dies) of one expert-parallel group. Every rank calls
:meth:`EPGroup.dispatch` with its tokens and routing, computes its experts on what it received,
then calls :meth:`EPGroup.combine` with the expert outputs (SPMD, like the real kernels).

Dispatch on each rank (SPEC 4.3):

1. launch; load its tokens (MTE2), quantise to INT8 if the wire dtype is INT8 (vector work, one
   scale per token), and write them into its own managed area grouped by destination rank
   (MTE3): one row per (token, destination rank), in token order;
2. write each destination's metadata field: eventID, how many rows it will receive, offset;
3. **barrier**: poll its own metadata until every rank's field carries this eventID;
4. **pull**: read each peer's block for it (MTE2 over UB), dequantise, store into its output
   (MTE3); peers are spread over its AIVs. Then it tells each peer its block may be reused.

Combine is the same exchange in reverse: each expert rank packs one copy per (token, expert)
output, grouped by source rank; the token's owner pulls its copies and accumulates
``y_t = sum_j W[t, j] * out_{t, j}`` in top-k order in float32 (the owner applies the weights,
SPEC 4.4). Managed blocks and metadata are double-buffered by eventID parity, so consecutive
layers never read each other's metadata.

Die failure (``XCCL.fail_die``) of a rank breaks the group: operations in flight raise
:class:`~xds.errors.DieFailure` as each rank learns of it (the failed rank at once), later ones
too; build a new group after repairing the die (:mod:`xds.fabric.xccl.group_failure`).

Two fidelity tiers share this API (ARCHITECTURE.md "Fidelity tiers"): ``tier="protocol"`` moves
every block and metadata write through the fabric; ``tier="collective"`` makes one event per
collective and computes every rank's completion from all arrival times with the same costs and
ports, replaying the pulls in issue order without tasks (:mod:`xds.fabric.xccl.collective_cost`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import anyio
import msgspec
import numpy as np
from msgspec import Meta

from ...config import check_fields, require_instance
from ...docfields import document_fields
from ...errors import ConfigError, ProtocolError
from ...hw import collective_efficiency
from ...model.numerics import ScaleDtype
from ...runtime import emit, now_ns, sleep_ns, sleep_until_ns, waiting_for
from ..memory import Direction
from ..ub import UBFabric
from . import args, wire
from .collective_cost import ExchangeTimes, exchange_completion
from .group_failure import GroupFailures
from .moe import (
    ExpertMap,
    Layout,
    PullOrder,
    Routed,
    WireDtype,
    combine_row_bytes,
    dispatch_row_bytes,
    layout,
    pull_lanes,
    route,
)

Tier = Literal["protocol", "collective"]
_DISPATCH, _COMBINE = 0, 1
_PHASE_NAMES = ("dispatch", "combine")


class EPConfig(msgspec.Struct, frozen=True, kw_only=True):
    hidden: Annotated[int, Meta(ge=1)]
    top_k: Annotated[int, Meta(ge=1)]
    max_tokens_per_rank: Annotated[int, Meta(ge=1)]
    """Capacity of one (source, destination) block in rows (SPEC 4.2: sized by max batch)."""
    dispatch_dtype: WireDtype = "int8"
    combine_dtype: WireDtype = "bf16"
    scale_dtype: ScaleDtype = "fp32"
    """How an INT8 row's per-token scale travels: FP32 (4 B) or BF16/FP16 (2 B, the scale
    rounded up to one they hold; SPEC 9.3)."""
    n_aiv: int = 48
    pull_order: PullOrder = "static"
    """Which peers each AIV pulls from first (:data:`xds.fabric.xccl.moe.PullOrder`)."""

    def __post_init__(self) -> None:
        check_fields(self)


class DispatchOutput(msgspec.Struct):
    """What one rank received from a dispatch, and what combine needs to send it back."""

    event_id: int
    recv_x: np.ndarray | None
    """[n_recv, H] float32 (dequantised), rows grouped by source rank in rank order and in
    source token order within a rank; ``None`` in size mode."""
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    recv_local_slots: np.ndarray
    """[n_recv, k]: the local expert slot (on this rank) of each top-k entry, -1 elsewhere."""
    rank_prefix: np.ndarray
    """[R + 1]: rows from source rank s are ``rank_prefix[s]:rank_prefix[s+1]``."""
    num_recv_per_local_slot: np.ndarray
    routed: Routed
    send_layout: Layout
    n_tokens: int
    start_ns: int
    barrier_ns: int
    end_ns: int
    rank: int = -1
    """The rank whose dispatch returned this (combine takes it on that rank only)."""
    group: int = -1
    """The group it came from (numbered as built, for combine's check)."""

    @property
    def n_recv(self) -> int:
        return int(self.rank_prefix[-1])

    def padded(self, num_worst_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The fixed-capacity layout (DeepEP ``num_worst_tokens``): the first ``n_recv`` rows
        equal the variable layout; padding rows are zero with all slots ``-1``."""
        n = self.n_recv
        if n > num_worst_tokens:
            raise ProtocolError(
                f"{n} received rows exceed the padded capacity of {num_worst_tokens}"
            )
        k = self.recv_local_slots.shape[1] if self.recv_local_slots.ndim == 2 else 0
        slots = np.full((num_worst_tokens, k), -1, dtype=np.int64)
        slots[:n] = self.recv_local_slots
        x = np.zeros(
            (num_worst_tokens, 0 if self.recv_x is None else self.recv_x.shape[1]), dtype=np.float32
        )
        if self.recv_x is not None:
            x[:n] = self.recv_x
        return x, slots


class _Block(msgspec.Struct):
    """One (source, destination) block of an exchange: its rows, their bytes (bytes mode) and
    the routing side information they carry (token ids, expert slots; also in size mode)."""

    rows: int
    data: bytes | None
    side: np.ndarray


class _Arrival(msgspec.Struct):
    """Collective tier: what one rank brings to an exchange."""

    t_ns: int
    counts: np.ndarray
    costs: tuple[int, float, int]
    blocks: list[_Block]


class _Left(msgspec.Struct):
    """A rank's dispatch or combine cancelled after every rank had arrived (collective tier)
    or after its own barrier (protocol tier): what a retry of the same eventID needs."""

    event_id: int
    at_ns: int
    barrier_ns: int
    """Its barrier: reached (``at_ns >= barrier_ns``) or, collective tier, still ahead."""
    blocks: list[_Block] | None = None
    """Collective tier, left before its barrier: the rows it receives."""
    lead_ns: int = 0
    """Collective tier: from joining to posting its metadata (launch and packing)."""
    tail_ns: int = 0
    """Collective tier: from its barrier to the end of its exchange (the pulls)."""

    @property
    def after_barrier(self) -> bool:
        return self.at_ns >= self.barrier_ns


class EPGroup:
    """An expert-parallel group of dies running dispatch and combine."""

    def __init__(
        self,
        fabric: UBFabric,
        ranks: list[int],
        expert_map: ExpertMap,
        config: EPConfig,
        *,
        tier: Tier = "protocol",
    ):
        require_instance(fabric, UBFabric, "fabric")
        require_instance(expert_map, ExpertMap, "expert_map")
        require_instance(config, EPConfig, "config")
        ranks = args.dies(ranks, "ranks")
        if len(ranks) != expert_map.n_ranks:
            raise ConfigError(
                f"expert map has {expert_map.n_ranks} ranks but the group has {len(ranks)}",
                field="ranks",
            )
        if len(set(ranks)) != len(ranks):
            raise ConfigError("ranks must be distinct dies", field="ranks")
        if config.top_k > expert_map.n_experts:
            raise ConfigError(
                f"top-{config.top_k} routing needs at least {config.top_k} experts; the expert "
                f"map has {expert_map.n_experts}",
                field="config.top_k",
            )
        for die in ranks:
            fabric.pod.check_die(die, what="rank die")
            fabric._check_aivs(die, config.n_aiv)
        if tier not in ("protocol", "collective"):
            raise ConfigError(f"unknown tier {tier!r}", field="tier")
        self.fabric = fabric
        self._fields = fabric.reserve_collective_fields(4)  # (dispatch, combine) x parity
        self.ranks = list(ranks)
        self.expert_map = expert_map
        self.config = config
        self.tier: Tier = tier
        self.R = len(ranks)
        self._serial = args.group_serial()
        self._in_flight: set[tuple[int, int, int]] = set()
        """(rank, phase, eventID) of the exchanges ranks are in now (a second join fails)."""
        self._blocks: dict[tuple[int, int, int, int], _Block] = {}
        self._pending: dict[tuple[int, int, int], set[int]] = {}
        """(rank, phase, parity) -> the ranks that have yet to pull its managed blocks."""
        self._released: dict[tuple[int, int, int], anyio.Event] = {}
        self._posted: dict[tuple[int, int, int], int] = {}
        """(rank, phase, parity) -> the eventID whose blocks it last posted (protocol tier)."""
        self._arrivals: dict[tuple[int, int], dict[int, _Arrival]] = {}
        self._results: dict[tuple[int, int], anyio.Event] = {}
        self._completion: dict[tuple[int, int], _Completion] = {}
        self._seen: dict[tuple[int, int, int], int] = {}
        """(rank, metadata slot, source) -> the eventID last read there (protocol tier)."""
        self._joined: dict[tuple[int, int], int] = {}
        """(rank, phase) -> the eventID of that rank's latest dispatch or combine (diagnostics)."""
        self._left: dict[tuple[int, int], _Left] = {}
        """(rank, phase) -> that rank's latest exchange cancelled late (see :class:`_Left`)."""
        self._completed: dict[tuple[int, int, int], int] = {}
        """(rank, phase, parity) -> the eventID of the last exchange it completed there."""
        self._failures = GroupFailures(
            fabric, self.ranks, "dispatch/combine", on_new_run=self._start_idle
        )

    def _start_idle(self) -> None:
        """A later run on the fabric: no exchange of an earlier timeline is in progress."""
        for state in (
            self._blocks,
            self._pending,
            self._released,
            self._posted,
            self._arrivals,
            self._results,
            self._completion,
            self._seen,
            self._joined,
            self._left,
            self._completed,
            self._in_flight,
        ):
            state.clear()

    # -- public API ------------------------------------------------------------------------------
    async def dispatch(
        self,
        rank: int,
        x: np.ndarray | int,
        topk_idx: np.ndarray,
        event_id: int,
        *,
        positions: np.ndarray | None = None,
    ) -> DispatchOutput:
        """Dispatch this rank's tokens ``x`` ([B, H] float32, or B in size mode)."""
        cfg = self.config
        rank = self._check_rank(rank)
        event_id = args.event_id(event_id)
        bytes_mode = self.fabric.mode == "bytes"
        n_tokens, data = args.tokens(x, bytes_mode=bytes_mode, hidden=cfg.hidden)
        x = data if bytes_mode else n_tokens
        topk_idx = args.expert_ids(topk_idx, (n_tokens, cfg.top_k))
        routed = route(topk_idx, self.expert_map, positions)
        lay = layout(routed, self.R)
        row_bytes = dispatch_row_bytes(cfg.hidden, cfg.top_k, cfg.dispatch_dtype, cfg.scale_dtype)
        blocks: list[_Block] = []
        dt = wire.dispatch_dtype(cfg.hidden, cfg.top_k, cfg.dispatch_dtype, cfg.scale_dtype)
        side_dt = wire.dispatch_side_dtype(cfg.top_k)
        # every destination's side rows at once, destination-major with tokens ascending (the
        # layout's order); each block holds its slice
        dest, tokens_all = np.nonzero(lay.is_token_in_rank.T)
        side_all = np.zeros(len(tokens_all), dtype=side_dt)
        side_all["token"] = tokens_all
        on = routed.dest_rank[tokens_all] == dest[:, None]
        side_all["slots"] = np.where(on, routed.local_slot[tokens_all], -1)
        ends = np.cumsum(lay.num_tokens_per_rank).tolist()
        for r in range(self.R):
            lo, hi = ends[r - 1] if r else 0, ends[r]
            tokens = tokens_all[lo:hi]
            side = side_all[lo:hi]
            data = None
            if bytes_mode:
                rows = np.zeros(len(tokens), dtype=dt)
                payload = x[tokens]  # type: ignore[index]
                wire.encode_payload(rows, payload, cfg.dispatch_dtype, cfg.scale_dtype)
                rows["token"] = side["token"]
                rows["slots"] = side["slots"]
                data = rows.tobytes()
            blocks.append(_Block(len(tokens), data, side))
        start = now_ns()
        received, barrier = await self._exchange(
            rank,
            event_id,
            _DISPATCH,
            blocks,
            lay.num_tokens_per_rank,
            row_bytes,
            pack_vector_ns=self._quant_ns(n_tokens, cfg.dispatch_dtype, sender=True),
            per_row_ns=float(self._quant_ns(1, cfg.dispatch_dtype, exact=True)),
            post_ns=0,
        )
        out = self._assemble_dispatch(
            rank, event_id, received, routed, lay, n_tokens, start, barrier
        )
        emit(
            "xccl",
            "dispatch",
            rank=rank,
            die=self.ranks[rank],
            event_id=event_id,
            tokens=n_tokens,
            recv=out.n_recv,
            latency_ns=out.end_ns - start,
        )
        return out

    async def combine(
        self,
        rank: int,
        handle: DispatchOutput,
        expert_out: np.ndarray | None,
        topk_weights: np.ndarray | None,
        event_id: int,
    ) -> np.ndarray | None:
        """Return expert outputs to the tokens' owners and accumulate them with the weights.

        ``expert_out`` is [n_recv, k, H] float32: row ``i``'s output of its ``j``-th top-k
        expert where ``handle.recv_local_slots[i, j] >= 0`` (ignored elsewhere); ``None`` in
        size mode. ``topk_weights`` are this rank's own tokens' gate weights [B, k].
        """
        cfg = self.config
        rank = self._check_rank(rank)
        event_id = args.event_id(event_id)
        if not isinstance(handle, DispatchOutput):
            raise ConfigError(
                f"handle must be what this rank's dispatch returned, got {type(handle).__name__}",
                field="handle",
            )
        if handle.group != self._serial:
            raise ConfigError(
                "handle is another group's dispatch output: combine on the group that dispatched",
                field="handle",
            )
        if handle.rank != rank:
            raise ConfigError(
                f"handle is rank {handle.rank}'s dispatch output, not rank {rank}'s: each "
                "rank combines with what its own dispatch returned",
                field="handle",
            )
        bytes_mode = self.fabric.mode == "bytes"
        valid = handle.recv_local_slots >= 0
        if bytes_mode and expert_out is not None:
            shape = (handle.n_recv, cfg.top_k, cfg.hidden)
            expert_out = args.outputs(expert_out, shape, "expert_out")
        dt = wire.combine_dtype(cfg.hidden, cfg.combine_dtype, cfg.scale_dtype)
        side_dt = wire.combine_side_dtype()
        blocks: list[_Block] = []
        counts = np.zeros(self.R, dtype=np.int64)
        if bytes_mode and expert_out is None:
            raise ConfigError("bytes payload mode needs expert outputs", field="expert_out")
        # every source's copies at once (row-major: by source, then row, then expert)
        copy_i, copy_j = np.nonzero(valid)
        side_all = np.zeros(len(copy_i), dtype=side_dt)
        side_all["token"] = handle.recv_src_token[copy_i]
        side_all["k"] = copy_j
        cut = np.searchsorted(copy_i, handle.rank_prefix).tolist()
        for src in range(self.R):
            a, b = cut[src], cut[src + 1]
            counts[src] = b - a
            side = side_all[a:b]
            data = None
            if bytes_mode:
                lo = int(handle.rank_prefix[src])
                rows_i, rows_j = copy_i[a:b] - lo, copy_j[a:b]
                copies = np.zeros(len(rows_i), dtype=dt)
                wire.encode_payload(
                    copies, expert_out[lo + rows_i, rows_j], cfg.combine_dtype, cfg.scale_dtype
                )
                copies["token"] = side["token"]
                copies["k"] = side["k"]
                data = copies.tobytes()
            blocks.append(_Block(b - a, data, side))
        weights = None
        if bytes_mode:
            if topk_weights is None:
                raise ConfigError("bytes payload mode needs the gate weights", field="topk_weights")
            weights = args.outputs(topk_weights, (handle.n_tokens, cfg.top_k), "topk_weights")
        row_bytes = combine_row_bytes(cfg.hidden, cfg.combine_dtype, cfg.scale_dtype)
        n_copies_back = int((handle.routed.dest_rank >= 0).sum())
        start = now_ns()
        received, _ = await self._exchange(
            rank,
            event_id,
            _COMBINE,
            blocks,
            counts,
            row_bytes,
            pack_vector_ns=self._quant_ns(int(counts.sum()), cfg.combine_dtype, sender=True),
            per_row_ns=float(self._quant_ns(1, cfg.combine_dtype, exact=True)),
            post_ns=self._weighting_ns(n_copies_back),
        )
        y = None
        if weights is not None:
            y = self._accumulate(handle, received, weights)
        emit(
            "xccl",
            "combine",
            rank=rank,
            die=self.ranks[rank],
            event_id=event_id,
            latency_ns=now_ns() - start,
        )
        return y

    # -- costs --
    def _quant_ns(
        self, n_rows: int, dtype: WireDtype, *, exact: bool = False, sender: bool = False
    ) -> float:
        """Vector time of token-wise INT8 (de)quantisation of ``n_rows`` rows at the die's
        vector peak (0 unless the wire dtype is INT8), plus the fixed part of the sender's
        fused quantisation (SPEC 9.3) if ``sender``; rounded to ns unless ``exact``."""
        if dtype != "int8" or n_rows == 0:
            return 0
        e = self.fabric.engines
        die = self.fabric.pod.spec_of(self.ranks[0])
        ops = n_rows * self.config.hidden * e.vector_ops_per_quant_element
        t = ops / die.vector_flops * 1e9 + (e.quant_fixed_ns if sender else 0)
        return t if exact else round(t)

    def _weighting_ns(self, n_copies: int) -> int:
        """Vector time of the owner's weighted accumulation (2 ops per element per copy)."""
        die = self.fabric.pod.spec_of(self.ranks[0])
        return round(2 * n_copies * self.config.hidden / die.vector_flops * 1e9)

    # -- the count-then-pull exchange --
    async def _exchange(
        self,
        rank: int,
        event_id: int,
        phase: int,
        blocks: list[_Block],
        counts: np.ndarray,
        row_bytes: int,
        *,
        pack_vector_ns: float,
        per_row_ns: float,
        post_ns: float,
    ) -> tuple[list[_Block], int]:
        # SPEC 4.2: blocks are sized by the max batch; a combine block holds one copy per
        # (token, expert), so up to top_k copies per token.
        cap = self.config.max_tokens_per_rank * (1 if phase == _DISPATCH else self.config.top_k)
        over = np.flatnonzero(np.asarray(counts) > cap)
        if over.size:  # the first destination over capacity
            dest = int(over[0])
            raise ProtocolError(
                f"rank {rank} would send {int(counts[dest])} rows to rank {dest}, above the "
                f"block capacity of {cap} (max_tokens_per_rank); nothing was written"
            )
        costs = (round(pack_vector_ns), per_row_ns, round(post_ns))
        exchange = (
            self._exchange_collective if self.tier == "collective" else self._exchange_protocol
        )
        die = self.ranks[rank]
        who = f"{_PHASE_NAMES[phase]} eventID {event_id} at rank {rank} (die {die})"

        async def body() -> tuple[list[_Block], int]:
            joining = (rank, phase, event_id)
            if joining in self._in_flight:
                raise ProtocolError(
                    f"rank {rank} joined {_PHASE_NAMES[phase]} eventID {event_id} twice (it is "
                    "still in the first)"
                )
            slot = (rank, phase, event_id & 1)
            if self._completed.get(slot) == event_id:
                raise ProtocolError(
                    f"rank {rank} joined {_PHASE_NAMES[phase]} eventID {event_id} again after "
                    f"completing it: its metadata fields of that parity still hold eventID "
                    f"{event_id}, so its barrier would pass on that exchange's metadata (and "
                    f"pull its blocks); give each {_PHASE_NAMES[phase]} a new eventID"
                )
            left = self._left.get((rank, phase))
            if left is not None and left.event_id != event_id:
                del self._left[(rank, phase)]
            elif left is not None and left.after_barrier:
                raise ProtocolError(
                    f"rank {rank} retried {_PHASE_NAMES[phase]} eventID {event_id}, which was "
                    f"cancelled at {left.at_ns} ns, after its barrier (at {left.barrier_ns} ns): "
                    "its peers have read its metadata and gone on, so the exchange cannot be "
                    "joined again (a dispatch or combine can be retried only if cancelled "
                    "before its barrier)"
                )
            self._in_flight.add(joining)
            self._joined[(rank, phase)] = event_id
            try:
                done = await exchange(rank, event_id, phase, blocks, counts, row_bytes, costs)
            finally:
                self._in_flight.discard(joining)
            self._completed[slot] = event_id
            return done

        return await self._failures.run(die, who, body)

    async def _exchange_protocol(
        self,
        rank: int,
        event_id: int,
        phase: int,
        blocks: list[_Block],
        counts: np.ndarray,
        row_bytes: int,
        costs: tuple[int, float, int],
    ) -> tuple[list[_Block], int]:
        pack_vector_ns, per_row_ns, post_ns = costs
        fabric, cfg = self.fabric, self.config
        e = fabric.engines
        me = self.ranks[rank]
        parity = event_id & 1
        slot = self._fields + phase * 2 + parity
        await sleep_ns(e.kernel_launch_ns)
        # The block area of this parity must have been pulled by everyone (their releases),
        # unless this retries the eventID posted there (the same rows; peers yet to pull
        # them pull either copy).
        key = (rank, phase, parity)
        retry = self._posted.get(key) == event_id
        while not retry and self._pending.get(key):
            self._released[key] = anyio.Event()
            with waiting_for(
                lambda: (
                    f"{_PHASE_NAMES[phase]} eventID {event_id}: rank {rank} waits until every "
                    f"peer has pulled its managed blocks of eventID parity {parity}; not yet: "
                    + "; ".join(
                        f"rank {r} ({self._last_signal(r, phase)})"
                        for r in sorted(self._pending.get(key, ()))
                    )
                    + " (a rank whose exchange was cancelled never pulls)"
                )
            ):
                await self._released[key].wait()
        # Steps 1-3: load, quantise, pack by destination into the own managed area.
        pack_bytes = int(counts.sum()) * row_bytes
        t = fabric.mte_transfer(me, me, pack_bytes, start_ns=now_ns(), aivs=cfg.n_aiv)
        await sleep_until_ns(t.end_ns + pack_vector_ns)
        for dest in range(self.R):
            self._blocks[(rank, phase, parity, dest)] = blocks[dest]
        receivers = {int(d) for d in np.flatnonzero(counts > 0)}
        self._pending[key] = receivers & self._pending.get(key, set()) if retry else receivers
        self._posted[key] = event_id
        # Step 4: metadata to every destination; the AIVs issue them in parallel.
        t0 = now_ns()
        for dest in range(self.R):
            issued = t0 + (dest // cfg.n_aiv + 1) * e.meta_issue_ns
            fabric.post_meta(
                fabric.meta_visible_ns(me, self.ranks[dest], issued),
                self.ranks[dest],
                me,
                slot,
                Direction.COLL,
                issued_by=(me, t0),
                event_id=event_id,
                chunk_id=int(counts[dest]),
                tail_ptr=0,
            )
        # Step 5: barrier - every rank's metadata for this eventID.
        mem = fabric.memory(me)
        incoming = np.zeros(self.R, dtype=np.int64)
        for src in range(self.R):
            field = mem.meta(self.ranks[src], slot, Direction.COLL)
            # what this field held before: from the last exchange, or (this group's first read)
            # whatever an earlier group on the fabric left there
            last = self._seen.get((rank, slot, src), field.event_id)
            while field.event_id != event_id:
                if field.event_id != last:  # a new write, for another event
                    raise ProtocolError(
                        f"{_PHASE_NAMES[phase]}: rank {src} wrote eventID {field.event_id} "
                        f"where rank {rank} expects {event_id} (the ranks disagree)"
                    )
                with waiting_for(lambda s=src: self._barrier_note(rank, s, event_id, phase)):
                    await field.changed()
            self._seen[(rank, slot, src)] = event_id
            incoming[src] = field.chunk_id
        barrier = now_ns()
        # Steps 6-7: pull every peer's block for this rank, spread over the AIVs.
        received: list[_Block] = [
            self._blocks[(src, phase, parity, rank)] for src in range(self.R)
        ]  # replaced by each pulled block when its pull completes
        lanes = [
            [src for src in peers if incoming[src]]
            for peers in pull_lanes(rank, self.R, cfg.n_aiv, cfg.pull_order)
        ]
        # congestion: this die pulls from this many peers at once
        fan_in = int(np.count_nonzero(incoming)) - (1 if incoming[rank] else 0)
        efficiency = collective_efficiency(e, fan_in)

        async def lane(sources: list[int]) -> None:
            first = True
            for src in sources:
                block = self._blocks[(src, phase, parity, rank)]
                nbytes = block.rows * row_bytes
                tr = fabric.mte_transfer(
                    self.ranks[src],
                    me,
                    nbytes,
                    start_ns=now_ns(),
                    fill=first,
                    aiv_die=me,
                    efficiency=efficiency,
                )
                await sleep_until_ns(tr.visible_ns + round(block.rows * per_row_ns))
                received[src] = block
                fabric.post(
                    fabric.meta_visible_ns(me, self.ranks[src], now_ns()),
                    self._release,
                    src,
                    phase,
                    parity,
                    rank,
                )
                first = False

        try:
            async with anyio.create_task_group() as tg:
                for sources in lanes:
                    if sources:
                        tg.start_soon(lane, sources)
            await sleep_ns(post_ns)
        except BaseException:  # cancelled mid-pull: the blocks it did not pull stay unpulled
            self._left[(rank, phase)] = _Left(event_id, now_ns(), barrier)
            raise
        return received, barrier

    def _barrier_note(self, rank: int, waits_on: int | list[int], event_id: int, phase: int) -> str:
        """What ``rank`` waits for in the step-5 barrier, with where each awaited rank last
        signalled (protocol tier: the field it wrote; collective tier: the exchange it joined),
        so a deadlock report shows ranks that disagree on the eventID."""
        name = _PHASE_NAMES[phase]
        if isinstance(waits_on, int):
            field = self.fabric.memory(self.ranks[rank]).meta(
                self.ranks[waits_on], self._fields + phase * 2 + (event_id & 1), Direction.COLL
            )
            return (
                f"{name} barrier, eventID {event_id}: rank {rank} waits for rank {waits_on}'s "
                f"metadata (that field last held eventID {field.event_id}; "
                f"{self._last_signal(waits_on, phase)})"
            )
        where = "; ".join(f"rank {r}: {self._last_signal(r, phase)}" for r in waits_on[:8])
        more = f"; and {len(waits_on) - 8} more" if len(waits_on) > 8 else ""
        return f"{name} barrier, eventID {event_id}: rank {rank} waits for {where}{more}"

    def _last_signal(self, rank: int, phase: int) -> str:
        joined = self._joined.get((rank, phase))
        if joined is None:
            return "it has not joined a " + _PHASE_NAMES[phase]
        left = self._left.get((rank, phase))
        if left is not None and left.event_id == joined and left.after_barrier:
            return (
                f"it last joined eventID {joined}, cancelled at {left.at_ns} ns after its "
                "barrier, mid-pull: it never pulls the rest"
            )
        return f"it last joined eventID {joined}"

    def _release(self, src: int, phase: int, parity: int, dest: int) -> None:
        key = (src, phase, parity)
        self._pending[key].discard(dest)
        if not self._pending[key] and key in self._released:
            self._released.pop(key).set()

    async def _exchange_collective(
        self,
        rank: int,
        event_id: int,
        phase: int,
        blocks: list[_Block],
        counts: np.ndarray,
        row_bytes: int,
        costs: tuple[int, float, int],
    ) -> tuple[list[_Block], int]:
        """One event per collective: the last rank to arrive computes everyone's completion
        from all arrival times (closed form, same costs); each rank then sleeps until its own."""
        key = (event_id, phase)
        left = self._left.pop((rank, phase), None)
        if left is not None:  # (one cancelled after its barrier was refused on joining)
            return await self._rejoin(rank, phase, left)
        for (other, other_phase), joined in self._arrivals.items():
            # two events of one parity are never in flight at once (double buffering)
            same_buffer = other_phase == phase and (other - event_id) % 2 == 0
            if same_buffer and other != event_id and rank not in joined:
                raise ProtocolError(
                    f"{_PHASE_NAMES[phase]}: rank {rank} joined with eventID {event_id} while "
                    f"ranks {sorted(joined)} wait in eventID {other} (the ranks disagree)"
                )
        arrivals = self._arrivals.setdefault(key, {})
        if rank in arrivals:
            raise ProtocolError(f"rank {rank} joined exchange {key} twice")
        arrivals[rank] = _Arrival(now_ns(), np.asarray(counts, np.int64), costs, blocks)
        self._results.setdefault(key, anyio.Event())
        if len(arrivals) == self.R:
            self._complete(key, row_bytes)
        while True:  # (again if a rank's timeout revokes the completion: see _cancelled_late)
            result = await self._completion_of(key, rank, phase, event_id)
            try:
                await sleep_until_ns(max(now_ns(), int(result.end[rank])))
            except BaseException:
                self._cancelled_late(key, rank, phase, result)
                raise
            if not result.revoked:
                break
        try:
            silent = self._failed_before_posting(result)
            if silent is not None:  # its metadata never came: the barrier never completes,
                # and this rank waits until it learns of the failure (the protocol tier's)
                with waiting_for(
                    f"{_PHASE_NAMES[phase]} eventID {event_id}: rank {rank} waits for the "
                    f"metadata of die {silent}, which failed before posting it"
                ):
                    await anyio.Event().wait()
            return [result.blocks[s][rank] for s in range(self.R)], int(result.barrier[rank])
        finally:  # done with the exchange (or cancelled waiting for a failed die's metadata)
            self._leave(key, rank)

    def _complete(self, key: tuple[int, int], row_bytes: int) -> None:
        """The last rank has arrived: every rank's times, from all arrival times."""
        arrivals = self._arrivals.pop(key)
        ordered = [arrivals[s] for s in range(self.R)]
        count_matrix = np.stack([a.counts for a in ordered])
        times = exchange_completion(
            self.fabric,
            self.ranks,
            n_aiv=self.config.n_aiv,
            pull_order=self.config.pull_order,
            arrival_ns=np.array([a.t_ns for a in ordered], dtype=np.int64),
            counts=count_matrix,
            row_bytes=row_bytes,
            pack_vector_ns=np.array([a.costs[0] for a in ordered], dtype=np.int64),
            per_row_ns=ordered[0].costs[1],
            post_ns=np.array([a.costs[2] for a in ordered], dtype=np.int64),
            now_ns=now_ns(),
        )
        self._completion[key] = _Completion(times, ordered, count_matrix)
        self._results[key].set()

    async def _completion_of(
        self, key: tuple[int, int], rank: int, phase: int, event_id: int
    ) -> _Completion:
        """The exchange's completion, once every rank has arrived; a rank cancelled before
        that never joined (its arrival is withdrawn, so a retry of the eventID joins afresh)."""
        while (result := self._completion.get(key)) is None:
            try:
                with waiting_for(
                    lambda: self._barrier_note(
                        rank,
                        [s for s in range(self.R) if s not in self._arrivals.get(key, ())],
                        event_id,
                        phase,
                    )
                ):
                    await self._results[key].wait()
            except BaseException:
                current = self._completion.get(key)
                if current is None:
                    self._withdraw(key, rank)
                else:  # the last rank arrived at that instant
                    self._cancelled_late(key, rank, phase, current)
                raise
        return result

    def _withdraw(self, key: tuple[int, int], rank: int) -> None:
        arrivals = self._arrivals[key]
        del arrivals[rank]
        if not arrivals:
            del self._arrivals[key], self._results[key]

    def _cancelled_late(
        self, key: tuple[int, int], rank: int, phase: int, result: _Completion
    ) -> None:
        """Collective tier: ``rank`` cancelled after every rank arrived (``result``). Before
        its metadata would show, it never posted: the completion is revoked and its peers wait
        for its retry, as the protocol tier's barrier does (unless a rank has already left
        it). Later, a retry of the eventID before its barrier re-posts (its peers' metadata is
        still there); after its barrier, it is refused."""
        if result.revoked:  # waiting again for a revoking rank's retry
            current = self._completion.get(key)
            if current is None:
                self._withdraw(key, rank)
                return
            result = current
        now = now_ns()
        if now < result.posted[rank] and not result.left:
            result.revoked = True
            del self._completion[key]
            others = {s: a for s, a in enumerate(result.arrivals) if s != rank}
            if others:
                self._arrivals[key] = others
                self._results[key] = anyio.Event()
            else:
                del self._results[key]
            return
        self._left[(rank, phase)] = _Left(
            key[0],
            now,
            int(result.barrier[rank]),
            [result.blocks[s][rank] for s in range(self.R)],
            int(result.posted[rank] - result.arrivals[rank].t_ns),
            int(result.end[rank] - result.barrier[rank]),
        )
        self._leave(key, rank)

    async def _rejoin(self, rank: int, phase: int, left: _Left) -> tuple[list[_Block], int]:
        """Collective tier: a retry of the exchange ``rank`` left before its barrier (every
        rank had arrived): it launches and packs again, re-posts its metadata and, its peers'
        metadata being there, pulls what it would have."""
        assert left.blocks is not None
        barrier = max(now_ns() + left.lead_ns, left.barrier_ns)
        try:
            await sleep_until_ns(barrier + left.tail_ns)
        except BaseException:
            self._left[(rank, phase)] = msgspec.structs.replace(
                left, at_ns=now_ns(), barrier_ns=barrier
            )
            raise
        return left.blocks, barrier

    def _leave(self, key: tuple[int, int], rank: int) -> None:
        """``rank`` is done with the completed exchange ``key``; the last one clears it."""
        result = self._completion[key]
        result.left.add(rank)
        if len(result.left) == self.R:
            del self._completion[key]
            del self._results[key]

    def _failed_before_posting(self, result: _Completion) -> int | None:
        """A member die that failed before (or at the instant) it was to post its metadata in
        ``result``'s exchange, repaired since or not (the collective tier counts every rank's
        arrival; a die that failed during its launch or packing never wrote), or None."""
        if not self._failures.failed:  # no member failed this run (the usual case)
            return None
        for s, die in enumerate(self.ranks):
            if self._failures.failed_by(die, int(result.posted[s])) is not None:
                return die
        return None

    # -- assembling results --
    def _assemble_dispatch(
        self,
        rank: int,
        event_id: int,
        received: list[_Block],
        routed: Routed,
        lay: Layout,
        n_tokens: int,
        start: int,
        barrier: int,
    ) -> DispatchOutput:
        cfg = self.config
        counts = np.array([b.rows for b in received], dtype=np.int64)
        prefix = np.zeros(self.R + 1, dtype=np.int64)
        np.cumsum(counts, out=prefix[1:])
        n = int(prefix[-1])
        src_rank = np.repeat(np.arange(self.R, dtype=np.int64), counts)
        n_slots = int(self.expert_map.slots_per_rank[rank])
        if self.fabric.mode == "bytes":
            dt = wire.dispatch_dtype(cfg.hidden, cfg.top_k, cfg.dispatch_dtype, cfg.scale_dtype)
            rows = (
                np.concatenate(
                    [
                        np.frombuffer(b.data, dtype=dt) if b.data else np.zeros(0, dt)
                        for b in received
                    ]
                )
                if n
                else np.zeros(0, dt)
            )
            recv_x = wire.decode_payload(rows, cfg.dispatch_dtype).reshape(n, cfg.hidden)
            src_token = rows["token"].astype(np.int64)
            slots = rows["slots"].astype(np.int64).reshape(n, cfg.top_k)
        else:
            side_dt = wire.dispatch_side_dtype(cfg.top_k)  # given: no per-call promotion
            side = np.concatenate([b.side for b in received], dtype=side_dt)
            recv_x = None
            src_token = side["token"].astype(np.int64)
            slots = side["slots"].astype(np.int64).reshape(n, cfg.top_k)
        per_slot = (
            np.bincount(slots[slots >= 0], minlength=n_slots) if n else np.zeros(n_slots, np.int64)
        )
        return DispatchOutput(
            event_id=event_id,
            recv_x=recv_x,
            recv_src_rank=src_rank,
            recv_src_token=src_token,
            recv_local_slots=slots,
            rank_prefix=prefix,
            num_recv_per_local_slot=per_slot.astype(np.int64),
            routed=routed,
            send_layout=lay,
            n_tokens=n_tokens,
            start_ns=start,
            barrier_ns=barrier,
            end_ns=now_ns(),
            rank=rank,
            group=self._serial,
        )

    def _accumulate(
        self, handle: DispatchOutput, received: list[_Block], weights: np.ndarray
    ) -> np.ndarray:
        """The owner's weighted sum over its tokens' top-k copies, in top-k order."""
        cfg = self.config
        dt = wire.combine_dtype(cfg.hidden, cfg.combine_dtype, cfg.scale_dtype)
        outs = np.zeros((handle.n_tokens, cfg.top_k, cfg.hidden), dtype=np.float32)
        seen = np.zeros((handle.n_tokens, cfg.top_k), dtype=bool)
        for block in received:
            if not block.rows:
                continue
            copies = np.frombuffer(block.data, dtype=dt)  # type: ignore[arg-type]
            t, j = copies["token"].astype(np.int64), copies["k"].astype(np.int64)
            if seen[t, j].any():
                raise ProtocolError("combine delivered a (token, expert) copy twice")
            seen[t, j] = True
            outs[t, j] = wire.decode_payload(copies, cfg.combine_dtype)
        expected = handle.routed.dest_rank >= 0
        if not np.array_equal(seen, expected):
            raise ProtocolError("combine lost (token, expert) copies")
        y = np.zeros((handle.n_tokens, cfg.hidden), dtype=np.float32)
        for j in range(cfg.top_k):
            contrib = weights[:, j, None] * outs[:, j]
            y += np.where(expected[:, j, None], contrib, np.float32(0.0))
        return y

    def _check_rank(self, rank: object) -> int:
        """``rank`` as a plain int (numpy integers too) in 0..R-1; else ConfigError."""
        return args.index(rank, self.R, "rank")


class _Completion:
    __slots__ = ("arrivals", "barrier", "blocks", "counts", "end", "left", "posted", "revoked")

    def __init__(self, times: ExchangeTimes, arrivals: list[_Arrival], counts: np.ndarray):
        self.posted, self.barrier, self.end = times
        self.arrivals = arrivals
        self.counts = counts
        self.blocks = [a.blocks for a in arrivals]
        self.left: set[int] = set()
        """The ranks done with it (finished or cancelled); the last one clears it."""
        self.revoked = False
        """A rank's timeout struck before its metadata would show: the ranks wait again."""


document_fields(EPConfig, DispatchOutput)
