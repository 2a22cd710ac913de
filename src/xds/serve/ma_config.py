"""MoE-attention disaggregated decode (SPEC 10.3, 12.3): the deployment and what its
communication costs.

Attention dies (``domains`` DP domains of ``attention_dies_per_domain`` TP=1 DP groups) hold the
KV cache and run MLA; expert dies (EP over ``expert_dies``: routed experts plus shared-expert
instances, one per die by default) run the MoE layers. They meet through A2E/E2A
(:mod:`xds.fabric.xccl.a2e`), with trampolines by default. Defaults are SPEC 12.3's peak run:
3 x 160 attention dies, 288 expert dies (256 routed + 32 shared), batch 96 per attention die in
two microbatches of 48 (A4), 1 MTP layer at 90 % acceptance, fixed 2K + 2K.

:func:`measure_ae` prices one A2E and one E2A of a domain at a given token count on the
collective tier of the full pod (one domain active, the others idle: SPEC 10.3's domain
exclusivity), the way :mod:`xds.serve.decode_model` prices dispatch/combine.
"""

from __future__ import annotations

from typing import Literal

import anyio
import msgspec
import numpy as np

from ..config import check_fields, require_instance, require_int
from ..docfields import document_fields
from ..errors import ConfigError
from ..fabric.xccl.a2e import AEConfig, AEGroup
from ..fabric.xccl.a2e import Mode as AEMode
from ..fabric.xccl.moe import ExpertMap, WireDtype
from ..hw import ASCEND_910C_DIE, CloudMatrix384
from ..model import (
    MODELS,
    KernelEfficiency,
    ModelSpec,
    Precision,
    check_attention,
    check_context,
)
from ..model.numerics import ScaleDtype
from ..runtime import now_ns, rng, run, sleep_until_ns
from ..units import MS, US
from .decode_model import check_shared_expert_dies, resolve_mtp
from .kv import WORKSPACE_FRACTION, kv_capacity_blocks
from .mtp import MTPConfig

DomainStart = Literal["staggered", "together"]
"""When the DP domains start decoding. ``staggered``: domain ``d`` starts ``d / domains`` of an
iteration (its attention-side work, estimated from the cost model) after domain 0, so the
domains interleave rather than run in lockstep (SPEC 10.3); the spacing hardly matters as long
as they are spread (16-48 ms offsets give 95-97 ms iterations on SPEC 12.3's deployment).
``together``: every domain starts at once, and the fixed rotation keeps them in near lockstep,
so every domain's scheduler gap, LM head and dense layers leave the expert dies idle at the
same time."""

DomainTurns = Literal["exclusive", "relaxed"]
"""How DP domains share the A2E/E2A path (SPEC 10.3, A27). ``exclusive``: the literal reading of
P110, at most one domain's A2E/E2A traffic in flight at any instant (a domain's turn ends when
its last E2A has delivered); ``relaxed``: the next domain's A2E may start while the previous
domain's E2A is still in flight."""


class MADecodeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A MoE-attention disaggregated decode deployment and its workload (defaults: SPEC 12.3)."""

    model: str = "deepseek-r1"
    domains: int = 3
    attention_dies_per_domain: int = 160
    expert_dies: int = 288
    shared_expert_dies: int = 32
    """Expert dies holding a shared-expert instance (each token visits one, weight 1)."""
    batch_per_die: int = 96
    microbatches: int = 2
    """Microbatches per attention die (A4: 96 per die in two microbatches of 48)."""
    input_tokens: int = 2048
    output_tokens: int = 2048
    mtp: MTPConfig | None = None
    """None: the model's own (see :class:`~xds.serve.decode_model.DecodeConfig`); what runs
    is :attr:`mtp_config`."""
    a2e_dtype: WireDtype = "int8"
    e2a_dtype: WireDtype = "int8"
    """P089: expert outputs are quantised before they cross dies too."""
    scale_dtype: ScaleDtype = "fp32"
    """How an INT8 row's per-token scale travels (fp32: 4 B; bf16, fp16: 2 B; SPEC 9.3)."""
    mode: AEMode = "trampoline"
    """A2E/E2A through trampolines (P045) or direct fan-out (P044's comparison)."""
    domain_turns: DomainTurns = "exclusive"
    domain_start: DomainStart = "staggered"
    poll_ns: int = 1 * US
    """Relax interval of the expert dies' persistent kernels: an idle kernel notices new work at
    its next poll. [emulator choice]"""
    queue_depth: int = 2
    """Bounded queues between the persistent kernels (A2E -> MoE -> E2A). [emulator choice]"""
    scheduler_gap_ns: int = 2 * MS
    """Scheduler time per iteration on every attention die (P124: 2 ms)."""
    precision: Precision = Precision()
    efficiency: KernelEfficiency = KernelEfficiency()
    block_tokens: int = 128

    def __post_init__(self) -> None:
        check_fields(self)
        positive = (
            "domains",
            "attention_dies_per_domain",
            "expert_dies",
            "batch_per_die",
            "microbatches",
            "input_tokens",
            "output_tokens",
            "queue_depth",
            "block_tokens",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)!r}", field=name)
        for name in ("poll_ns", "scheduler_gap_ns"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)!r}", field=name)
        if self.output_tokens < 2:
            raise ConfigError(
                f"must be >= 2 (prefill makes the first token; decode runs the rest), got "
                f"{self.output_tokens}",
                field="output_tokens",
            )
        if self.model not in MODELS:
            raise ConfigError(
                f"unknown model {self.model!r}; known: {', '.join(MODELS)}", field="model"
            )
        m = self.spec
        check_attention(m)
        check_context(m, self.input_tokens, self.output_tokens)
        self.precision.check_layers(m)
        if self.microbatches > self.batch_per_die:
            raise ConfigError(
                f"{self.microbatches} microbatches of a batch of {self.batch_per_die}: each "
                "needs at least one sequence",
                field="microbatches",
            )
        if not 0 <= self.shared_expert_dies < self.expert_dies:
            raise ConfigError(
                f"must be >= 0 and below expert_dies ({self.expert_dies}), got "
                f"{self.shared_expert_dies}",
                field="shared_expert_dies",
            )
        check_shared_expert_dies(m, self.shared_expert_dies)
        if self.expert_dies - self.shared_expert_dies > m.routed_experts:
            raise ConfigError(
                f"{self.expert_dies - self.shared_expert_dies} routed-expert dies, but "
                f"{m.name} has {m.routed_experts} routed experts: every die needs one",
                field="expert_dies",
            )
        routed_dies = self.expert_dies - self.shared_expert_dies
        per_die = max(-(-m.routed_experts // routed_dies), m.shared_experts)
        weights = self.precision.expert_bytes(m, per_die, mtp=self.drafts)
        room = (1 - WORKSPACE_FRACTION) * ASCEND_910C_DIE.hbm_bytes
        if weights > room:
            raise ConfigError(
                f"{routed_dies} routed-expert dies hold {per_die} of {m.name}'s "
                f"{m.routed_experts} routed experts each: {weights / 2**30:.1f} GiB of weights, "
                f"more than the {room / 2**30:.1f} GiB a {ASCEND_910C_DIE.hbm_bytes / 2**30:.0f}"
                f" GiB die leaves beside its workspace: use more expert dies",
                field="expert_dies",
            )
        resolve_mtp(self.mtp, m)  # checks it
        dies = self.attention_dies + self.expert_dies
        pod_dies = CloudMatrix384().n_pod_dies
        if dies > pod_dies:
            raise ConfigError(
                f"{self.domains} domains x {self.attention_dies_per_domain} attention dies + "
                f"{self.expert_dies} expert dies = {dies}, more than the pod's {pod_dies}",
                field="expert_dies"
                if self.attention_dies < pod_dies // 2
                else "domains"  # of the two, the one grown past its default
                if self.domains > _DEFAULT_DOMAINS
                and self.attention_dies_per_domain <= _DEFAULT_ATTENTION_DIES
                else "attention_dies_per_domain",
            )
        if self.mode == "trampoline" and self.attention_dies_per_domain > self.expert_dies:
            raise ConfigError(
                f"{self.attention_dies_per_domain} attention dies per domain need as many "
                f"trampolines, but there are {self.expert_dies} expert dies",
                field="attention_dies_per_domain",
            )
        need = -(-(self.input_tokens + self.output_tokens) // self.block_tokens)
        have = self.kv_blocks_per_die
        if self.batch_per_die * need > have:
            raise ConfigError(
                f"{self.batch_per_die} sequences of {self.input_tokens} + "
                f"{self.output_tokens} tokens need {self.batch_per_die * need} KV blocks per "
                f"attention die; it has room for {have}",
                field="batch_per_die",
            )

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def mtp_config(self) -> MTPConfig:
        """The MTP that runs: :attr:`mtp`, or the model's own."""
        return resolve_mtp(self.mtp, self.spec)

    @property
    def drafts(self) -> bool:
        """Whether the deployment drafts (MTP k > 0): it then keeps, and a PD transfer
        moves, the MTP layer's KV too."""
        return self.mtp_config.k > 0

    @property
    def attention_dies(self) -> int:
        return self.domains * self.attention_dies_per_domain

    @property
    def chips(self) -> float:
        """Chips the deployment occupies (two dies each), expert dies included (A28)."""
        return (self.attention_dies + self.expert_dies) / 2

    @property
    def microbatch_seqs(self) -> list[int]:
        """Sequences per microbatch of a full attention die."""
        return [len(a) for a in np.array_split(np.arange(self.batch_per_die), self.microbatches)]

    @property
    def kv_blocks_per_die(self) -> int:
        """KV blocks of an attention die: HBM after attention and dense weights (replicated per
        DP group, at the precision: INT8 by default), the embedding and LM head (BF16) and,
        when drafting, the MTP layer's attention; no expert weights."""
        m = self.spec
        # attention, dense MLP, embeddings (and the MTP layer's attention when drafting)
        weights = self.precision.weight_bytes(m, mtp=self.drafts)
        return kv_capacity_blocks(
            m,
            ASCEND_910C_DIE,
            weight_bytes=weights,
            block_tokens=self.block_tokens,
            int8_nope=self.precision.kv_int8_nope,
            mtp=self.drafts,
        )


class AECosts(msgspec.Struct, frozen=True):
    """A2E and E2A of one domain at ``tokens_per_die`` tokens per attention die (collective
    tier, common start, the other domains idle)."""

    tokens_per_die: int
    a2e_ns: int
    e2a_ns: int
    attention_meta_writes: int
    """Metadata writes an attention die issues per A2E (1 with trampolines, P045)."""


def ae_layout(config: MADecodeConfig) -> tuple[object, ...]:
    """What an A2E/E2A measurement depends on: the model, the pools and the wire formats."""
    return (
        config.model,
        config.attention_dies_per_domain,
        config.expert_dies,
        config.shared_expert_dies,
        config.a2e_dtype,
        config.e2a_dtype,
        config.scale_dtype,
        config.mode,
    )


def measure_ae(
    config: MADecodeConfig,
    tokens_per_die: int,
    *,
    seed: int = 0,
    tier: str = "collective",
    mode: AEMode | None = None,
) -> AECosts:
    """One A2E then one E2A of domain 0 on a full pod: A2E from the domain's common start to
    the last expert die holding its rows, E2A from the experts' common start to the last
    attention die holding its result. Routing is uniform over the routed experts (top-k
    distinct) plus one shared-expert instance per token."""
    from ..fabric import UBFabric

    require_instance(config, MADecodeConfig, "config")
    tokens_per_die = require_int(tokens_per_die, "tokens_per_die", low=1)
    m = config.spec
    n_att = config.attention_dies
    experts = list(range(n_att, n_att + config.expert_dies))
    domain = list(range(config.attention_dies_per_domain))
    emap = ExpertMap(m.routed_experts + config.shared_expert_dies, config.expert_dies)

    async def main() -> AECosts:
        fabric = UBFabric(CloudMatrix384(), payload_mode="size")
        group = AEGroup(
            fabric,
            domain,
            experts,
            emap,
            AEConfig(
                hidden=m.hidden,
                top_k=m.top_k,
                n_shared=config.shared_expert_dies,
                a2e_dtype=config.a2e_dtype,
                e2a_dtype=config.e2a_dtype,
                scale_dtype=config.scale_dtype,
                mode=mode or config.mode,
            ),
            tier=tier,
        )
        pick = rng("reproduce/a2e-e2a/routing")  # the historical name: same draws as before
        routes = [
            np.stack(
                [
                    pick.choice(m.routed_experts, m.top_k, replace=False)
                    for _ in range(tokens_per_die)
                ]
            )
            if tokens_per_die
            else np.zeros((0, m.top_k), np.int64)
            for _ in domain
        ]
        t_a2e = 1 * MS
        t_e2a = t_a2e + 20 * MS
        ends = {"a2e": 0, "e2a": 0}

        async def attention(i: int) -> None:
            await sleep_until_ns(t_a2e)
            h = await group.a2e(i, tokens_per_die, routes[i], event_id=1)
            await group.e2a(h, None, event_id=2)
            ends["e2a"] = max(ends["e2a"], now_ns())

        async def expert(j: int) -> None:
            inp = await group.expert_receive(j, event_id=1)
            ends["a2e"] = max(ends["a2e"], now_ns())
            await sleep_until_ns(t_e2a)
            await group.expert_return(j, inp, None, event_id=2)

        async with anyio.create_task_group() as tg:
            for i in range(len(domain)):
                tg.start_soon(attention, i)
            for j in range(config.expert_dies):
                tg.start_soon(expert, j)
        meta = group.push.meta_writes
        writes = max(meta.get(("hop1", d), 0) + meta.get(("direct", d), 0) for d in domain)
        return AECosts(tokens_per_die, ends["a2e"] - t_a2e, ends["e2a"] - t_e2a, writes)

    return run(main, seed=seed, event_log=False)


document_fields(MADecodeConfig, AECosts)


_DEFAULT_DOMAINS = MADecodeConfig().domains
_DEFAULT_ATTENTION_DIES = MADecodeConfig().attention_dies_per_domain
