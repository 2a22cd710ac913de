"""Trace replay on a PD-disaggregated deployment (SPEC 10.2, 12.4).

Every request of the workload becomes one task that walks the paper's PD path
(HANDLE_PD_REQUEST, SPEC 10.2):

1. at its arrival, the Job Executor picks a Prefill TE by cache state, load and input length
   (long inputs go to the long-input pool);
2. the TE's cooperative scheduler runs its prefill (the first token comes out here);
3. the Prefill DP master registers a DistFlow transfer (metadata only);
4. the Decode TE routes the request to a DP group (backpressure while none qualifies), whose
   master reserves the KV blocks (a deferred RECV while they do not fit) and submits the RECV;
5. DistFlow moves the KV; each side's poller dequeues the completion: the Prefill DP frees its
   blocks, the Decode DP puts the sequence in its batch;
6. the sequence decodes until its output length; the record is complete.

A request the deployment cannot serve (longer than the context window, larger than a DP's KV)
ends *failed* with the reason; every request ends exactly once, completed or failed.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import anyio
import anyio.abc
import msgspec
from msgspec import Meta

from ..config import check_fields, is_integer, require_int
from ..docfields import document_fields
from ..errors import ConfigError, ModelTimeLimit
from ..fabric import UBFabric
from ..fabric.xccl import XCCL
from ..hw import CloudMatrix384, PodConfig
from ..runtime import Runtime, current_runtime, emit, now_ns, sleep_ns, sleep_until_ns
from ..runtime.events import EventLog
from ..runtime.loop import HORIZON_NS, effective_limit_ns
from ..runtime.sync import task_group_raising_single
from ..trace.metrics import (
    SLA,
    DecodeStats,
    RequestRecord,
    Summary,
    check_complete,
    summarize,
)
from ..trace.workload import Request, Workload, hash_problem
from ..units import S, fmt_ns
from .decode import CommCosts, DecodeConfig
from .decode_model import decode_kv_capacity
from .decode_te import DecodeIterations, DecodeLoad, DecodeTE, IterationLog, KVNoFit, comm_grid
from .distflow import DistFlow, KVMover, TransferState
from .failover import Failover
from .jitter import JitterConfig
from .job_executor import (
    DecodeTESelection,
    DecodeTEView,
    PrefillTESelection,
    PrefillTEView,
    checked_choice,
    earliest_first_token,
    fewest_sequences,
)
from .kv import kv_capacity_blocks
from .policies import binds, policy_name, require_callable
from .prefill import PrefillConfig, PrefillJob, PrefillPlacement, PrefillTE, least_work
from .prefill_cost import (
    PrefillCost,
    check_attention_tp,
    prefill_hardware,
    prefill_te_link,
    prefill_tp_link,
)
from .probe import LinkMonitor, LinkVerdict, ProbeConfig, ProbeResult
from .recovery import KVMask, MemoryFault, NodeFault, RecoveryConfig, Restart, TEFailover
from .routing import DecodeRouting, lowest_kv

Progress = Callable[[int, int, int], None]
"""Called with (virtual time ns, requests ended, requests in the workload)."""


def check_pd_config(config: object) -> PDConfig:
    """``config`` as a :class:`PDConfig` (None: the default), or a ConfigError saying what to
    pass instead."""
    if config is None:
        return PDConfig()
    if isinstance(config, PDConfig):
        return config
    hint = (
        f"; for a preset or a file use xds.serve.presets.pd_config({config!r})"
        if isinstance(config, str)
        else ""
    )
    got = type(config).__name__
    raise ConfigError(f"config must be a PDConfig, got {got}{hint}", field="config")


POD_DIES = 768
"""910C dies of one CloudMatrix384 (384 chips)."""
MAX_DEPLOYMENT_DIES = 16 * 768
"""The most dies a PD deployment may have in all: its 910C dies fit one pod (:data:`POD_DIES`),
and attached 910B prefill servers make up the rest."""


REPLAY_GRACE_NS = 86_400 * S
"""How long a replay keeps serving after its last arrival or scheduled fault end, by default
(one day): far beyond any drain. Requests still in flight then fail with
:data:`SERVING_LIMIT_FAILURE` (an overloaded deployment's results are kept, not lost)."""

SERVING_LIMIT_FAILURE = "not served by the replay's serving limit"
"""The failure reason (followed by the limit) of a request still in flight when the replay
stops serving (``replay(..., serve_grace_ns=...)``, ``xds replay --serve-limit``)."""


NO_PAIR_FAILURE = "KV transfer impossible: every DistFlow pair has failed"
"""The failure reason of a request that needs decode arriving while no DistFlow pair works
(it fails on arrival; a one-token request is still served by prefill alone)."""

CONTEXT_FAILURE = "exceeds max_context_tokens"
MODEL_CONTEXT_TOKENS = 131_072
"""DeepSeek-R1's 128K context (SPEC 12.4), the default ``max_context_tokens``."""
"""The failure reason of a request longer than the model's context (every deployment of the
model fails it: capacity searches do not hold it against a deployment)."""


class PDConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A PD-disaggregated deployment (defaults: SPEC 12.4's 4P1D on 16 servers)."""

    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig(
        dies=128,
        batch_per_die=32,
        shared_expert_dies=16,
        input_tokens=13_000,
        output_tokens=2_100,
        jitter=JitterConfig(enabled=False),
    )
    """Decode TE (DP128/EP128, TP1). ``batch_per_die`` is the TE-shell's batch limit
    ([emulator choice] 32; SPEC 12.4 does not give it); ``input_tokens``/``output_tokens``
    are unused in a replay (lengths come from the workload). ``jitter`` applies per iteration
    (off here, as the paper's production runs with its mitigations); ``eplb`` must be None."""
    decode_tes: Annotated[int, Meta(ge=1)] = 1
    max_context_tokens: Annotated[int, Meta(ge=1)] = MODEL_CONTEXT_TOKENS
    """DeepSeek-R1's 128K context (SPEC 12.4): longer requests fail with this reason."""
    sla: SLA = SLA()
    kv_transfer: Literal["closed-form", "xccl"] = "closed-form"
    """How DistFlow moves KV: a closed form on the link (long replays) or real XCCL
    point-to-point transfers on the UB fabric (short replays; 910C prefill only)."""
    kv_aivs: Annotated[int, Meta(ge=1, le=48)] = 48
    """AIVs per KV transfer in the ``xccl`` tier, split over its TP rank parts (which then
    move side by side: 12 AIVs each at TP 4)."""
    record_token_times: bool | None = None
    """Per-token times (for inter-token latency); None: only for workloads up to 5,000
    requests (they cost memory on long traces)."""
    probe: ProbeConfig | None = None
    """Link probing of every DistFlow pair (SPEC 11.1, :mod:`xds.serve.probe`); a pair found
    LINK_FAILURE is taken out of service (None: no probing)."""
    recovery: RecoveryConfig = RecoveryConfig()
    """Restart-the-world after a :class:`~xds.serve.recovery.NodeFault` (SPEC 11.2 stage 1)."""

    def __post_init__(self) -> None:
        check_fields(self)
        self.prefill.precision.check_layers(  # prefill serves the decode TE's model
            self.decode.spec, field="prefill.precision.attention_int8_layers"
        )
        check_attention_tp(self.decode.spec, self.prefill.attention_tp)
        if self.kv_transfer == "xccl" and self.prefill.hardware != "910c":
            raise ConfigError(
                "the xccl KV tier runs on the UB fabric: it needs 910c prefill (910B KV moves "
                "over RoCE; use kv_transfer = 'closed-form')",
                field="kv_transfer",
            )
        p = self.prefill
        decode_dies = self.decode_tes * self.decode.dies
        pod_dies = decode_dies + (p.tes * p.dies_per_te if p.hardware == "910c" else 0)
        if pod_dies > POD_DIES:
            what = (
                "prefill.tes x prefill.dies_per_te + decode_tes x decode.dies"
                if p.hardware == "910c"
                else "decode_tes x decode.dies"
            )
            raise ConfigError(
                f"{what} = {pod_dies:,} 910C dies, but one CloudMatrix384 has {POD_DIES} "
                "(384 chips): xds models one pod (910B prefill servers attach over RoCE and do "
                "not count)",
                field="decode_tes" if decode_dies > pod_dies // 2 else "prefill.tes",
            )
        spare = self.recovery.spare_servers
        in_pod = self.decode_servers + (
            p.tes * self.prefill_servers_per_te if p.hardware == "910c" else 0
        )
        if spare and in_pod + spare > POD_DIES // 16:
            raise ConfigError(
                f"{in_pod} servers of the pod serve and {spare} are spares: one CloudMatrix384 "
                f"has {POD_DIES // 16} servers",
                field="recovery.spare_servers",
            )
        b_dies = p.tes * p.dies_per_te if p.hardware == "910b" else 0
        if b_dies > MAX_DEPLOYMENT_DIES - POD_DIES:
            raise ConfigError(
                f"prefill.tes x prefill.dies_per_te = {b_dies:,} 910B dies; a replay models up "
                f"to {MAX_DEPLOYMENT_DIES - POD_DIES:,} beside the pod",
                field="prefill.tes",
            )
        self._check_kv_room()
        if self.decode.eplb is not None:
            raise ConfigError(
                "online EPLB (decode.eplb) runs in the colocated decode group (`xds decode`, "
                "xds.serve.decode); a PD replay's Decode TE routes tokens uniformly over its "
                "static expert placement: leave decode.eplb unset",
                field="decode.eplb",
            )

    def _check_kv_room(self) -> None:
        """Every die keeps HBM for KV after its weights (a prefill die's share of the routed
        experts grows as ``prefill.dies_per_te`` shrinks; a decode die holds its routed
        experts and redundant slots), named here rather than when a replay starts."""
        pod = PodConfig()
        die, _ = prefill_hardware(self.prefill, pod)
        try:
            _prefill_kv_blocks(self.prefill, self.decode, die)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc.message}: a prefill die holds 1/{self.prefill.dies_per_te} of the routed "
                "experts (prefill.dies_per_te) beside its attention weights; spread them over "
                "more dies",
                field="prefill.dies_per_te",
            ) from None
        try:
            if not self.decode.kv_blocks_per_die:
                decode_kv_capacity(self.decode, CloudMatrix384())
        except ConfigError as exc:
            raise ConfigError(
                f"{exc.message}: a decode die holds its routed experts and redundant slots "
                "(decode.dies, decode.shared_expert_dies); spread them over more dies",
                field="decode.dies",
            ) from None

    @property
    def prefill_servers_per_te(self) -> int:
        p = self.prefill
        return -(-p.dies_per_te // (16 if p.hardware == "910c" else 8))

    @property
    def decode_servers(self) -> int:
        """Servers the Decode TEs span (16 dies each)."""
        return self.decode_tes * -(-self.decode.dies // 16)

    @property
    def servers(self) -> int:
        """Servers of the deployment, spares included (NodeFault numbering: Prefill TEs'
        first, then the Decode TEs', then the spares)."""
        p = self.prefill
        spare = self.recovery.spare_servers
        return p.tes * self.prefill_servers_per_te + self.decode_servers + spare

    def server_role(self, server: int) -> str:
        """What server ``server`` (NodeFault numbering) is in this deployment at the start:
        "Prefill TE k", "Decode TE d", "a spare" or "no server"."""
        per_p = self.prefill_servers_per_te  # (the failover's numbering)
        first_d = self.prefill.tes * per_p
        if server < first_d:
            return f"Prefill TE {server // per_p}"
        if server < first_d + self.decode_servers:
            return f"Decode TE {(server - first_d) // (self.decode_servers // self.decode_tes)}"
        return "a spare" if server < self.servers else "no server"

    @property
    def chips(self) -> int:
        """Chips of the deployment: each TE's dies on whole chips (two dies per 910C chip, so
        an odd count leaves a die idle; a 910B chip has one die). Spare servers are not
        counted: they serve only after a failover (:attr:`spare_chips`)."""
        p = self.prefill
        per_chip = 2 if p.hardware == "910c" else 1
        prefill = p.tes * -(-p.dies_per_te // per_chip)
        return prefill + self.decode_tes * -(-self.decode.dies // 2)

    @property
    def spare_chips(self) -> int:
        """Chips of the spare servers (``recovery.spare_servers``, eight 910C chips each): the
        hardware a design with spares also buys, which :attr:`chips` leaves out."""
        return self.recovery.spare_servers * 8


class DistFlowFault(msgspec.Struct, frozen=True, kw_only=True):
    """A fault of the DistFlow pair (``prefill_te``, ``decode_te``) from virtual time
    ``at_ns`` (:meth:`Replay.inject_distflow_failure`).

    ``kind = "transport"``: the instance fails every transfer it completes (a transport
    error each side sees), until either TE of the pair fails over: the TE that comes back gets
    a fresh instance, healthy. ``kind = "link_down"``: the link stalls silently, transfers and
    probes alike, for ``duration_ns`` (0: for good); only link probing
    (:attr:`PDConfig.probe`) tells it from Decode saturation and takes the pair out of
    service."""

    at_ns: Annotated[int, Meta(ge=0)]
    prefill_te: Annotated[int, Meta(ge=0)]
    decode_te: Annotated[int, Meta(ge=0)] = 0
    kind: Literal["transport", "link_down"] = "transport"
    duration_ns: Annotated[int, Meta(ge=0)] = 0
    """``link_down`` only: when the link comes back (0: never)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.duration_ns and self.kind != "link_down":
            raise ConfigError("only a link_down fault has a duration", field="duration_ns")


class ReplayResult(msgspec.Struct):
    records: list[RequestRecord]
    summary: Summary
    chips: int
    prefill_steps: int
    decode_iterations: int
    end_ns: int
    events: EventLog | None = None
    """The run's event log, with ``replay(..., event_log=True)``."""
    probes: list[ProbeResult] = []
    """Every link probe's outcome, with :attr:`PDConfig.probe` set."""
    restarts: list[Restart] = []
    """Every restart-the-world after a node fault."""
    failovers: list[TEFailover] = []
    """Every TE an independent failover took down, scaled down or scaled back up
    (``recovery.mode`` ``"independent"`` or ``"scale_down"``)."""
    kv_masks: list[KVMask] = []
    """Every :class:`~xds.serve.recovery.MemoryFault` and what it did."""
    unfired_faults: list[DistFlowFault | NodeFault | MemoryFault] = []
    """Faults given to the replay whose time never came: every request had finished first,
    so they struck nothing."""
    decode_iterations_log: list[DecodeIterations] = []
    """Per Decode TE, every iteration it completed: start, duration and sequences (what
    ``xds replay --timeline`` draws as each Decode TE's iteration time)."""

    @property
    def prefill_busy(self) -> list[float]:
        """Per Prefill TE, the share of the prefill phase (first arrival to last first token)
        it spent in steps: near 1 means prefill is the bottleneck (``summary.prefill_busy``)."""
        return self.summary.prefill_busy


class Replay(Failover):
    """The deployment as tasks: Prefill TEs, DistFlow instances, Decode TEs, request tasks."""

    def __init__(
        self,
        workload: Workload,
        config: PDConfig,
        grid: Sequence[CommCosts],
        *,
        progress: Progress | None = None,
        prefill_placement: PrefillPlacement = least_work,
        decode_routing: DecodeRouting = lowest_kv,
        prefill_te_selection: PrefillTESelection = earliest_first_token,
        decode_te_selection: DecodeTESelection = fewest_sequences,
        kv_mover: KVMover | None = None,
    ):
        """The four keyword policies plug in your own: the Job Executor's choice of Prefill TE
        and of Decode TE (:mod:`xds.serve.job_executor`), the Prefill TE leader's choice of DP
        group for a job (:func:`~xds.serve.prefill.least_work` by default) and the TE-shell's
        choice of decode DP (:func:`~xds.serve.routing.lowest_kv`). ``kv_mover`` plugs in a
        KV-transfer protocol of your own (:data:`~xds.serve.distflow.KVMover`)."""
        for name, policy in (
            ("prefill_placement", prefill_placement),
            ("decode_routing", decode_routing),
            ("prefill_te_selection", prefill_te_selection),
            ("decode_te_selection", decode_te_selection),
        ):
            # decode routing may take the request as a fourth argument
            require_callable(policy, name, arity=(3, 4) if name == "decode_routing" else 2)
        if kv_mover is not None:
            require_callable(kv_mover, "kv_mover")
            if binds(kv_mover, 1) is False:  # (whether it is async shows when it is called)
                raise ConfigError(
                    f"kv_mover {policy_name(kv_mover)}{inspect.signature(kv_mover)} must take "
                    "one argument, the KVMove: `async def mover(move): ...`",
                    field="kv_mover",
                )
            plain = inspect.unwrap(kv_mover)
            if inspect.isfunction(plain) and not (
                inspect.iscoroutinefunction(plain) or inspect.isasyncgenfunction(plain)
            ):  # refused now, not at the first transfer (a callable object shows it then)
                raise ConfigError(
                    f"kv_mover {policy_name(kv_mover)} is a plain function: a mover awaits its "
                    "transfers, `async def mover(move): ...`",
                    field="kv_mover",
                )
        if progress is not None:
            require_callable(progress, "progress", arity=3, kind="callback")
        self._kv_mover = kv_mover
        self.prefill_te_selection = prefill_te_selection
        self.decode_te_selection = decode_te_selection
        workload = _check_workload(workload)
        check_prefix_blocks(workload, config)
        self.workload = workload
        self.config = config
        self.progress = progress
        cfg = config
        model = cfg.decode.spec
        pod = PodConfig()
        die, link = prefill_hardware(cfg.prefill, pod)
        drafts = cfg.decode.drafts  # prefill runs (and keeps) the MTP layer too
        self.prefill_cost = PrefillCost(
            model,
            cfg.prefill,
            die,
            pod.engines,
            prefill_te_link(cfg.prefill, pod),
            tp_link=prefill_tp_link(cfg.prefill, pod),
            mtp=drafts,
        )
        self._kv_dp = _prefill_kv_blocks(cfg.prefill, cfg.decode, die)
        self._prefill_placement = prefill_placement
        self._decode_routing = decode_routing
        self._grid = grid
        record = cfg.record_token_times
        self._record_tokens = len(workload) <= 5_000 if record is None else record
        self.iteration_logs: dict[int, IterationLog] = {}
        """Per Decode TE (by index), its iterations: one log across its restarts."""
        self.prefill: list[PrefillTE] = []
        self.decode: list[DecodeTE] = []
        self._prefill_cfg = cfg.prefill
        self._init_failover()  # the TEs' servers first
        self._build_tes(cfg.prefill.tes)
        self._link, self._engines = link, pod.engines
        self.distflow: dict[tuple[int, int], DistFlow] = {}
        self.xccl: XCCL | None = None
        self._faults: list[DistFlowFault] = []
        self._struck_ids: set[int] = set()  # id() of the faults whose time came (membership)
        self._node_faults: list[NodeFault] = []
        self._memory_faults: list[MemoryFault] = []
        self.monitor: LinkMonitor | None = None
        self._picks = 0
        self.kv_bytes_per_token = cfg.decode.kv_bytes_per_token
        self.records: dict[int, RequestRecord] = {}
        self.ended = 0
        self._failed_pairs: dict[tuple[int, int], int] = {}
        """DistFlow pairs the Job Executor has seen fail a transfer, and when: it stops
        choosing them (an ordered dict used as a set)."""
        self._system: anyio.abc.TaskGroup | None = None
        self._inflight: dict[int, anyio.CancelScope] = {}
        """Request -> the scope of its task, while it has not ended."""
        self._ended_ids: set[int] = set()
        self._ingress: list[dict[int, list[tuple[int, int]]]] = []
        self._egress: list[dict[int, list[tuple[int, int]]]] = []

    def _build_tes(self, prefill_tes: int) -> None:
        """Fresh Prefill and Decode TEs (at the start, and after a restart with
        ``prefill_tes`` Prefill TEs)."""
        cfg = self.config
        p = cfg.prefill
        if prefill_tes != p.tes:
            p = msgspec.structs.replace(
                p, tes=prefill_tes, long_pool_tes=min(p.long_pool_tes, prefill_tes - 1)
            )
        self._prefill_cfg = p
        self.prefill = [self._new_prefill_te(i) for i in range(prefill_tes)]
        self.decode = [self._new_decode_te(d) for d in range(cfg.decode_tes)]
        self._picked = [0] * prefill_tes  # when each Prefill TE was last picked

    def _new_prefill_te(self, k: int) -> PrefillTE:
        return PrefillTE(
            k,
            self._prefill_cfg,
            self.prefill_cost,
            kv_blocks_per_dp=self._kv_dp,
            placement=self._prefill_placement,
        )

    def _new_decode_te(self, d: int) -> DecodeTE:
        te = DecodeTE(
            self.config.decode,
            self._grid,
            index=d,
            record_token_times=self._record_tokens,
            on_finish=self._ended,
            routing=self._decode_routing,
            servers=self.placement.decode[d],
            iteration_log=self.iteration_logs.setdefault(d, IterationLog(f"D{d}")),
        )
        self._remask(te)
        return te

    def _grid_of(self, config: DecodeConfig) -> Sequence[CommCosts]:
        """Dispatch/combine costs of a Decode TE of ``config`` (a scale-down's smaller TE)."""
        return comm_grid(config, seed=current_runtime().seed)

    # -- the Job Executor --
    def select_prefill(self, req: Request) -> PrefillTE:
        """By request length, cache state and load (P096): long inputs go to the long-input
        pool; within the pool the ``prefill_te_selection`` policy chooses (by default
        :func:`~xds.serve.job_executor.earliest_first_token`)."""
        p = self._prefill_cfg
        n_long = p.long_pool_tes
        long = n_long and req.input_tokens > p.long_input_threshold
        pool = self.prefill[-n_long:] if long else self.prefill[: len(self.prefill) - n_long]
        pool = [te for te in pool if te.index not in self._prefill_down] or [
            te for te in self.prefill if te.index not in self._prefill_down
        ]
        working = [te for te in pool if self._decode_tes_from(te.index)]
        pool = working or pool  # none left: the request fails after its prefill, with a reason
        now = now_ns()
        offer = []
        for te in pool:
            cached = min(te.cached_tokens(req.prefix_hashes), req.input_tokens - 1)
            offer.append(
                PrefillTEView(
                    te.index,
                    te.predicted_first_token_ns(req.input_tokens - cached, now, req.input_tokens),
                    cached,
                    te.queued_tokens,
                    self._picked[te.index],
                )
            )
        te = self.prefill[
            checked_choice(self.prefill_te_selection, req, offer, "prefill_te_selection")
        ]
        self._picks += 1
        self._picked[te.index] = self._picks
        return te

    def _no_working_pair(self) -> bool:
        """Every DistFlow pair from a Prefill TE in service has failed a transfer: no KV can
        reach Decode until a restart rebuilds one."""
        failed = self._failed_pairs
        if any(d not in self._decode_lost for d in self._decode_down):
            return False  # a Decode TE coming back brings fresh pairs; requests wait for it
        return bool(failed) and all(
            (te.index, d) in failed
            for te in self.prefill
            if te.index not in self._prefill_down
            for d in range(len(self.decode))
        )

    def _decode_tes_from(self, prefill_te: int) -> list[DecodeTE]:
        """The Decode TEs in service whose DistFlow pair with ``prefill_te`` has not failed a
        transfer."""
        return [
            d
            for d in self.decode
            if (prefill_te, d.index) not in self._failed_pairs and d.index not in self._decode_down
        ]

    def select_decode(self, req: Request, prefill_te: int) -> DecodeTE | None:
        """By real-time load (P099): the ``decode_te_selection`` policy (by default
        :func:`~xds.serve.job_executor.fewest_sequences`) over the Decode TEs whose DistFlow
        pair with ``prefill_te`` has not failed (None if every one has) and, where memory
        faults masked KV, that could still hold the sequence (all of them if none could: the
        chosen one then fails it, saying why)."""
        usable = self._decode_tes_from(prefill_te)
        if not usable:
            return None
        fit = [d for d in usable if d.could_ever_hold(req.input_tokens, req.output_tokens)]
        offer = [
            DecodeTEView(d.index, d.router.sequences, d.router.kv_used_blocks)
            for d in fit or usable
        ]
        return self.decode[
            checked_choice(self.decode_te_selection, req, offer, "decode_te_selection")
        ]

    # -- one request --
    def _failure(self, req: Request) -> str:
        total = req.input_tokens + req.output_tokens
        if total > self.config.max_context_tokens:
            limit = self.config.max_context_tokens
            return f"context {total} tokens {CONTEXT_FAILURE} {limit}"
        te = self.prefill[0]
        limit = te.max_input_tokens()
        if req.input_tokens > limit:
            groups = len(te.kv)
            if limit > te.kv[0].capacity * te.config.block_tokens:  # sequence-parallel
                where = (
                    f"a prefill TE's KV (room for {limit} prompt tokens over its {groups} DP "
                    "groups)"
                )
            else:
                where = f"a prefill DP's KV (room for {limit} prompt tokens)"
            return f"input {req.input_tokens} tokens exceeds {where}"
        cap = self.config.decode.reserve_output_tokens
        if cap and req.output_tokens > cap:
            return f"output {req.output_tokens} tokens exceeds max_output_tokens {cap}"
        dkv = self.decode[0].kv[0]
        reserved = req.input_tokens + self.decode[0].reserved_output(req.output_tokens)
        if req.output_tokens > 1 and dkv.blocks_for(reserved) > dkv.capacity:  # 1: no decode
            return f"sequence of {reserved} tokens exceeds a decode DP's KV"
        return ""

    def _ended(self, record: RequestRecord) -> None:
        self._ended_ids.add(record.request_id)
        self.ended += 1
        if self.progress is not None:
            self.progress(record.finish_ns, self.ended, len(self.workload))

    def _record(self, req: Request) -> RequestRecord:
        """The record of ``req``, kept for the results (one per request, always)."""
        rec = self.records[req.request_id] = RequestRecord(
            req.request_id,
            req.arrival_ns,
            req.input_tokens,
            req.output_tokens,
            source_line=req.source_line,
        )
        return rec

    async def _serve(self, req: Request) -> None:
        rec = self._record(req)
        await sleep_until_ns(req.arrival_ns)
        reason = self._failure(req)
        if reason:
            rec.outcome, rec.reason = "failed", reason
            rec.finish_ns = req.arrival_ns
            self._ended(rec)
            return
        if len(self._prefill_down) == len(self.prefill):
            self._fail(rec, "service unavailable: no Prefill TE in service (node faults)")
            return
        if req.output_tokens > 1 and self._no_working_pair():
            self._fail(rec, NO_PAIR_FAILURE)  # its prefill would be wasted
            return
        te = self.select_prefill(req)
        rid = req.request_id
        where = self._where_of(rid)
        where.prefill_te = te
        where.job = PrefillJob(rid, req.input_tokens, req.prefix_hashes, req.arrival_ns)
        job = await te.prefill(where.job)
        if rid in self._ended_ids:  # failed by a failover while its cancel was in flight
            return
        where.prefill_dp = job.dp
        rec.first_token_ns = job.first_token_ns
        rec.queue_ns = job.start_ns - req.arrival_ns
        rec.cached_tokens = job.cached_tokens
        rec.prefill_placement = (
            f"P{te.index}/SP{job.sp}"
            if job.alone
            else f"P{te.index}/DP{job.dp}" + (f"x{job.sp}" if job.sp > 1 else "")
        )
        if req.output_tokens == 1:  # prefill's token was the whole output
            te.release(job.dp, rid)
            rec.finish_ns = job.first_token_ns
            self._ended(rec)
            return
        lost = await self._await_decode()  # every Decode TE restarting: the KV waits here
        if rid in self._ended_ids:
            return
        if lost:
            te.release(job.dp, rid)
            self._fail(rec, lost)
            return
        dte = self.select_decode(req, te.index)
        if dte is None:  # every pair from this Prefill TE has failed a transfer
            te.release(job.dp, rid)
            rec.outcome = "failed"
            rec.reason = f"KV transfer impossible: every DistFlow pair from P{te.index} failed"
            rec.finish_ns = now_ns()
            self._ended(rec)
            return
        flow = self.distflow[(te.index, dte.index)]
        blocks = sum(kv.held(rid) for kv in te.kv)  # every group's share
        transfer = flow.register(rid, job.dp, blocks, req.input_tokens * self.kv_bytes_per_token)
        where.flow, where.transfer = flow, transfer
        where.decode_te = dte
        try:
            dp = await dte.route(rec)
            where.decode_dp = dp
            if rid in self._ended_ids:
                return
            await dte.reserve(dp, rec)
        except KVNoFit as exc:  # memory faults left no DP group that can hold it
            flow.withdraw(transfer)
            te.release(job.dp, rid)
            if where.decode_dp >= 0:
                dte.abandon(where.decode_dp, rec)
            self._fail(rec, str(exc))
            return
        if rid in self._ended_ids:
            return
        rec.decode_wait_ns = now_ns() - rec.first_token_ns
        await flow.recv(transfer, dp)
        where.transferred = True
        rec.kv_transfer_ns = transfer.done_ns - transfer.recv_ns
        await dte.done[rid].wait()

    async def _prefill_poller(self, flow: DistFlow, dp: int) -> None:
        te = self.prefill[flow.prefill_te]
        async with flow.prefill_cq[dp][1] as cq:
            async for done in cq:
                te.release(dp, done.request_id)

    async def _decode_poller(self, flow: DistFlow, dte: DecodeTE, dp: int) -> None:
        async with flow.decode_cq[dp][1] as cq:
            async for done in cq:
                rec = self.records[done.request_id]
                if done.request_id in self.failed_by_failover:  # failed while in transfer
                    dte.abandon(dp, rec)
                elif done.state is TransferState.COMPLETED:
                    dte.enqueue(dp, rec)
                else:  # the pair's DistFlow failed: the request fails, its blocks return
                    pair = (flow.prefill_te, dte.index)
                    if pair not in self._failed_pairs:  # the Job Executor learns of it here
                        self._failed_pairs[pair] = now_ns()
                        emit("job-executor", "pair-avoided", prefill_te=pair[0], decode_te=pair[1])
                    rec.outcome = "failed"
                    rec.reason = (
                        f"KV transfer {done.state.value} (DistFlow P{flow.prefill_te}-D{dte.index})"
                    )
                    if flow.declared_failed:
                        rec.reason += ": link down, found by link probing"
                    rec.finish_ns = now_ns()
                    dte.abandon(dp, rec)
                    self._ended(rec)

    def inject_distflow_failure(
        self,
        at_ns: int,
        prefill_te: int,
        decode_te: int = 0,
        *,
        kind: Literal["transport", "link_down"] = "transport",
        duration_ns: int = 0,
    ) -> None:
        """Fault injection (:class:`DistFlowFault`): from virtual time ``at_ns`` the DistFlow
        instance of (Prefill TE, Decode TE) fails every transfer it completes, or its link
        stalls silently; other pairs are unaffected (isolation, P102). Call before
        :meth:`run`."""
        self._inject_distflow(
            DistFlowFault(
                at_ns=at_ns,
                prefill_te=prefill_te,
                decode_te=decode_te,
                kind=kind,
                duration_ns=duration_ns,
            )
        )

    def _inject_distflow(self, fault: DistFlowFault) -> None:
        _check_distflow_fault(self.config, fault, "")
        self._faults.append(fault)

    def _struck(self, fault: object) -> None:
        """``fault``'s time has come (a replay that ends first never sees it)."""
        self._struck_ids.add(id(fault))

    def unfired(self, faults: Sequence[object]) -> list[object]:
        """The faults of ``faults`` whose time never came: the replay ended first."""
        return [f for f in faults if id(f) not in self._struck_ids]

    async def _fault(self, fault: DistFlowFault) -> None:
        await sleep_until_ns(fault.at_ns)
        self._struck(fault)
        flow = self.distflow.get((fault.prefill_te, fault.decode_te))
        if flow is None:  # a restart-the-world left that Prefill TE out
            emit("distflow", "fault-skipped", prefill_te=fault.prefill_te, reason="no such pair")
            return
        if fault.kind == "transport":
            flow.fail_transfers()
            emit(
                "distflow",
                "instance-failed",
                prefill_te=fault.prefill_te,
                decode_te=fault.decode_te,
            )
            return
        flow.link_down()
        if fault.duration_ns:
            await sleep_ns(fault.duration_ns)
            flow.link_restore()

    def _probed(self, flow: DistFlow, result: ProbeResult) -> None:
        """Link probing found the pair down: take it out of service; the Job Executor avoids
        it from now on, and the transfers stalled on it fail."""
        if result.verdict is LinkVerdict.LINK_FAILURE and not flow.declared_failed:
            self._failed_pairs.setdefault((flow.prefill_te, flow.decode_te), now_ns())
            emit(
                "job-executor", "pair-avoided", prefill_te=flow.prefill_te, decode_te=flow.decode_te
            )
            flow.declare_failed()

    def _build_distflow(self, xccl: XCCL | None) -> None:
        """One DistFlow instance per (Prefill TE, Decode TE) pair; die numbering: the Prefill
        TEs' dies first, then the Decode TEs'."""
        self.xccl = xccl
        self.distflow = {}
        self._ingress = [{} for _ in self.decode]  # per decode TE: its dies' ports
        self._egress = [{} for _ in self.prefill]  # per prefill TE: its dies' ports
        for te in range(len(self.prefill)):
            for d in range(len(self.decode)):
                self.distflow[(te, d)] = self._new_flow(te, d)

    def _new_flow(self, te: int, d: int) -> DistFlow:
        cfg = self.config
        p, tp = self._prefill_cfg, cfg.prefill.attention_tp
        decode_base = p.tes * p.dies_per_te
        return DistFlow(
            te,
            tp=tp,
            link=self._link,
            engines=self._engines,
            prefill_dps=p.dps_per_te,
            decode_dps=cfg.decode.dies,
            ingress=self._ingress[d],
            egress=self._egress[te],
            xccl=self.xccl,
            prefill_die=lambda dp, rank, te=te: te * p.dies_per_te + dp * tp + rank,
            decode_die=lambda dp, d=d: decode_base + d * cfg.decode.dies + dp,
            aivs=cfg.kv_aivs,
            decode_te=d,
            mover=self._kv_mover,
        )

    async def run(self) -> list[RequestRecord]:
        if self.config.kv_transfer == "xccl":
            cfg = self.config
            dies = cfg.prefill.tes * cfg.prefill.dies_per_te + cfg.decode_tes * cfg.decode.dies
            pod = CloudMatrix384(servers=-(-dies // 16))
            # size mode allocates nothing: a KV message may address the whole HBM
            fabric = UBFabric(pod, payload_mode="size", app_bytes=pod.die_spec.hbm_bytes)
            async with XCCL(fabric) as xccl:
                self._build_distflow(xccl)
                return await self._run()
        self._build_distflow(None)
        return await self._run()

    async def _run(self) -> list[RequestRecord]:
        async with task_group_raising_single() as system:  # a policy's error as itself
            self._system = system
            self._start_engine(first=True)
            for fault in self._node_faults:
                system.start_soon(self._node_fault, fault, name=f"node-fault-{fault.server}")
            for mfault in self._memory_faults:
                system.start_soon(self._memory_fault, mfault, name=f"memory-fault-{mfault.dp}")
            async with anyio.create_task_group() as requests:
                for req in self.workload.requests:
                    await sleep_until_ns(req.arrival_ns)
                    requests.start_soon(self._request, req, name=f"request-{req.request_id}")
            system.cancel_scope.cancel()
        if not self.down:  # the TEs of an engine torn down by a restart are gone
            for te in self.prefill:  # so are TEs a failover left down
                if te.index not in self._prefill_down:
                    te.check()
            for dte in self.decode:
                if dte.index not in self._decode_down:
                    dte.check()
            for (p, d), flow in self.distflow.items():
                if p not in self._prefill_down and d not in self._decode_down:
                    flow.check()
        records = [self.records[r.request_id] for r in self.workload.requests]
        return records

    def stop_serving(self, at_ns: int) -> list[RequestRecord]:
        """The records once the run has stopped at its serving limit ``at_ns``: every request
        that had not ended fails there with :data:`SERVING_LIMIT_FAILURE` (what it got so
        far, a first token say, stays on its record)."""
        reason = f"{SERVING_LIMIT_FAILURE} at {fmt_ns(at_ns)}"
        for req in self.workload.requests:
            rec = self.records.get(req.request_id) or self._record(req)
            if req.request_id not in self._ended_ids:
                rec.outcome, rec.reason, rec.finish_ns = "failed", reason, at_ns
                self._note_progress(rec)
                self._ended(rec)  # progress hears of it too
        return [self.records[r.request_id] for r in self.workload.requests]

    def _start_engine(self, *, first: bool = False) -> None:
        """Start the engine's tasks: TEs, DistFlow completion-queue pollers, and (once) the
        DistFlow fault injectors and the link monitor (:meth:`_run` starts the node and memory
        fault injectors)."""
        system = self._system
        assert system is not None
        for k in range(len(self.prefill)):
            self._start_prefill_te(k)
        for d in range(len(self.decode)):
            self._start_decode_te(d)
        if first:
            for fault in self._faults:
                system.start_soon(self._fault, fault)
            if self.config.probe is not None:
                self.monitor = LinkMonitor(
                    list(self.distflow.values()), self.config.probe, on_result=self._probed
                )
                system.start_soon(self.monitor.run, name="link-monitor")
        elif self.monitor is not None:
            self.monitor.flows = list(self.distflow.values())
        for (p, d), flow in self.distflow.items():
            self._start_pollers(p, d, flow, prefill=True, decode=True)

    async def _request(self, req: Request) -> None:
        """One request's task, in a scope a restart-the-world cancels."""
        if self.down:
            rec = self._record(req)
            self._fail(rec, f"service unavailable: {self.down}")
            return
        rid = req.request_id
        with anyio.CancelScope() as scope:
            self._inflight[rid] = scope
            try:
                await self._serve(req)
            finally:
                del self._inflight[rid]
        if rid in self.failed_by_failover:
            self._undo(rid)  # give back what it holds on TEs still in service
        self._where.pop(rid, None)

    def _fail(self, rec: RequestRecord, reason: str) -> None:
        rec.outcome, rec.reason = "failed", reason
        rec.finish_ns = now_ns()
        self._note_progress(rec)
        self._ended(rec)

    def _note_progress(self, rec: RequestRecord) -> None:
        """How far a failing request (at ``rec.finish_ns``) got, on its record: before its
        first token, which Prefill TE had it (``P1``) and how long it queued there (until its
        step started, or until it failed); with its KV in transfer, the transfer time until it
        failed."""
        where = self._where.get(rec.request_id)
        if where is None:
            return
        transfer = where.transfer
        if rec.first_token_ns >= 0:
            if transfer is not None and transfer.recv_ns >= 0 and not rec.kv_transfer_ns:
                rec.kv_transfer_ns = max(0, rec.finish_ns - transfer.recv_ns)
            return
        if where.prefill_te is None:
            return
        rec.prefill_placement = rec.prefill_placement or f"P{where.prefill_te.index}"
        job = where.job
        started = job.start_ns if job is not None and job.start_ns >= 0 else rec.finish_ns
        rec.queue_ns = max(0, started - rec.arrival_ns)

    def inject_node_fault(self, fault: NodeFault) -> None:
        """Fault injection (SPEC 11.2 stage 1): an NPU fault on a server; the engine restarts
        the world (:mod:`xds.serve.recovery`). Call before :meth:`run`."""
        if not isinstance(fault, NodeFault):
            raise ConfigError(f"expected a NodeFault, got {fault!r}", field="faults")
        if fault.server >= self.config.servers:
            raise ConfigError(
                f"server {fault.server} does not exist (the deployment has "
                f"{self.config.servers} servers)",
                field="server",
            )
        if self.config.kv_transfer == "xccl":
            raise ConfigError(
                "node faults need kv_transfer = 'closed-form' (the xccl tier's fabric is not "
                "rebuilt on restart)",
                field="kv_transfer",
            )
        self._node_faults.append(fault)

    def inject_memory_fault(self, fault: MemoryFault) -> None:
        """Fault injection (SPEC 11.2 stage 3): an on-chip memory fault masks KV blocks of a
        Decode DP group (:mod:`xds.serve.recovery`). Call before :meth:`run`."""
        if not isinstance(fault, MemoryFault):
            raise ConfigError(f"expected a MemoryFault, got {fault!r}", field="faults")
        cfg = self.config
        if fault.decode_te >= cfg.decode_tes:
            raise ConfigError(
                f"decode_te {fault.decode_te} does not exist (the deployment has "
                f"{cfg.decode_tes} Decode TEs)",
                field="decode_te",
            )
        if fault.dp >= cfg.decode.dies:
            raise ConfigError(
                f"dp {fault.dp} does not exist (a Decode TE has {cfg.decode.dies} DP groups)",
                field="dp",
            )
        if cfg.kv_transfer == "xccl":
            raise ConfigError(
                "memory faults need kv_transfer = 'closed-form' (an XCCL transfer is not "
                "cancelled halfway when its request fails)",
                field="kv_transfer",
            )
        capacity = self.decode[0].kv_capacity
        if fault.first_block + fault.blocks > capacity:
            raise ConfigError(
                f"blocks {fault.first_block}..{fault.first_block + fault.blocks - 1} lie "
                f"outside a Decode DP group's KV blocks 0..{capacity - 1}",
                field="first_block" if fault.first_block >= capacity else "blocks",
            )
        self._memory_faults.append(fault)


DAY_NS = 86_400 * 10**9
MAX_ARRIVAL_NS = HORIZON_NS // 2
"""The latest arrival a replay takes (about 24 days): virtual time stops at
:data:`xds.runtime.loop.HORIZON_NS`, and the requests still need serving."""


def check_distflow_faults(config: PDConfig, faults: Sequence[object]) -> None:
    """Every entry of ``faults`` is a replay fault, and each DistFlow fault names a (Prefill TE,
    Decode TE) pair the deployment has (ConfigError ``faults[i]...``; node and memory faults
    are checked against the deployment when injected)."""
    for i, fault in enumerate(faults):
        if isinstance(fault, NodeFault | MemoryFault):
            continue
        if not isinstance(fault, DistFlowFault):
            raise ConfigError(
                f"expected DistFlowFault, NodeFault or MemoryFault entries, got {fault!r}",
                field=f"faults[{i}]",
            )
        _check_distflow_fault(config, fault, f"faults[{i}].")


def _check_distflow_fault(config: PDConfig, fault: DistFlowFault, where: str) -> None:
    """``fault``'s pair exists, and a link down for good has link probing to find it
    (ConfigError naming ``where`` + the field)."""
    for te, have, kind in (
        ("prefill_te", config.prefill.tes, "Prefill"),
        ("decode_te", config.decode_tes, "Decode"),
    ):
        if getattr(fault, te) >= have:
            raise ConfigError(
                f"no DistFlow instance P{fault.prefill_te}-D{fault.decode_te}: the "
                f"deployment has {have} {kind} TE{'s' * (have != 1)}",
                field=f"{where}{te}",
            )
    if fault.kind == "link_down" and not fault.duration_ns and config.probe is None:
        raise ConfigError(
            f"a link_down fault of P{fault.prefill_te}-D{fault.decode_te} for good stalls its "
            "transfers forever unless link probing finds it: set the deployment's probe "
            "(probe = {} in a deployment file, --probe on the command line) or give the fault "
            "a duration",
            field=f"{where}duration_ns",
        )


_REQUEST_INTS = ("request_id", "arrival_ns", "input_tokens", "output_tokens", "source_line")


def _plain_request(r: Request, where: str) -> Request:
    """``r`` with plain ints where a Python-built workload may hold numpy integers (they
    replay, but its records could not be written as JSON); anything else that is not an
    integer (a float, a string) is a ConfigError naming the request and the field."""
    fields: dict[str, object] = {}
    for name in _REQUEST_INTS:
        v = getattr(r, name)
        if type(v) is not int:
            if not is_integer(v):
                raise ConfigError(f"{where}: {name} must be an integer, got {v!r:.40}", field=name)
            fields[name] = int(v)  # type: ignore[call-overload]
    hashes = r.prefix_hashes
    if type(hashes) is not tuple or any(type(h) is not int for h in hashes):
        if not isinstance(hashes, Sequence) or not all(is_integer(h) for h in hashes):
            raise ConfigError(
                f"{where}: prefix_hashes must be a sequence of integers, got {hashes!r:.60}",
                field="prefix_hashes",
            )
        fields["prefix_hashes"] = tuple(int(h) for h in hashes)
    return msgspec.structs.replace(r, **fields) if fields else r


def check_prefix_blocks(workload: Workload, config: PDConfig) -> None:
    """A workload carrying prefix hashes must hash blocks of the prefix cache's size."""
    block = workload.hash_block_tokens
    if block and block != config.prefill.prefix_block_tokens:
        raise ConfigError(
            f"{workload.source}'s prefix hashes cover {block} tokens each, but the prefix "
            f"cache's blocks are {config.prefill.prefix_block_tokens}: set it to {block} "
            "(another size would credit cache hits the trace does not have, or miss ones it "
            "has)",
            field="prefill.prefix_block_tokens",
        )


def _check_workload(workload: Workload) -> Workload:
    """A replayable workload: requests 0..n-1 in order, positive lengths, sorted arrivals,
    prefix hashes that say how many tokens each covers and are no more than the prompt's
    blocks. Returned with plain ints throughout (numpy integers converted)."""
    if not isinstance(workload, Workload):
        raise ConfigError(
            f"must be a Workload (xds.trace: a loader, a generator or Workload(requests)), "
            f"got {type(workload).__name__}",
            field="workload",
        )
    if not len(workload):
        raise ConfigError("the workload has no requests", field="workload")
    block = workload.hash_block_tokens
    if not is_integer(block) or block < 0:
        raise ConfigError(
            f"hash_block_tokens must be an integer >= 0, got {block!r:.40}",
            field="hash_block_tokens",
        )
    last = 0
    plain: list[Request] = []
    for i, r in enumerate(workload.requests):
        line = getattr(r, "source_line", 0)
        where = f"{workload.source}: request {i}" + (f" (line {line})" if line else "")
        if not isinstance(r, Request):
            raise ConfigError(
                f"{where} must be an xds.trace.Request, got {type(r).__name__}", field="requests"
            )
        r = _plain_request(r, where)
        plain.append(r)
        if r.request_id != i:
            raise ConfigError(
                f"{where} has request_id {r.request_id}; ids must be 0..n-1 in order",
                field="request_id",
            )
        for name in ("input_tokens", "output_tokens"):
            if getattr(r, name) < 1:
                raise ConfigError(
                    f"{where}: {name} must be >= 1, got {getattr(r, name)}", field=name
                )
        if r.arrival_ns < 0:
            raise ConfigError(
                f"{where}: arrival_ns must be >= 0, got {r.arrival_ns}", field="arrival_ns"
            )
        if r.arrival_ns < last:
            raise ConfigError(
                f"{where} arrives at {r.arrival_ns} ns, before the request ahead of it ({last} ns)",
                field="arrival_ns",
            )
        last = r.arrival_ns
        if r.prefix_hashes:
            _check_hashes(r, block, where)
    if last > MAX_ARRIVAL_NS:
        i = next(i for i, r in enumerate(plain) if r.arrival_ns > MAX_ARRIVAL_NS)
        line, first = getattr(plain[i], "source_line", 0), getattr(plain[0], "source_line", 0)
        where = f"request {i}" + (f" (line {line})" if line else "")
        since = f"the first request (line {first})" if first else "the first request"
        raise ConfigError(
            f"{workload.source}: {where} arrives {plain[i].arrival_ns / DAY_NS:.1f} days after "
            f"{since}; xds replays arrivals up to {MAX_ARRIVAL_NS / DAY_NS:.1f} days (half its "
            "exact virtual-time horizon; the rest is for serving them): check those "
            "timestamps, shorten the trace or raise its rate",
            field="arrival_ns",
        )
    changed = any(a is not b for a, b in zip(plain, workload.requests, strict=True))
    return msgspec.structs.replace(workload, requests=tuple(plain)) if changed else workload


def _check_hashes(r: Request, block: int, where: str) -> None:
    """A request's prefix hashes, by the trace loaders' rule (:func:`hash_problem`)."""
    if not block:
        raise ConfigError(
            f"{where} carries prefix hashes but the workload's hash_block_tokens is 0: set it "
            "to the tokens each hash covers (Workload(..., hash_block_tokens=512))",
            field="hash_block_tokens",
        )
    problem = hash_problem(r.prefix_hashes, r.input_tokens, block)
    if problem:
        raise ConfigError(f"{where}: {problem}", field="prefix_hashes")


def _prefill_kv_blocks(p: PrefillConfig, d: DecodeConfig, die) -> int:
    """KV blocks of one prefill DP group: a die's HBM after its weights (attention, dense
    layers and embeddings split by TP; its share of the routed experts and the shared expert,
    at the prefill's precision; the MTP layer's when the decode drafts) and the workspace.
    MLA's latent cache is replicated on the TP ranks, GQA's KV heads are split over them; a
    block holds the MTP layer's KV too when the decode drafts."""
    m = d.spec
    experts = max(1, m.routed_experts // p.dies_per_te) + m.shared_experts
    weights = p.precision.weight_bytes(m, experts=experts, tp=p.attention_tp, mtp=d.drafts)
    return kv_capacity_blocks(
        m,
        die,
        weight_bytes=weights,
        block_tokens=p.block_tokens,
        int8_nope=p.precision.kv_int8_nope,
        mtp=d.drafts,
        tp=p.attention_tp,
    )


def _prefill_phase_ns(records: list[RequestRecord]) -> int:
    first = min((x.arrival_ns for x in records), default=0)
    last = max((x.first_token_ns for x in records), default=first)
    return max(1, last - first)


def _decode_stats(load: DecodeLoad, records: list[RequestRecord], tes: int) -> DecodeStats:
    """The summary's decode figures from the TEs' iteration-loop totals ``load``."""
    started = [x.first_token_ns for x in records if x.first_token_ns >= 0]
    first = min(started, default=0)
    phase = max(1, max((x.finish_ns for x in records), default=first) - first)
    busy = max(1, load.busy_ns)
    return DecodeStats(
        iterations=load.iterations,
        mean_iteration_ms=load.busy_ns / max(1, load.iterations) / 1e6,
        busy=min(1.0, load.busy_ns / (phase * tes)),
        sequences_per_die=load.sequence_ns / max(1, load.die_ns),
        context_max_over_mean=load.skew_ns / busy if load.busy_ns else math.nan,
        context_max_over_ideal=load.spread_ns / busy if load.busy_ns else math.nan,
    )


def _checked(config: object, workload: Workload, faults: object) -> tuple[PDConfig, Workload]:
    """The checks :func:`replay` makes of its arguments before it builds anything."""
    cfg = check_pd_config(config)
    workload = _check_workload(workload)
    kinds = DistFlowFault | NodeFault | MemoryFault
    if isinstance(faults, kinds | str) or not isinstance(faults, Sequence):
        raise ConfigError(
            "faults is a list of DistFlowFault, NodeFault or MemoryFault, got "
            f"{type(faults).__name__}",
            field="faults",
        )
    check_distflow_faults(cfg, faults)
    return cfg, workload


XCCL_WARN_BYTES = 2 * 2**30
"""A replay on the ``xccl`` KV tier moving more than this warns: every chunk of every
transfer is a message on the modelled fabric, which costs wall time in proportion to the
bytes (about 7 s a GB on a 2-core machine; a 60K-token Qwen3-235B prompt takes 42 s)."""


def _warn_xccl_volume(cfg: PDConfig, workload: Workload) -> None:
    if cfg.kv_transfer != "xccl":
        return
    total = cfg.decode.kv_bytes_per_token * sum(r.input_tokens for r in workload.requests)
    if total > XCCL_WARN_BYTES:
        warnings.warn(
            f"kv_transfer = 'xccl' moves every KV byte as XCCL messages: {total / 1e9:,.1f} GB "
            f"here, about {7 * total / 1e9:,.0f} s of wall time; the closed-form tier "
            "(kv_transfer = 'closed-form') replays long traces in a fraction of it",
            stacklevel=3,
        )


def _set_up(
    workload: Workload,
    cfg: PDConfig,
    grid: Sequence[CommCosts],
    faults: Sequence[DistFlowFault | NodeFault | MemoryFault],
    progress: Progress | None,
    policies: dict[str, Any],
) -> Replay:
    """The replay of ``workload`` on ``cfg`` with ``faults`` injected, ready to run (inside a
    running runtime)."""
    r = Replay(workload, cfg, grid, progress=progress, **policies)
    for i, fault in enumerate(faults):
        try:
            if isinstance(fault, NodeFault):
                r.inject_node_fault(fault)
            elif isinstance(fault, MemoryFault):
                r.inject_memory_fault(fault)
            else:
                r._inject_distflow(fault)
        except ConfigError as exc:  # name the fault: faults[i].dp, say
            if exc.field not in type(fault).__struct_fields__:
                raise
            raise ConfigError(exc.message, field=f"faults[{i}].{exc.field}") from None
    return r


def check_replay(
    workload: Workload,
    config: PDConfig | None = None,
    *,
    faults: Sequence[DistFlowFault | NodeFault | MemoryFault] = (),
    **policies: Any,
) -> None:
    """Everything :func:`replay` checks before its first event (the deployment, the workload
    against it, every fault, the policies' signatures), without replaying: a sweep of many
    replays checks each design this way before running any. ``policies``: the policy keywords
    of :func:`replay`."""
    cfg, workload = _checked(config, workload, faults)
    grid = comm_grid(cfg.decode)  # measured on first use: nothing is measured here

    async def main() -> None:
        _set_up(workload, cfg, grid, faults, None, policies)

    Runtime(event_log=False).run(main)


def replay(
    workload: Workload,
    config: PDConfig | None = None,
    *,
    seed: int = 0,
    progress: Progress | None = None,
    backend: str = "asyncio",
    grid: Sequence[CommCosts] | None = None,
    prefill_placement: PrefillPlacement = least_work,
    decode_routing: DecodeRouting = lowest_kv,
    prefill_te_selection: PrefillTESelection = earliest_first_token,
    decode_te_selection: DecodeTESelection = fewest_sequences,
    faults: Sequence[DistFlowFault | NodeFault | MemoryFault] = (),
    event_log: bool = False,
    kv_mover: KVMover | None = None,
    time_limit_ns: int | None = None,
    serve_grace_ns: int | None = None,
) -> ReplayResult:
    """Replay ``workload`` on the deployment in virtual time; every request ends once.

    ``grid`` reuses the dispatch/combine measurements of an earlier replay of the same decode
    configuration (:func:`~xds.serve.decode_te.comm_grid`); the policy keywords plug in your
    own (see :class:`Replay`), ``kv_mover`` a KV-transfer protocol of your own
    (:data:`~xds.serve.distflow.KVMover`). ``faults`` (:class:`DistFlowFault`,
    :class:`~xds.serve.recovery.NodeFault`, :class:`~xds.serve.recovery.MemoryFault`) are
    injected before the run starts; with
    ``event_log`` the result keeps the run's event log (``ReplayResult.events``).

    A replay never hangs and never loses a request. It serves until ``serve_grace_ns`` after
    the last arrival or the end of the last scheduled fault, a link outage or a repair
    (default: one virtual day, :data:`REPLAY_GRACE_NS`); requests still in flight then fail
    with :data:`SERVING_LIMIT_FAILURE` (an overloaded deployment's queue, say) and the result
    keeps every record. A model with nothing left to do raises
    :class:`~xds.errors.ModelDeadlock`. A ``time_limit_ns`` given replaces the serving limit
    with a hard bound: the run stops there with :class:`~xds.errors.ModelTimeLimit`. Both
    errors name what each task waits for (e.g. a ``kv_mover`` that never returns)."""
    cfg, workload = _checked(config, workload, faults)
    if not any(isinstance(f, NodeFault | MemoryFault) for f in faults):  # (xccl refuses them)
        _warn_xccl_volume(cfg, workload)
    holder: dict[str, Replay] = {}
    if grid is None:  # dispatch/combine costs: collective-tier runs of their own
        grid = comm_grid(cfg.decode, seed=seed)
    policies = {
        "prefill_placement": prefill_placement,
        "decode_routing": decode_routing,
        "prefill_te_selection": prefill_te_selection,
        "decode_te_selection": decode_te_selection,
        "kv_mover": kv_mover,
    }

    async def main() -> list[RequestRecord]:
        holder["r"] = r = _set_up(workload, cfg, grid, faults, progress, policies)
        return await r.run()

    last = max((r.arrival_ns for r in workload.requests), default=0)
    for fault in faults:
        if isinstance(fault, NodeFault):
            last = max(last, fault.at_ns + fault.repair_ns)
        elif isinstance(fault, DistFlowFault):
            last = max(last, fault.at_ns + fault.duration_ns)
        else:
            last = max(last, fault.at_ns)
    grace = REPLAY_GRACE_NS if serve_grace_ns is None else serve_grace_ns
    # (never past the end of virtual time: the run could not reach it)
    serve_until_ns = effective_limit_ns(last + require_int(grace, "serve_grace_ns", low=0))
    runtime = Runtime(
        seed=seed,
        backend=backend,  # type: ignore[arg-type]
        event_log=event_log,
        time_limit_ns=serve_until_ns if time_limit_ns is None else time_limit_ns,
    )
    try:
        records = runtime.run(main)
    except ModelTimeLimit:
        if time_limit_ns is not None or "r" not in holder:
            raise  # the caller's own bound: the report names what each task waits for
        records = holder["r"].stop_serving(serve_until_ns)
    check_complete(records, len(workload))
    r = holder["r"]
    phase = _prefill_phase_ns(records)
    busy_ns = dict(r._retired_busy)
    for te in r.prefill:
        busy_ns[te.index] = busy_ns.get(te.index, 0) + te.busy_ns
    busy = [busy_ns.get(i, 0) / phase for i in range(cfg.prefill.tes)]
    load = DecodeLoad()
    for part in (r._retired_decode, *(d.load for d in r.decode)):
        load.add(part)
    summary = msgspec.structs.replace(
        summarize(records, chips=cfg.chips, sla=cfg.sla),
        prefill_busy=busy,
        decode=_decode_stats(load, records, cfg.decode_tes),
        config=msgspec.to_builtins(cfg),
    )
    return ReplayResult(
        records=records,
        summary=summary,
        chips=cfg.chips,
        prefill_steps=r._retired_steps + sum(te.steps for te in r.prefill),
        decode_iterations=load.iterations,
        end_ns=max((x.finish_ns for x in records), default=0),
        events=runtime.events if event_log else None,
        probes=r.monitor.results if r.monitor is not None else [],
        restarts=r.restarts,
        failovers=r.failovers,
        kv_masks=r.kv_masks,
        unfired_faults=r.unfired(faults),  # type: ignore[arg-type]
        decode_iterations_log=[r.iteration_logs[d].record() for d in sorted(r.iteration_logs)],
    )


document_fields(PDConfig, DistFlowFault, ReplayResult)
