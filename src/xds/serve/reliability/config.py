"""What a fault-tolerant decode group is made of, and the faults a test can inject (SPEC 11).

A :class:`ReliabilityConfig` describes a colocated decode group small enough to run layer by
layer: ``dps`` DP groups (one die each, TP = 1) that meet at every MoE layer's dispatch and
combine barrier, plus the reliability machinery of SPEC 11.3 with its knobs: the two heartbeat
periods and the timeout (:class:`HeartbeatConfig`), the rollback broadcast and its error codes
(:class:`RollbackConfig`), and a list of faults to inject. Each fault names the DP and the
iteration (and for network errors the layer) where it strikes, so a run is exactly repeatable.

The paper gives no values for the heartbeat periods or timeouts (A31) nor for the rollback
codes; every default here is an [emulator choice] and says so.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ...config import check_fields, convert, split_spec
from ...docfields import document_fields
from ...errors import ConfigError
from ...units import MS, US

Unhealthy = Literal["restart", "scale_down", "report"]
"""What the control plane does when the TE-shell reports unhealthy DPs. ``restart``:
restart-the-world (SPEC 11.2 stage 1): the engine stops and every request still in flight
fails with the reason. ``scale_down``: decode vertical scale-down (stage 2, P119): the DPs
whose executors stopped outside a global barrier (hung, crashed, or busy past the timeout) are
removed with their EP ranks, their requests fail, the rest redo the interrupted iteration on
fewer dies; if that would leave an expert without a replica, restart-the-world instead.
``report``: record the verdicts and carry on (to study false positives)."""


class LayerTimes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-layer kernel times of one DP die (ns). Defaults: one MoE layer of SPEC 12.2's peak
    run (DeepSeek-R1, batch 60 per die with one MTP token, 3K context) as
    :func:`xds.serve.reliability.layer_times` prices it from the cost model; call it for any
    other decode config."""

    attention_ns: Annotated[int, Meta(ge=0)] = 619_245
    """MLA prolog, attention, output projection and gating of one layer."""
    dispatch_ns: Annotated[int, Meta(ge=0)] = 211_808
    """Dispatch once every DP has arrived (the barrier-free cost)."""
    expert_ns: Annotated[int, Meta(ge=0)] = 168_518
    """The busiest expert die's GEMMs."""
    combine_ns: Annotated[int, Meta(ge=0)] = 406_298
    head_ns: Annotated[int, Meta(ge=0)] = 1_447_801
    """LM head and sampling, once per iteration."""

    def __post_init__(self) -> None:
        check_fields(self)

    def iteration_ns(self, layers: int) -> int:
        """A fault-free iteration without jitter: ``layers`` MoE layers plus the head."""
        per = self.attention_ns + self.dispatch_ns + self.expert_ns + self.combine_ns
        return layers * per + self.head_ns


class HeartbeatConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The two-level heartbeat of SPEC 11.1 (P115): control plane -> TE-shell -> DP masters.
    The two periods are set independently (SPEC 11.3); values are [emulator choice] (A31)."""

    enabled: bool = True
    control_period_ns: Annotated[int, Meta(gt=0)] = 1_000 * MS
    """Control plane -> TE-shell."""
    dp_period_ns: Annotated[int, Meta(gt=0)] = 500 * MS
    """TE-shell -> each DP master."""
    timeout_ns: Annotated[int, Meta(gt=0)] = 2_000 * MS
    """A ping unanswered this long marks the DP unhealthy. An iteration longer than this is a
    false positive (SPEC 11.3: the reply sits on the progress path)."""
    on_unhealthy: Unhealthy = "restart"

    def __post_init__(self) -> None:
        check_fields(self)


class RollbackConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token recomputation after transient network errors (SPEC 11.2 stage 3, P120)."""

    enabled: bool = True
    codes: tuple[str, ...] = ("LINK_FLAP", "ROUTE_CONVERGENCE")
    """Error codes that trigger a rollback (switch flaps, BGP convergence); any other code
    escalates to component failover at once. [emulator choice]"""
    broadcast_ns: Annotated[int, Meta(ge=0)] = 20 * US
    """The dedicated thread's broadcast latency: from the error to the flag every poll loop
    reads. [emulator choice]"""
    max_retries: Annotated[int, Meta(ge=0)] = 2
    """Rollbacks of the same iteration beyond this escalate to component failover."""

    def __post_init__(self) -> None:
        check_fields(self)


class _Fault(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"
):
    """Where a fault strikes: DP ``dp``, in decode iteration ``iteration`` (0-based)."""

    dp: Annotated[int, Meta(ge=0)]
    iteration: Annotated[int, Meta(ge=0)]

    def __post_init__(self) -> None:
        check_fields(self)


class ExecutorHang(_Fault, tag="executor_hang"):
    """DP ``dp``'s executor blocks forever at the start of ``iteration``, before replying to
    its master (a partial hang: the process lives, the loop does not move)."""


class ExecutorCrash(_Fault, tag="executor_crash"):
    """DP ``dp``'s executor dies at the start of ``iteration`` (fail-stop): its master stops."""


class SlowIteration(_Fault, tag="slow_iteration"):
    """DP ``dp`` spends ``extra_ns`` more before its first dispatch in ``iteration``: a
    healthy but long operation (and every other DP waits for it at the barrier)."""

    extra_ns: Annotated[int, Meta(ge=0)]


class NetworkError(_Fault, tag="network_error"):
    """DP ``dp``'s collective at ``layer`` of ``iteration`` fails with error ``code``, on the
    first ``attempts`` tries of that iteration (each redo of the iteration is a new try)."""

    layer: Annotated[int, Meta(ge=0)] = 0
    code: str = "LINK_FLAP"
    attempts: Annotated[int, Meta(ge=1)] = 1


class MemoryFault(_Fault, tag="memory_fault"):
    """An on-chip memory fault on DP ``dp``'s die, found before ``iteration``: KV blocks
    ``first_block .. first_block + blocks - 1`` are bad (SPEC 11.2 stage 3)."""

    first_block: Annotated[int, Meta(ge=0)]
    blocks: Annotated[int, Meta(ge=1)] = 1


Fault = ExecutorHang | ExecutorCrash | SlowIteration | NetworkError | MemoryFault


class ReliabilityConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A decode group with SPEC 11's detection and recovery, and the faults to inject."""

    dps: Annotated[int, Meta(ge=1)] = 8
    batch_per_dp: Annotated[int, Meta(ge=1)] = 4
    layers: Annotated[int, Meta(ge=1)] = 4
    """MoE layers per iteration (each a dispatch and a combine barrier)."""
    prompt_tokens: Annotated[int, Meta(ge=1)] = 8
    output_tokens: Annotated[int, Meta(ge=2)] = 16
    """Tokens per request, the prefill's first one included (>= 2: at least one decode
    iteration)."""
    times: LayerTimes = LayerTimes()
    poll_ns: Annotated[int, Meta(gt=0)] = 5 * US
    """Busy-poll interval of every barrier (dispatch, combine, commit)."""
    host_jitter_mean_ns: Annotated[int, Meta(ge=0)] = 20 * US
    """Mean of the exponential host delay each DP adds before its first dispatch in every
    attempt (the residual jitter with core pinning, as :class:`xds.serve.jitter.JitterConfig`;
    0: DPs in exact lockstep)."""
    scheduler_gap_ns: Annotated[int, Meta(ge=0)] = 2 * MS
    block_tokens: Annotated[int, Meta(ge=1)] = 4
    kv_blocks_per_dp: Annotated[int, Meta(ge=1)] = 64
    stall_limit_ns: Annotated[int, Meta(gt=0)] = 60_000 * MS
    """Watchdog [emulator choice]: no iteration committed for this long stops the engine,
    naming the DPs stopped outside a global barrier, so a run always ends (e.g. a hang with
    heartbeats off or ``on_unhealthy = "report"``)."""
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    rollback: RollbackConfig = RollbackConfig()
    faults: tuple[Fault, ...] = ()
    experts: Annotated[int, Meta(ge=0)] = 0
    """Logical experts placed over the DP dies (0: one per DP)."""
    slots_per_die: Annotated[int, Meta(ge=1)] = 2
    """Expert slots per die, filled round-robin (:mod:`.experts`); more slots than experts
    overall are redundant replicas, which scale-down relies on."""
    vocab: Annotated[int, Meta(ge=2)] = 64
    """Vocabulary of the tiny content model that makes tokens (content mode, greedy)."""

    def __post_init__(self) -> None:
        if not isinstance(self.faults, (tuple, list)):
            raise ConfigError(
                f"expected a tuple of faults, got {type(self.faults).__name__}", field="faults"
            )
        for i, f in enumerate(self.faults):  # before the type check: it would say "object"
            if not isinstance(f, Fault):
                raise ConfigError(
                    "expected a fault of xds.serve.reliability (ExecutorHang, ExecutorCrash, "
                    f"SlowIteration, NetworkError or MemoryFault), got "
                    f"{type(f).__module__}.{type(f).__qualname__}",
                    field=f"faults[{i}]",
                )
        if isinstance(self.faults, list):  # frozen: keep no mutable list inside
            msgspec.structs.force_setattr(self, "faults", tuple(self.faults))
        check_fields(self)
        iterations = self.output_tokens - 1  # the first token comes from prefill
        for i, f in enumerate(self.faults):
            where = f"faults[{i}].dp"
            if f.dp >= self.dps:
                raise ConfigError(f"DP {f.dp} does not exist ({self.dps} DPs)", field=where)
            if f.iteration >= iterations:
                raise ConfigError(
                    f"iteration {f.iteration} never runs: output_tokens = {self.output_tokens} "
                    f"decodes in iterations 0..{iterations - 1} (prefill makes the first token)",
                    field=f"faults[{i}].iteration",
                )
            if isinstance(f, NetworkError) and f.layer >= self.layers:
                raise ConfigError(
                    f"layer {f.layer} does not exist ({self.layers} layers)",
                    field=f"faults[{i}].layer",
                )
            if isinstance(f, MemoryFault) and f.first_block + f.blocks > self.kv_blocks_per_dp:
                raise ConfigError(
                    f"blocks {f.first_block}..{f.first_block + f.blocks - 1} lie outside the "
                    f"DP's {self.kv_blocks_per_dp} KV blocks",
                    field=f"faults[{i}]."
                    + ("first_block" if f.first_block >= self.kv_blocks_per_dp else "blocks"),
                )
        stops: dict[tuple[int, int], int] = {}  # (dp, iteration) -> the fault stopping it
        for i, f in enumerate(self.faults):
            if isinstance(f, (ExecutorHang, ExecutorCrash)):
                j = stops.setdefault((f.dp, f.iteration), i)
                if j != i:
                    raise ConfigError(
                        f"faults[{j}] already stops DP {f.dp}'s executor at iteration "
                        f"{f.iteration}: this one would never strike",
                        field=f"faults[{i}]",
                    )
        if self.dps * self.slots_per_die < self.n_experts:
            raise ConfigError(
                f"{self.dps} dies x {self.slots_per_die} slots cannot hold {self.n_experts} "
                "experts",
                field="slots_per_die",
            )
        need = -(-(self.prompt_tokens + self.output_tokens) // self.block_tokens)
        if need * self.batch_per_dp > self.kv_blocks_per_dp:
            raise ConfigError(
                f"{self.batch_per_dp} sequences of {self.prompt_tokens + self.output_tokens} "
                f"tokens need {need * self.batch_per_dp} KV blocks, a DP has "
                f"{self.kv_blocks_per_dp}",
                field="kv_blocks_per_dp",
            )

    @property
    def n_experts(self) -> int:
        return self.experts or self.dps


for _kind in (LayerTimes, HeartbeatConfig, RollbackConfig, ReliabilityConfig):
    document_fields(_kind)


_FAULT_KINDS = {
    "executor_hang": ExecutorHang,
    "executor_crash": ExecutorCrash,
    "slow_iteration": SlowIteration,
    "network_error": NetworkError,
    "memory_fault": MemoryFault,
}


def _is_int(kind: object) -> bool:
    """Whether a field type takes an ``int`` and no ``str`` (``Annotated`` and unions such
    as ``int | None`` included)."""
    if typing.get_origin(kind) is typing.Annotated:
        return _is_int(typing.get_args(kind)[0])
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        members = typing.get_args(kind)
        return any(_is_int(m) for m in members) and str not in members
    return kind is int


def parse_fault(spec: str) -> Fault:
    """A fault from its short form ``KIND:KEY=VALUE,...``, e.g.
    ``network_error:dp=2,iteration=4,layer=1`` (the command line's ``--fault``)."""
    kind, raw = split_spec(spec, _FAULT_KINDS)
    cls = _FAULT_KINDS[kind]
    known = msgspec.structs.fields(cls)
    names = [f.name for f in known]
    for key in raw:
        if key not in names:
            raise ConfigError(f"{spec!r}: {key!r} is not one of {', '.join(names)}", field="fault")
    if missing := [f.name for f in known if f.required and f.name not in raw]:
        raise ConfigError(f"{spec!r}: needs {', '.join(missing)}", field="fault")
    fields: dict[str, object] = {}
    kinds = {f.name: f.type for f in known}
    for key, value in raw.items():
        whole = re.fullmatch(r"[+-]?[0-9]+", value) is not None
        if not _is_int(kinds[key]):
            fields[key] = value  # e.g. an error code: any word, digits included
        elif whole:
            fields[key] = int(value)
        else:
            raise ConfigError(
                f"{spec!r}: {key} must be a whole number, got {value!r}", field="fault"
            )
    try:
        return convert(fields, cls)
    except ConfigError as exc:
        raise ConfigError(f"{spec!r}: {exc}", field="fault") from None
