"""A Decode TE under continuous arrivals: the PD deployment's decode side (SPEC 6, 10.2).

Unlike :class:`~xds.serve.decode.DecodeInstance` (a fixed batch admitted up front, SPEC 12.2),
requests arrive one by one from prefill. Each is routed once by the TE-shell
(:class:`~xds.serve.routing.DecodeRouter`: batch limit, KV load, backpressure while no DP
qualifies); its DP master reserves the KV blocks of the whole sequence before it submits the
RECV (a deferred RECV waits for capacity, P101), and the sequence joins the DP's batch when the
DP dequeues the transfer's completion. The iteration loop runs while any sequence is live: one
MTP step per iteration on every DP at once (the iteration tier of
:class:`~xds.serve.decode.DecodeModel`), with dispatch/combine costs interpolated from
collective-tier measurements at a few tokens-per-die points, since the batch changes all the
time.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import overload

import anyio
import msgspec
import numpy as np

from ..errors import ConfigError
from ..hw.topology import PodConfig
from ..runtime import current_runtime, emit, now_ns, rng, sleep_ns
from ..runtime.nested import measure_anywhere
from ..trace.metrics import RequestRecord
from .decode import (
    CommCosts,
    DecodeConfig,
    DecodeModel,
    IterationOutcome,
    decode_kv_capacity,
    measure_comm,
)
from .decode_model import DPShapes
from .jitter import JitterConfig, sample_dps
from .kv import KVBlockManager
from .mtp import committed_tokens
from .routing import BACKPRESSURE, DecodeRouter, DecodeRouting, lowest_kv

_GRIDS: dict[tuple[bytes, int], CommGrid] = {}
_NO_JITTER = JitterConfig(enabled=False)


def ideal_max_context(total: int, dies: int, longest: int) -> float:
    """The least context the busiest of ``dies`` can hold when sequences whose contexts sum to
    ``total`` (the longest ``longest``) are spread over them: an even share, or the longest
    sequence if that is more (a sequence is not split). A lower bound: 1x it is perfect."""
    return max(total / dies, longest)


class DecodeLoad(msgspec.Struct):
    """Running totals of a Decode TE's iteration loop, each weighted by iteration time: what
    the replay summary's :class:`~xds.trace.metrics.DecodeStats` is made of."""

    iterations: int = 0
    busy_ns: int = 0
    sequence_ns: int = 0
    """Sum of iteration time x sequences decoding in it."""
    die_ns: int = 0
    """Sum of iteration time x dies in service."""
    skew_ns: float = 0.0
    """Sum of iteration time x (context on the die holding the most / the mean over the dies
    holding sequences), as the iteration was priced."""
    spread_ns: float = 0.0
    """Sum of iteration time x (context on the die holding the most / the least the busiest
    die could hold: :func:`ideal_max_context`), as the iteration was priced."""

    def add(self, other: DecodeLoad) -> None:
        """Fold ``other`` (a retired TE's totals) into these."""
        self.iterations += other.iterations
        self.busy_ns += other.busy_ns
        self.sequence_ns += other.sequence_ns
        self.die_ns += other.die_ns
        self.skew_ns += other.skew_ns
        self.spread_ns += other.spread_ns


class IterationLog:
    """Every iteration a Decode TE completed: when it started, how long it took and how many
    sequences it decoded (compact arrays; :meth:`record` makes the public form). One log
    outlives the TE's restarts: an iteration lost to a fault is not in it."""

    def __init__(self, te: str):
        self.te = te
        self.start_ns = array("q")
        self.time_ns = array("q")
        self.sequences = array("q")

    def add(self, start_ns: int, time_ns: int, sequences: int) -> None:
        self.start_ns.append(start_ns)
        self.time_ns.append(time_ns)
        self.sequences.append(sequences)

    def record(self) -> DecodeIterations:
        return DecodeIterations(
            te=self.te,
            start_ns=self.start_ns.tolist(),
            time_ns=self.time_ns.tolist(),
            sequences=self.sequences.tolist(),
        )


class DecodeIterations(msgspec.Struct, frozen=True):
    """A Decode TE's iterations over a replay, in order (``ReplayResult.decode_iterations_log``):
    each one's start, duration (including the scheduler gap and host jitter) and sequences.
    Plain lists, so results compare and encode like the rest (about 100 bytes an iteration:
    an hour of decode at 30 ms iterations is 12 MB)."""

    te: str
    start_ns: list[int]
    time_ns: list[int]
    sequences: list[int]


class CommGrid(Sequence[CommCosts]):
    """Dispatch/combine costs at the tokens-per-die points (:attr:`tokens`) a decode batch
    can reach, each point measured the first time it is read: a collective-tier run of its
    own (seeded, so the same whenever and wherever it is taken; inside a running replay it
    runs in a helper thread while the replay waits, its virtual time unmoved). A light load
    never reads the wide points, whose measurements cost the most."""

    def __init__(self, config: DecodeConfig, tokens: Sequence[int], *, seed: int = 0):
        points = tuple(tokens)
        if not points or any(t < 1 for t in points) or list(points) != sorted(set(points)):
            raise ConfigError(
                f"grid points must be ascending, distinct and >= 1 token per die, got {points}",
                field="tokens",
            )
        self.config = config
        self.seed = seed
        self.tokens: tuple[int, ...] = points
        """The points, ascending."""
        self._costs: list[CommCosts | None] = [None] * len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, i: int) -> CommCosts: ...
    @overload
    def __getitem__(self, i: slice) -> list[CommCosts]: ...
    def __getitem__(self, i: int | slice) -> CommCosts | list[CommCosts]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        j = range(len(self))[i]  # negative indices count from the end; IndexError beyond
        hit = self._costs[j]
        if hit is None:
            cfg, t, seed = self.config, self.tokens[j], self.seed
            hit = self._costs[j] = measure_anywhere(
                lambda: measure_comm(cfg, t, seed=seed), name="xds-comm-grid"
            )
        return hit

    @property
    def measured(self) -> list[int]:
        """The points measured so far."""
        return [t for t, c in zip(self.tokens, self._costs, strict=True) if c is not None]


def comm_grid(config: DecodeConfig, *, seed: int = 0) -> CommGrid:
    """Dispatch/combine costs at the tokens-per-die points a decode batch can reach: 1, the
    powers and steps up to 256 below the largest, and the largest (batch limit x (1 + MTP
    drafts)), each measured on first use (:class:`CommGrid`). One grid per configuration and
    seed per process (up to 16 configurations; the cache starts afresh when full)."""
    # host jitter does not touch the fabric: configurations differing only there share a grid
    key = (msgspec.json.encode(msgspec.structs.replace(config, jitter=_NO_JITTER)), seed)
    grid = _GRIDS.get(key)
    if grid is None:
        if len(_GRIDS) >= 16:  # a sweep over many configurations: keep memory bounded
            _GRIDS.clear()
        top = config.batch_per_die * (1 + config.mtp_config.k)
        points = sorted({1, *(p for p in (8, 16, 32, 64, 96, 128, 192, 256) if p < top), top})
        grid = _GRIDS[key] = CommGrid(config, points, seed=seed)
    return grid


def interpolate(grid: Sequence[CommCosts], tokens: float) -> CommCosts:
    """Linear interpolation of the grid at ``tokens`` per die (clamped at its ends); of a
    :class:`CommGrid`, only the two points around ``tokens`` are measured."""
    xs = grid.tokens if isinstance(grid, CommGrid) else [g.tokens_per_die for g in grid]
    if tokens <= xs[0]:
        return grid[0]
    if tokens >= xs[-1]:
        return grid[-1]
    i = bisect.bisect_right(xs, tokens)
    if xs[i - 1] == tokens:  # on a point: the next one is not needed (nor measured)
        return grid[i - 1]
    a, b = grid[i - 1], grid[i]
    w = (tokens - a.tokens_per_die) / (b.tokens_per_die - a.tokens_per_die)
    return CommCosts(
        round(tokens),
        round(a.dispatch_ns + w * (b.dispatch_ns - a.dispatch_ns)),
        round(a.combine_ns + w * (b.combine_ns - a.combine_ns)),
    )


class _ReplayDecodeModel(DecodeModel):
    """Expert-compute draws cached per token bucket: a replay runs tens of thousands of
    iterations at ever-changing batch sizes; one multinomial draw per (bucket, layer kind)
    keeps the busiest-die statistics while costing nothing per iteration."""

    bucket = 32

    def __init__(self, config: DecodeConfig, comm: CommCosts, index: int = 0, stream: str = ""):
        super().__init__(config, comm)
        self._draws: dict[int, tuple[list[int], list[int]]] = {}
        # each Decode TE draws from its own stream, so its draws do not depend on how the TEs'
        # iterations interleave (TE 0 keeps the historical name)
        self._gen = rng(
            stream or ("decode-te/routing" if index == 0 else f"decode-te/{index}/routing")
        )

    def draw_experts(
        self, seqs: np.ndarray, gen: np.random.Generator
    ) -> tuple[list[int], list[int]]:
        total = int(seqs.sum())
        return self.draws(total) if total else super().draw_experts(seqs, self._gen)

    def draws(self, total: int) -> tuple[list[int], list[int]]:
        """:meth:`draw_experts` of an iteration of ``total`` sequences (at least one)."""
        key = -(-total // self.bucket) * self.bucket
        hit = self._draws.get(key)
        if hit is None:
            hit = super().draw_experts(np.array([key], dtype=np.int64), self._gen)
            self._draws[key] = hit
        return hit


class KVNoFit(Exception):
    """A request's sequence can no longer fit where it must go (memory faults masked KV): the
    request fails with this reason."""


DIES_PER_SERVER = PodConfig().chips_per_server * PodConfig().dies_per_chip
"""A CloudMatrix384 server: 8 Ascend 910C chips of 2 dies (SPEC 1.1)."""


class _LiveBatch:
    """A Decode TE's live sequences (``remaining > 0``) in slot order, as plain lists: the
    iteration loop runs a few dozen sequences, where a numpy call costs more than the Python
    arithmetic it replaces.

    Taken from the TE's slot arrays (``slot_req``, ``remaining``, ``context``, all
    [DP groups, batch limit]), it then holds its sequences' progress: :meth:`commit` moves only
    the batch (clearing ``remaining`` of the sequences that end, which leave it), a sequence
    joins by :meth:`add`, and :meth:`flush` writes the progress back to the arrays before the
    next batch is taken from them, when something else changes which slots are live
    (``DecodeTE._live_dirty``: a memory fault, a scale-down or -up)."""

    def __init__(
        self,
        slot_req: np.ndarray,
        remaining: np.ndarray,
        context: np.ndarray,
        records: dict[int, RequestRecord] | None,
    ):
        live = remaining > 0
        self.limit = live.shape[1]
        flat = np.flatnonzero(live)
        self.slots: list[int] = flat.tolist()
        """Flat indices (``dp * batch limit + slot``) of the live slots, ascending: the
        row-major order ``np.nonzero`` and ``np.place`` walk the slot arrays in."""
        self.req: list[int] = slot_req.reshape(-1)[flat].tolist()
        self.remaining: list[int] = remaining.reshape(-1)[flat].tolist()
        contexts = context.reshape(-1)[flat].tolist()
        self.length = [c + r for c, r in zip(contexts, self.remaining, strict=True)]
        """Each sequence's context when it ends (its context is this less what remains)."""
        self.tokens = None if records is None else [records[r].token_ns for r in self.req]
        """Each sequence's token times (None: not recorded)."""
        self.seqs_all = np.bincount(flat // self.limit, minlength=len(live))
        """Live sequences of every DP group (in service or not)."""
        self.dps: list[int] = []
        """The DP groups holding live sequences, ascending: the batch's groups."""
        self.group: list[int] = []
        """Each sequence's group (index into :attr:`dps`)."""
        self.seqs: list[int] = []
        """Each group's live sequences."""
        self.sums: list[int] = []
        """Each group's context, summed over its sequences."""
        for i, c in zip(self.slots, contexts, strict=True):  # slot order: groups ascend
            dp = i // self.limit
            if not self.dps or self.dps[-1] != dp:
                self.dps.append(dp)
                self.seqs.append(0)
                self.sums.append(0)
            self.group.append(len(self.dps) - 1)
            self.seqs[-1] += 1
            self.sums[-1] += c
        self.steps: list[int] = []
        """Each group's mean context in 256-token steps, rounded up (the kernel cost cache's
        step: the iteration is priced at it)."""
        self._next: list[int] = []
        """The context sum at which each group's step moves up (contexts only grow, and a
        group whose sequences change is stepped afresh)."""
        self.moved = True
        """A group's step changed since the iteration was last priced, or sequences joined or
        left."""
        self._set_steps()

    @property
    def flat(self) -> np.ndarray:
        """:attr:`slots` as an array."""
        return np.array(self.slots, dtype=np.int64)

    def add(
        self, flat: int, req: int, remaining: int, context: int, tokens: list[int] | None
    ) -> None:
        """Sequence ``req`` joins in slot ``flat`` with ``remaining`` tokens to go from
        ``context`` (``tokens``: its token times, if recorded)."""
        j = bisect.bisect(self.slots, flat)
        self.slots.insert(j, flat)
        self.req.insert(j, req)
        self.remaining.insert(j, remaining)
        self.length.insert(j, context + remaining)
        if self.tokens is not None:
            assert tokens is not None
            self.tokens.insert(j, tokens)
        dp = flat // self.limit
        self.seqs_all[dp] += 1
        g = bisect.bisect_left(self.dps, dp)
        if g == len(self.dps) or self.dps[g] != dp:  # a group of its own, before those after
            self.dps.insert(g, dp)
            for column in (self.seqs, self.sums, self.steps, self._next):
                column.insert(g, 0)
            self.group[j:] = [h + 1 for h in self.group[j:]]
        self.group.insert(j, g)
        self.seqs[g] += 1
        self.sums[g] += context
        self._step(g)
        self.moved = True

    def _leave(self, j: int) -> None:
        """The ``j``-th sequence, which ended, leaves the batch."""
        g = self.group[j]
        self.seqs[g] -= 1
        self.sums[g] -= self.length[j]  # its context, nothing remaining
        self.seqs_all[self.slots[j] // self.limit] -= 1
        del self.slots[j], self.req[j], self.remaining[j], self.length[j], self.group[j]
        if self.tokens is not None:
            del self.tokens[j]
        if self.seqs[g]:
            self._step(g)
        else:  # its group emptied: those after it move down
            for column in (self.dps, self.seqs, self.sums, self.steps, self._next):
                del column[g]
            self.group[j:] = [h - 1 for h in self.group[j:]]
        self.moved = True

    def _set_steps(self) -> None:
        """Every group's step, afresh."""
        self.steps = [0] * len(self.seqs)
        self._next = [0] * len(self.seqs)
        for g in range(len(self.seqs)):
            self._step(g)

    def _step(self, g: int) -> None:
        """Group ``g``'s step: its mean context rounded up to 256 tokens, and the context sum
        at which that moves up."""
        self.steps[g] = step = -(-(self.sums[g] // self.seqs[g]) // 256)
        self._next[g] = (256 * step + 1) * self.seqs[g]

    def _restep(self) -> None:
        """Step the groups whose context crossed their next step (every other group's step
        stands: contexts only grow between joins and leaves)."""
        up = list(itertools.compress(itertools.count(), map(operator.ge, self.sums, self._next)))
        for g in up:
            self._step(g)
        if up:
            self.moved = True

    def still_in(self, slot_req: np.ndarray) -> list[int]:
        """The positions of the sequences still in their slots (others were dropped)."""
        now = slot_req.reshape(-1)[self.flat].tolist()
        return [i for i, (a, b) in enumerate(zip(now, self.req, strict=True)) if a == b]

    WHOLE_LIST_FROM = 64
    """Batches of at least this many sequences commit in whole-list operations
    (:meth:`_commit_all`); smaller ones sequence by sequence, which costs less there."""

    def commit(
        self, drawn: list[int], kept: list[int] | None, t: int, remaining: np.ndarray
    ) -> list[int]:
        """Commit one step's tokens: ``drawn[j]`` (at most what is left) to the ``j``-th
        sequence of ``kept`` (positions; None: all), at time ``t``. Returns the flat indices
        of the sequences that ended, in slot order (their ``remaining`` is cleared)."""
        if kept is None and len(drawn) == len(self.slots) >= self.WHOLE_LIST_FROM:
            return self._commit_all(drawn, t, remaining)
        pos = range(len(self.slots)) if kept is None else kept
        rem, sums, group, tokens = self.remaining, self.sums, self.group, self.tokens
        gone: list[int] = []
        # fewer kept than drawn (a memory fault): the first draws go to them
        for j, n in zip(pos, drawn, strict=False):
            left = rem[j] - n
            if left <= 0:  # its last tokens: only what was left
                n += left
                left = 0
                gone.append(j)
            rem[j] = left
            sums[group[j]] += n
            if tokens is not None:
                tokens[j].extend([t] * n)
        self._restep()
        return self._left(gone, remaining)

    def _commit_all(self, drawn: list[int], t: int, remaining: np.ndarray) -> list[int]:
        """:meth:`commit` of one draw per sequence, in whole-list operations: the same
        progress as its per-sequence loop, at a fraction of its cost for hundreds of
        sequences (a few dozen cost less in the loop)."""
        rem = list(map(operator.sub, self.remaining, drawn))
        gone: list[int] = []
        if min(rem, default=1) <= 0:  # some sequences' last tokens: only what was left
            drawn = list(drawn)
            gone = [j for j, left in enumerate(rem) if left <= 0]
            for j in gone:
                drawn[j] += rem[j]
                rem[j] = 0
        self.remaining[:] = rem
        # a group's sequences are a run of the slot order: its context grows by their draws
        cum = list(itertools.accumulate(drawn, initial=0))
        edges = list(map(cum.__getitem__, itertools.accumulate(self.seqs, initial=0)))
        grown = map(operator.sub, edges[1:], edges[:-1])
        self.sums[:] = map(operator.add, self.sums, grown)
        if self.tokens is not None:
            reps = [[t] * n for n in range(max(drawn, default=0) + 1)]
            for times, n in zip(self.tokens, drawn, strict=True):
                times += reps[n]
        self._restep()
        return self._left(gone, remaining)

    def _left(self, gone: list[int], remaining: np.ndarray) -> list[int]:
        """The sequences ``gone`` (positions, ascending), which ended, leave the batch and
        their slots' ``remaining``. Returns their flat indices."""
        if not gone:
            return []
        ended = [self.slots[j] for j in gone]
        remaining.reshape(-1)[ended] = 0
        for j in reversed(gone):
            self._leave(j)
        return ended

    def flush(self, slot_req: np.ndarray, remaining: np.ndarray, context: np.ndarray) -> None:
        """Write the progress of the sequences still in their slots back to the TE's arrays."""
        kept = self.still_in(slot_req)
        flat = self.flat[kept]
        remaining.reshape(-1)[flat] = [self.remaining[j] for j in kept]
        context.reshape(-1)[flat] = [self.length[j] - self.remaining[j] for j in kept]


class DecodeTE:
    """One Decode TE: TE-shell routing, DP masters, and the iteration loop.

    Faults (:mod:`xds.serve.failover`): :meth:`hang` stops the iteration loop (a die of the
    TE died, so the next dispatch never completes and the iteration in flight is lost) until
    :meth:`resume`; :meth:`scale_down` drops the DP groups of one server for good (Decode
    vertical scale-down, P119) and goes on with the rest on a smaller EP."""

    def __init__(
        self,
        config: DecodeConfig,
        grid: Sequence[CommCosts],
        *,
        index: int = 0,
        record_token_times: bool = True,
        on_finish: Callable[[RequestRecord], None] | None = None,
        routing: DecodeRouting = lowest_kv,
        servers: list[int] | None = None,
        iteration_log: IterationLog | None = None,
    ):
        self.config = config
        self.index = index
        self.iteration_log = iteration_log or IterationLog(f"D{index}")
        """Every iteration completed (shared with the TE that replaces this one after a
        restart)."""
        self.grid = grid
        self.model = _ReplayDecodeModel(config, grid[0], index)
        n, limit = config.dies, config.batch_per_die
        servers = servers or list(range(-(-n // DIES_PER_SERVER)))
        self.dp_server = [servers[dp % len(servers)] for dp in range(n)]
        """The server each DP group (one die) runs on: striped, DP ``i`` on the ``i mod S``-th
        of the TE's ``S`` servers, so every server holds the same mix of routed-expert and
        shared-expert dies (the last ``shared_expert_dies`` DP groups) and one server's loss
        leaves the others a replica of everything (as an operator would lay them out). The
        fabric's die numbering is not affected: UB bandwidth is uniform (SPEC 1.3)."""
        self._servers = len(servers)
        self.alive = np.ones(n, dtype=bool)
        """DP groups in service (a scale-down clears those of the failed server)."""
        self._alive_idx = np.arange(n)
        self._comm_at: dict[int, tuple[CommCosts, CommCosts]] = {}
        """(main pass, MTP pass) dispatch/combine costs by widest DP batch, read off
        :attr:`grid` (cleared when the grid changes)."""
        self._holds = 0
        self._resumed = anyio.Event()
        self._epoch = 0
        """Counts hangs: an iteration that sees it change while in flight is lost."""
        self.router = DecodeRouter(n, limit, block_tokens=config.block_tokens, routing=routing)
        cap = config.kv_blocks_per_die or decode_kv_capacity(config, self.model.pod)
        self.kv = [KVBlockManager(cap, block_tokens=config.block_tokens) for _ in range(n)]
        self.slot_req = np.full((n, limit), -1, dtype=np.int64)
        self.remaining = np.zeros((n, limit), dtype=np.int64)
        self.context = np.zeros((n, limit), dtype=np.int64)
        self.records: dict[int, RequestRecord] = {}
        self.done: dict[int, anyio.Event] = {}
        self.record_token_times = record_token_times
        self.on_finish = on_finish
        self._work = anyio.Event()
        self._capacity = anyio.Event()
        self._masked_dps: set[int] = set()
        """DP groups a memory fault masked KV blocks of."""
        self._held: deque[anyio.Event] = deque()
        """Requests held under backpressure, in arrival order (each waits on its event)."""
        self.load = DecodeLoad()
        self._skew = 1.0
        """Context on the die holding the most / the mean over the dies holding sequences,
        when the batch was last priced."""
        self._spread = 1.0
        """Context on the die holding the most / :func:`ideal_max_context`, when the batch was
        last priced."""
        self._live_dirty = True
        """Set by whatever may change which slots are live (``remaining > 0``) other than the
        iteration loop's own commits (sequences that end leave the batch there) and joins
        (:attr:`_joining`): a memory fault drops sequences, or the DP groups in service
        change. While clear, :attr:`_live` is exact; the loop takes a new one when it is
        set."""
        self._live = _LiveBatch(self.slot_req, self.remaining, self.context, None)
        self._joining: list[tuple[int, int, int, int, list[int] | None]] = []
        """Sequences that joined since the last iteration began (:meth:`_LiveBatch.add`
        arguments): they join the batch before the next one."""
        self._dropped = 0
        """Counts sequences a memory fault dropped from the batch (they may leave mid-iteration,
        the epoch unchanged)."""

    @property
    def kv_capacity(self) -> int:
        return self.kv[0].capacity

    # -- TE-shell and DP masters --
    async def route(self, record: RequestRecord) -> int:
        """Route the request to a DP group; while none qualifies it is held under backpressure,
        in a FIFO queue: requests held are routed in the order they arrived, and a newcomer
        never overtakes them. DP groups whose KV (after memory faults masked part of it) can
        never hold the sequence are not offered; if no DP group in service can,
        :class:`KVNoFit` (the request fails)."""
        if not self._held:
            dp = self._try_route(record)
            if dp is not None:
                return dp
        turn = anyio.Event()
        self._held.append(turn)
        try:
            while True:
                if self._held[0] is turn:
                    dp = self._try_route(record)
                    if dp is not None:
                        return dp
                await turn.wait()
                turn = self._rearm(turn)
        finally:
            head = self._held[0] is turn
            self._held.remove(turn)
            if head and self._held:  # the next one in line may fit too
                self._held[0].set()

    def could_ever_hold(self, input_tokens: int, output_tokens: int) -> bool:
        """Whether some DP group in service could hold a sequence of these lengths once its
        other requests are gone (memory faults mask part of a group's KV)."""
        tokens = input_tokens + self.reserved_output(output_tokens)
        if not self._masked_dps:
            return any(self.alive) and self.kv[0].blocks_for(tokens) <= self.kv_capacity
        return any(
            self.alive[dp] and self.kv[dp].could_ever_admit(tokens) for dp in range(len(self.kv))
        )

    def reserved_output(self, output_tokens: int) -> int:
        """The output tokens whose KV this TE reserves for a request of ``output_tokens``
        (:attr:`DecodeConfig.reserve_output_tokens`)."""
        return self.config.reserve_output_tokens or output_tokens

    def _try_route(self, record: RequestRecord) -> int | None:
        tokens = record.input_tokens + self.reserved_output(record.output_tokens)
        too_small = [
            dp
            for dp in sorted(self._masked_dps)
            if self.alive[dp] and not self.kv[dp].could_ever_admit(tokens)
        ]
        if too_small and len(too_small) == int(self.alive.sum()):
            raise KVNoFit(
                f"sequence of {tokens} tokens exceeds the usable KV of every decode DP of D"
                f"{self.index} (memory faults masked part of it)"
            )
        dp = self.router.route(
            record.request_id,
            self.reserved_output(record.output_tokens),
            exclude=too_small,
            input_tokens=record.input_tokens,
        )
        if dp is BACKPRESSURE:
            return None
        assert isinstance(dp, int)
        self.done[record.request_id] = anyio.Event()
        return dp

    def _rearm(self, turn: anyio.Event) -> anyio.Event:
        """A fresh event in ``turn``'s place in the queue (anyio events fire once)."""
        fresh = anyio.Event()
        self._held[self._held.index(turn)] = fresh
        return fresh

    async def reserve(self, dp: int, record: RequestRecord) -> None:
        """The DP master reserves the whole sequence's KV blocks (the prompt and the output
        reservation, :meth:`reserved_output`); the RECV is deferred until they fit (P101)."""
        tokens = record.input_tokens + self.reserved_output(record.output_tokens)
        while not self.kv[dp].can_admit(tokens):
            if not self.kv[dp].could_ever_admit(tokens):  # a memory fault masked too much
                raise KVNoFit(
                    f"sequence of {tokens} tokens no longer fits decode DP D{self.index}/DP{dp}"
                    " (a memory fault masked part of its KV)"
                )
            emit("decode-te", "recv-deferred", request=record.request_id, dp=dp)
            await self._wait_capacity()
        self.kv[dp].admit(record.request_id, tokens)
        self.router.kv_taken(record.request_id)
        self._report_kv(dp)

    def enqueue(self, dp: int, record: RequestRecord) -> None:
        """The DP dequeued the transfer's completion: the sequence joins the batch."""
        free = np.nonzero(self.slot_req[dp] < 0)[0]
        if not free.size:
            raise AssertionError(f"decode DP {dp} has no free batch slot (router bound broken)")
        s = int(free[0])
        self.slot_req[dp, s] = record.request_id
        start = (record.output_tokens - 1, record.input_tokens + 1)  # prefill's first token
        self.remaining[dp, s], self.context[dp, s] = start
        self.records[record.request_id] = record
        record.decode_placement = f"D{self.index}/DP{dp}"
        self.router.admitted(record.request_id)
        tokens = record.token_ns if self.record_token_times else None
        self._joining.append((dp * self.slot_req.shape[1] + s, record.request_id, *start, tokens))
        self._work.set()

    def abandon(self, dp: int, record: RequestRecord) -> None:
        """Undo a route (and a reservation, if made) for a request that failed before decode."""
        if not self.alive[dp] or record.request_id not in self.done:
            return  # a scale-down dropped the DP group, or a memory fault the request
        if self.kv[dp].held(record.request_id):
            self.kv[dp].release(record.request_id)
            self._report_kv(dp)
        self.router.finished(record.request_id)
        self.done.pop(record.request_id).set()
        self._signal_capacity()

    def _report_kv(self, dp: int) -> None:
        """DP group ``dp`` admitted or released KV: the TE-shell's figure of it follows (every
        change to a DP group's KV is reported, so the other groups' figures stand)."""
        self.router._kv_used_of(dp, self.kv[dp].used)

    async def _wait_capacity(self) -> None:
        self._capacity = ev = self._capacity if not self._capacity.is_set() else anyio.Event()
        await ev.wait()

    def _signal_capacity(self) -> None:
        self._capacity.set()
        if self._held:  # the first request held under backpressure tries again
            self._held[0].set()

    # -- faults --
    def hang(self) -> None:
        """A die of this TE failed: the iteration in flight never completes and none starts
        until :meth:`resume` (each hang needs its own resume)."""
        self._holds += 1
        self._epoch += 1
        emit("decode-te", "hang", te=self.index)

    def resume(self) -> None:
        if self._holds <= 0:
            raise AssertionError(f"decode TE {self.index} resumed without a hang")
        self._holds -= 1
        if not self._holds:
            self._resumed.set()
            self._resumed = anyio.Event()
            emit("decode-te", "resume", te=self.index, dies=int(self.alive.sum()))

    def memory_fault(self, dp: int, first_block: int, blocks: int) -> list[int]:
        """An on-chip memory fault in DP group ``dp``'s KV: the blocks are masked for good
        (:meth:`KVBlockManager.mask <xds.serve.kv.KVBlockManager.mask>`). Returns the requests
        whose KV lay there; those decoding leave the batch here (the caller fails them all;
        the others' reservations are undone as for any failed request)."""
        victims = [int(r) for r in self.kv[dp].mask(first_block, blocks)]  # type: ignore[call-overload]
        self._masked_dps.add(dp)
        for req in victims:
            slot = np.nonzero(self.slot_req[dp] == req)[0]
            if not slot.size:
                continue  # reserved, its KV still arriving: undone by the failure path
            s = int(slot[0])
            self.slot_req[dp, s] = -1
            self.remaining[dp, s] = 0
            self.context[dp, s] = 0
            self._live_dirty = True
            self._dropped += 1
            self.records.pop(req)
            self.kv[dp].release(req)
            self.router.finished(req)
            self.done.pop(req)
        self.router._kv_used([k.used for k in self.kv])
        emit("decode-te", "kv-masked", te=self.index, dp=dp, first=first_block, blocks=blocks)
        self._signal_capacity()
        return victims

    def die_of(self, dp: int) -> tuple[int, int]:
        """(server, die on that server) of DP group ``dp`` (one die each; striped as
        :attr:`dp_server` says): where its KV's memory physically is."""
        return self.dp_server[dp], dp // self._servers

    def dps_on(self, server: int, *, alive: bool = True) -> list[int]:
        """The DP groups on ``server`` that are in service (``alive``), or that a scale-down
        dropped (not ``alive``)."""
        return [
            dp
            for dp, s in enumerate(self.dp_server)
            if s == server and bool(self.alive[dp]) == alive
        ]

    def scale_down(self, server: int, config: DecodeConfig, grid: Sequence[CommCosts]) -> list[int]:
        """Drop the DP groups on ``server`` with everything they hold (their requests have
        failed: the caller fails them first) and serve on with the others: ``config`` is the
        smaller TE (its ``dies`` the DP groups left) and ``grid`` its dispatch/combine costs.
        Returns the DP groups dropped."""
        lost = self.dps_on(server)
        self._epoch += 1  # the iteration in flight ran on the dead dies: it is lost
        if int(self.alive.sum()) - len(lost) != config.dies:
            raise AssertionError(
                f"scale-down to {config.dies} dies, but {int(self.alive.sum()) - len(lost)} remain"
            )
        cap = self.kv_capacity
        for dp in lost:
            for req in self.slot_req[dp][self.slot_req[dp] >= 0].tolist():
                self.records.pop(req, None)
            self.slot_req[dp] = -1
            self.remaining[dp] = 0
            self.context[dp] = 0
            for req in self.router.remove(dp):
                self.done.pop(req, None)  # type: ignore[call-overload]
            self.kv[dp] = KVBlockManager(cap, block_tokens=self.config.block_tokens)
            self._masked_dps.discard(dp)
            self.alive[dp] = False
        self._resized(config, grid, "scaled-down", server)
        return lost

    def _resized(
        self, config: DecodeConfig, grid: Sequence[CommCosts], event: str, server: int
    ) -> None:
        """The DP groups in service changed: price iterations on ``config`` from now on."""
        self._alive_idx = np.nonzero(self.alive)[0]
        self._live_dirty = True
        self.config, self.grid = config, grid
        self._comm_at.clear()
        self.model = _ReplayDecodeModel(
            config, grid[0], self.index, stream=f"decode-te/{self.index}/{config.dies}/routing"
        )
        self.router._kv_used([k.used for k in self.kv])
        emit("decode-te", event, te=self.index, server=server, dies=config.dies)
        self._signal_capacity()

    def scale_up(self, server: int, config: DecodeConfig, grid: Sequence[CommCosts]) -> list[int]:
        """Take the DP groups on ``server`` (dropped by :meth:`scale_down`) back into service,
        empty; ``config`` and ``grid`` describe the TE with them. Returns the DP groups back."""
        back = self.dps_on(server, alive=False)
        if int(self.alive.sum()) + len(back) != config.dies:
            raise AssertionError(
                f"scale-up to {config.dies} dies, but {int(self.alive.sum()) + len(back)} "
                "would serve"
            )
        for dp in back:
            self.alive[dp] = True
            self.router.restore(dp, self.config.batch_per_die)
        self._resized(config, grid, "scaled-up", server)
        return back

    # -- the iteration loop --
    async def run(self) -> None:
        k = self.config.mtp_config.k
        jitter_gen = rng(f"decode-te/{self.index}/jitter")
        mtp_draws = current_runtime().rng.uniforms(f"decode-te/{self.index}/mtp")
        out: IterationOutcome | None = None
        while True:
            if self._holds:
                await self._resumed.wait()
                continue
            cfg = self.config  # a scale-down changes it
            if self._live_dirty:
                self._live.flush(self.slot_req, self.remaining, self.context)
                tokens = self.records if self.record_token_times else None
                self._live = _LiveBatch(self.slot_req, self.remaining, self.context, tokens)
                self._live_dirty = False
                self._joining.clear()  # taken from the arrays with the rest
                out = None
            elif self._joining:
                for joiner in self._joining:
                    self._live.add(*joiner)
                self._joining.clear()
            live = self._live
            if not live.slots:
                self._work = anyio.Event()
                await self._work.wait()
                continue
            if out is None or live.moved:
                out = self._price(live, k)
            dps = len(self._alive_idx)
            step = out.time_ns + cfg.scheduler_gap_ns + self._jitter(out, jitter_gen, dps)
            epoch, dropped = self._epoch, self._dropped
            await sleep_ns(step)
            if epoch != self._epoch:  # a die failed meanwhile: this iteration is lost
                continue
            self.iteration_log.add(now_ns() - step, step, len(live.slots))
            load = self.load
            load.iterations += 1
            load.busy_ns += step
            load.sequence_ns += step * len(live.slots)
            load.die_ns += step * dps
            load.skew_ns += step * self._skew
            load.spread_ns += step * self._spread
            drawn = committed_tokens(cfg.mtp_config, mtp_draws, len(live.slots))
            kept = None
            if dropped != self._dropped:  # sequences dropped meanwhile (a memory fault)
                kept = live.still_in(self.slot_req)
            t = now_ns()
            ended = live.commit(drawn, kept, t, self.remaining)
            limit = self.remaining.shape[1]
            for i in ended:
                self._finish(i // limit, i % limit, t)

    def _price(self, live: _LiveBatch, k: int) -> IterationOutcome:
        """The iteration of the live batch on the DP groups in service."""
        idx = self._alive_idx
        held = live.dps if len(idx) == len(live.seqs_all) else self._alive_pos(live.dps)
        context = [256 * step for step in live.steps]
        shapes = DPShapes.sparse(len(idx), held, live.seqs, context)
        self.model.comm, self.model.comm_mtp = self._comm(max(live.seqs), k)
        live.moved = False
        busiest, total = max(live.sums), sum(live.sums)
        self._skew = busiest * len(live.sums) / max(1, total)
        longest = max(map(operator.sub, live.length, live.remaining))
        self._spread = busiest / max(1.0, ideal_max_context(total, len(idx), longest))
        return self.model.account_shapes(
            shapes,
            None,
            *self.model.draws(shapes.total),
            per_die=self.config.jitter.enabled,  # only :meth:`_jitter` reads them
        )

    def _alive_pos(self, dps: list[int]) -> list[int]:
        """The positions of DP groups ``dps`` (in service) among those in service."""
        return np.searchsorted(self._alive_idx, dps).tolist()

    def _comm(self, widest: int, k: int) -> tuple[CommCosts, CommCosts]:
        """Dispatch/combine costs of the main pass (``1 + k`` tokens per sequence) and of the
        MTP pass (one) when the widest DP group holds ``widest`` sequences."""
        hit = self._comm_at.get(widest)
        if hit is None:
            hit = self._comm_at[widest] = (
                interpolate(self.grid, widest * (1 + k)),
                interpolate(self.grid, widest),
            )
        return hit

    def _jitter(self, out: IterationOutcome, gen: np.random.Generator, dps: int) -> int:
        """Host jitter of this iteration (SPEC 6.5, ``config.jitter``): each DP group's delay
        before its first dispatch, absorbed by that all-die barrier (the iteration grows by
        the most any DP's delay exceeds its slack there), plus the longest between-pass pause.
        ``out`` is the jitter-free iteration (cached by shape), whose first dispatch kernels
        measure each DP's slack: the barrier wait it had to spare."""
        if not self.config.jitter.enabled:  # draws nothing
            return 0
        before, between = sample_dps(self.config.jitter, gen, self.load.iterations, dps)
        if not before.any():
            return between
        slack = out.first_dispatch_ns - self.model.comm.dispatch_ns
        return max(0, int((before - slack).max())) + between

    def _finish(self, dp: int, s: int, t: int) -> None:
        req = int(self.slot_req[dp, s])
        self.slot_req[dp, s] = -1  # the sequence already left the live batch
        rec = self.records.pop(req)
        rec.finish_ns = t
        self.kv[dp].release(req)
        self.router.finished(req)
        self._report_kv(dp)
        emit("decode-te", "finished", request=req, dp=dp)
        self.done.pop(req).set()
        self._signal_capacity()
        if self.on_finish is not None:
            self.on_finish(rec)

    def check(self) -> None:
        """Blocks conserved on every DP and nothing left live."""
        for k in self.kv:
            k.check()
        if (self.slot_req >= 0).any():
            raise AssertionError("decode TE still holds sequences")
        if any(k.held_blocks for k in self.kv):
            raise AssertionError("decode KV blocks still held after the replay")
