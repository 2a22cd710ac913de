"""The cost of a colocated decode pass on FlowServe (SPEC 6, 8, 9, 12.2): the deployment's
configuration, per-kernel times of one iteration on every die, dispatch/combine costs measured
on the collective tier, the per-kernel breakdown, and the KV room a die has after its weights.

:class:`DecodeModel` prices one iteration for all dies at once (the iteration tier): the MTP
pass, then the main pass verifying ``1 + k`` tokens per sequence. Within a pass every die runs
its dense layers and the first MoE layer's attention alone; the first dispatch is the first
all-die barrier and absorbs the host jitter of every DP (SPEC 6.5); from there the dies move in
lockstep: per MoE layer, dispatch, the slowest expert, combine, then the next layer's attention
(the slowest DP). :mod:`xds.serve.decode` runs requests through it.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Annotated

import anyio
import msgspec
import numpy as np
from msgspec import Meta

from ..config import check_fields, require_instance, require_int
from ..docfields import document_fields
from ..errors import ConfigError
from ..fabric.xccl.moe import ExpertMap, PullOrder, WireDtype
from ..hw import ASCEND_910C_DIE, CloudMatrix384, DieSpec
from ..model import (
    MODELS,
    CostModel,
    KernelEfficiency,
    ModelSpec,
    Precision,
    check_attention,
    check_context,
)
from ..model.numerics import ScaleDtype
from ..runtime import now_ns, rng, sleep_until_ns
from ..units import MS
from .eplb.online import OnlineEPLB, OnlineEPLBConfig
from .jitter import JitterConfig
from .kv import WORKSPACE_FRACTION, kv_capacity_blocks
from .mtp import MTPConfig

MAX_BATCH_PER_DIE = 2048
"""Decode sequences one die may hold at once: far above what a die's HBM holds at useful
context lengths (the KV checks then bind), and it bounds the dispatch/combine measurements."""


MODEL_MTP = MTPConfig(k=1, acceptance=(0.9,))
"""The MTP of a model with an MTP layer, unless a deployment sets its own (SPEC 12.2)."""
NO_MTP = MTPConfig(k=0)
"""The MTP of a model without one: no drafts."""


def check_shared_expert_dies(model: ModelSpec, shared_expert_dies: int) -> None:
    """Shared-expert dies only for a model that has a shared expert."""
    if shared_expert_dies and not model.shared_experts:
        raise ConfigError(
            f"{model.name} has no shared expert: set shared_expert_dies = 0 (got "
            f"{shared_expert_dies})",
            field="shared_expert_dies",
        )


def resolve_mtp(mtp: MTPConfig | None, model: ModelSpec, field: str = "mtp.k") -> MTPConfig:
    """A deployment's MTP: ``mtp`` as given (drafts need the model to have an MTP layer), or,
    for None, the model's own: one draft at 0.9 acceptance with an MTP layer, none without."""
    if mtp is None:
        return MODEL_MTP if model.mtp_layers else NO_MTP
    if mtp.k and not model.mtp_layers:
        raise ConfigError(
            f"{model.name} has no MTP layer, so it cannot draft {mtp.k} token(s) a step: set "
            "k = 0, or leave mtp out (the model's own: none)",
            field=field,
        )
    return mtp


class DecodeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A colocated decode deployment and its workload (defaults: SPEC 12.2's peak run)."""

    model: str = "deepseek-r1"
    dies: int = 288
    batch_per_die: int = 60
    input_tokens: int = 2048
    output_tokens: int = 2048
    mtp: MTPConfig | None = None
    """None: the model's own, one draft token at 0.9 acceptance (SPEC 12.2) if it has an MTP
    layer (DeepSeek-V3/R1), none if it has not (Kimi K2); a draft needs an MTP layer. What
    runs is :attr:`mtp_config`."""
    shared_expert_dies: int = 32
    """Dies holding an instance of the model's shared expert (the last ones; SPEC 12.2: 32 of
    288). Each token visits one instance, so it is dispatched, computed and combined there. 0
    leaves the shared expert out of the deployment: its tokens go nowhere and its GEMMs are
    not priced (about a tenth of the expert time of a small deployment), so keep it above 0
    for a model that has one unless that is the question."""
    dispatch_dtype: WireDtype = "int8"
    combine_dtype: WireDtype = "bf16"
    scale_dtype: ScaleDtype = "fp32"
    """How an INT8 row's per-token scale travels (fp32: 4 B; bf16, fp16: 2 B; SPEC 9.3)."""
    pull_order: PullOrder = "static"
    """Dispatch/combine pull order over the AIVs (:data:`xds.fabric.xccl.moe.PullOrder`)."""
    scheduler_gap_ns: int = 2 * MS
    jitter: JitterConfig = JitterConfig(enabled=True)
    precision: Precision = Precision()
    efficiency: KernelEfficiency = KernelEfficiency()
    block_tokens: int = 128
    kv_blocks_per_die: int = 0
    """0: derived from HBM left after the weights held by a die."""
    reserve_output_tokens: int = 0
    """PD replay: the output KV reserved for each request. 0 (the default, [emulator
    choice]): its own output length, read from the trace (an oracle the real system does not
    have; admission never overcommits, so KV never runs out mid-decode). N: SPEC 6.3's
    ``ESTIMATE_OUTPUT_KV(max_output_tokens)`` with a ``max_output_tokens`` of N (DeepSeek-R1
    serves up to 32K, SPEC 12.4): the TE-shell routes with N tokens' blocks and the DP master
    reserves the prompt plus N, so fewer sequences fit a die; a request whose output is longer
    than N fails at arrival (the cap would have cut it)."""
    eplb: OnlineEPLBConfig | None = None
    """Skewed, drifting routing with online expert balancing (None: uniform routing)."""

    def __post_init__(self) -> None:
        check_fields(self)
        checks = [
            ("dies", self.dies >= 1, "must be >= 1"),
            (
                "batch_per_die",
                1 <= self.batch_per_die <= MAX_BATCH_PER_DIE,
                f"must be in 1..{MAX_BATCH_PER_DIE}",
            ),
            ("input_tokens", self.input_tokens >= 1, "must be >= 1"),
            (
                "output_tokens",
                self.output_tokens >= 2,
                "must be >= 2 (prefill makes the first token; decode runs the rest)",
            ),
            (
                "shared_expert_dies",
                0 <= self.shared_expert_dies < self.dies,
                f"must be >= 0 and below dies ({self.dies})",
            ),
            ("scheduler_gap_ns", self.scheduler_gap_ns >= 0, "must be >= 0"),
            ("block_tokens", self.block_tokens >= 1, "must be >= 1"),
            ("kv_blocks_per_die", self.kv_blocks_per_die >= 0, "must be >= 0"),
            ("reserve_output_tokens", self.reserve_output_tokens >= 0, "must be >= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{rule}, got {getattr(self, name)!r}", field=name)
        if self.model not in MODELS:
            raise ConfigError(
                f"unknown model {self.model!r}; known: {', '.join(MODELS)}", field="model"
            )
        m = MODELS[self.model]
        check_attention(m)
        check_context(m, self.input_tokens, self.output_tokens)
        self.precision.check_layers(m)
        check_shared_expert_dies(m, self.shared_expert_dies)
        resolve_mtp(self.mtp, m)  # checks it
        if self.dies > m.routed_experts + self.shared_expert_dies:
            raise ConfigError(
                f"{self.dies} dies, but {m.name} has {m.routed_experts} routed experts and "
                f"{self.shared_expert_dies} shared-expert dies to place, at least one per die: "
                f"use at most {m.routed_experts + self.shared_expert_dies} dies",
                field="dies",
            )
        if self.eplb is not None and m.routed_experts > self.dies - self.shared_expert_dies:
            raise ConfigError(
                f"online EPLB places one routed expert per die, but {m.routed_experts} routed "
                f"experts do not fit on {self.dies - self.shared_expert_dies} dies (dies - "
                f"shared_expert_dies): use at least {m.routed_experts + self.shared_expert_dies} "
                "dies, or no [eplb]",
                field="eplb",
            )
        hbm = ASCEND_910C_DIE.hbm_bytes
        if self.kv_blocks_per_die == 0:
            weights = decode_weight_bytes(self)
            if weights >= (1 - WORKSPACE_FRACTION) * hbm:
                routed_dies = self.dies - self.shared_expert_dies
                if self.eplb is not None and self.eplb.spare_slots > 1:
                    raise ConfigError(
                        f"{self.eplb.spare_slots} redundant expert slots per die and MoE layer "
                        f"hold {weights / 2**30:.1f} GiB of weights per die, no room for KV on "
                        f"a {hbm / 2**30:.0f} GiB die: fewer spare slots",
                        field="eplb.spare_slots",
                    )
                raise ConfigError(
                    f"with {self.dies} dies ({routed_dies} for {m.routed_experts} routed experts "
                    f"after shared_expert_dies = {self.shared_expert_dies}) each holds "
                    f"{weights / 2**30:.1f} GiB of weights, no room for KV on a "
                    f"{hbm / 2**30:.0f} GiB die: use more dies, or fewer shared-expert dies",
                    field="dies",
                )
        else:  # an override (a group after a scale-down, a what-if), but never beyond HBM
            block = self.kv_bytes_per_token * self.block_tokens
            if self.kv_blocks_per_die * block > hbm:
                raise ConfigError(
                    f"{self.kv_blocks_per_die} blocks of {self.block_tokens} tokens are "
                    f"{self.kv_blocks_per_die * block / 2**30:.1f} GiB of KV, more than a die's "
                    f"{hbm / 2**30:.0f} GiB of HBM (0 derives what the weights leave)",
                    field="kv_blocks_per_die",
                )

    @property
    def mtp_config(self) -> MTPConfig:
        """The MTP that runs: :attr:`mtp`, or the model's own."""
        return resolve_mtp(self.mtp, MODELS[self.model])

    @property
    def drafts(self) -> bool:
        """Whether the deployment drafts (MTP k > 0): it then keeps, and a PD transfer
        moves, the MTP layer's KV too."""
        return self.mtp_config.k > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token on a decode die, as the cache holds it (its
        precision; the MTP layer's too when the deployment drafts): what a PD transfer
        moves per prompt token."""
        return self.spec.kv_bytes_per_token(int8_nope=self.precision.kv_int8_nope, mtp=self.drafts)

    @property
    def spec(self):
        if self.model not in MODELS:
            raise ConfigError(
                f"unknown model {self.model!r}; known: {', '.join(MODELS)}", field="model"
            )
        return MODELS[self.model]


class CommCosts(msgspec.Struct, frozen=True):
    """Dispatch/combine latency of one MoE layer at a given tokens-per-die (collective tier,
    measured once from a common start: the barrier-free cost of the exchange)."""

    tokens_per_die: Annotated[int, Meta(ge=1)]
    dispatch_ns: Annotated[int, Meta(ge=0)]
    combine_ns: Annotated[int, Meta(ge=0)]
    dies: Annotated[int, Meta(ge=0)] = 0
    """The EP group's dies it was measured on (:func:`measure_comm` sets it; 0: not said, as
    for costs written by hand). A decode instance of another size refuses it."""

    def __post_init__(self) -> None:
        check_fields(self)


class Breakdown(msgspec.Struct):
    """Per-kernel time of iterations (ns, summed), Figure 20 style."""

    attention: int = 0
    mla_other: int = 0
    """The attention side's projections and norms: MLA's prolog and output kernels (Figure
    20's name); for a GQA model its q/k/v and o projections and norms."""
    gating: int = 0
    dispatch: int = 0
    experts: int = 0
    combine: int = 0
    dense_mlp: int = 0
    lm_head: int = 0
    sampling: int = 0
    launch: int = 0
    jitter_wait: int = 0

    def add(self, other: Breakdown) -> None:
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def total(self) -> int:
        return sum(getattr(self, n) for n in self.__struct_fields__)


class IterationOutcome(msgspec.Struct):
    time_ns: int
    breakdown: Breakdown
    first_dispatch_ns: np.ndarray  # per die: its first dispatch kernel's duration


class DPShapes:
    """The DP groups of one iteration by shape, ``seqs << 32 | context``: kernel times are a
    function of it, and a few shapes cover the dies (most are alike, or empty at low load)."""

    __slots__ = ("_held", "_of_die", "distinct", "total", "widest")

    def __init__(
        self,
        distinct: list[int],
        of_die: np.ndarray | tuple[int, list[int], list[int]],
        widest: float,
        total: int,
    ):
        self.distinct = distinct
        """The distinct shapes, in the order of the first die holding each."""
        self._of_die = of_die if isinstance(of_die, np.ndarray) else None
        self._held = of_die if isinstance(of_die, tuple) else None
        """(dies, held, shapes) of :meth:`sparse`, until :attr:`of_die` is asked for."""
        self.widest = widest
        """The largest DP batch (sequences)."""
        self.total = total
        """Sequences over all dies."""

    @property
    def of_die(self) -> np.ndarray:
        """Each die's shape: an index into :attr:`distinct` (made on first use)."""
        if self._of_die is None:
            assert self._held is not None
            dies, held, shapes = self._held
            rank = {shape: i for i, shape in enumerate(self.distinct)}
            self._of_die = np.full(dies, rank.get(0, 0), dtype=np.int64)
            self._of_die[held] = [rank[shape] for shape in shapes]
        return self._of_die

    @classmethod
    def of(cls, seqs: np.ndarray, context: np.ndarray) -> DPShapes:
        """The shapes of DP groups holding ``seqs`` sequences at ``context`` each (per die)."""
        shapes = seqs.astype(np.int64, copy=False) << 32 | context.astype(np.int64, copy=False)
        distinct, first, inverse = np.unique(shapes, return_index=True, return_inverse=True)
        order = np.argsort(first)  # by first die (no ties: each die holds one shape)
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return cls(
            distinct[order].tolist(), rank[inverse.reshape(-1)], float(seqs.max()), int(seqs.sum())
        )

    @classmethod
    def sparse(cls, dies: int, held: list[int], seqs: list[int], context: list[int]) -> DPShapes:
        """The shapes of ``dies`` DP groups, all empty (no sequence, context 0: shape 0) but
        the dies ``held`` (ascending, at least one), which hold ``seqs`` sequences at
        ``context``."""
        shapes = [n << 32 | c for n, c in zip(seqs, context, strict=True)]
        distinct = list(dict.fromkeys(shapes))  # held ascend: by first die
        empty = next((i for i, die in enumerate(held) if die != i), len(held))  # the first
        if empty < dies:  # after the shapes of the dies before it (dies 0 .. empty - 1)
            distinct.insert(len(dict.fromkeys(shapes[:empty])), 0)
        return cls(distinct, (dies, held, shapes), float(max(seqs)), sum(seqs))


class KernelTimes:
    """Per-kernel times of one model on one die, cached by shape: the pieces of a decode layer
    that the colocated (:class:`DecodeModel`) and the MoE-attention disaggregated
    (:mod:`xds.serve.ma_decode`) deployments both price."""

    def __init__(
        self,
        model: ModelSpec,
        die: DieSpec,
        *,
        precision: Precision | None = None,
        efficiency: KernelEfficiency | None = None,
    ):
        self.model = model
        self.cost = CostModel(model, die, precision=precision, efficiency=efficiency)
        self._attn_cache: dict[tuple[int, float, int, bool], tuple[int, int, int]] = {}
        self._dense_cache: dict[float, int] = {}
        self._expert_cache: dict[float, int] = {}
        self._head_cache: dict[float, tuple[int, int]] = {}
        self._expert_table = np.zeros(0, dtype=np.float64)
        """``expert_ns(float(t))`` for integer token counts ``t``, grown on demand."""

    def attention_part(
        self, seqs: int, tokens_per_seq: float, context: int, layer: int | None = None
    ) -> tuple[int, int, int]:
        """(attention, other MLA + norms, gating) of one layer on one die (``layer`` picks
        BF16 or INT8 attention, :attr:`Precision.attention_int8_layers`)."""
        int8 = self.cost.precision.int8_attention(layer)
        key = (seqs, tokens_per_seq, context, int8)
        hit = self._attn_cache.get(key)
        if hit is not None:
            return hit
        c = self.cost
        if len(self._attn_cache) >= 65_536:
            self._attn_cache.clear()
        tokens = seqs * tokens_per_seq
        attn = c.attention_core(seqs, tokens_per_seq, context, layer=layer).time_ns if seqs else 0
        other = (
            sum(k.time_ns for k in c.attention_prolog(tokens))
            + sum(k.time_ns for k in c.attention_output(tokens))
            + c.kernel(
                "post_norm",
                5.0 * tokens * self.model.hidden,
                4.0 * tokens * self.model.hidden,
                "vector",
            ).time_ns
            if seqs
            else 0
        )
        gate = c.gating(tokens).time_ns if seqs else 0
        self._attn_cache[key] = (attn, other, gate)
        return attn, other, gate

    def dense_mlp_ns(self, tokens: float) -> int:
        hit = self._dense_cache.get(tokens)
        if hit is None:
            hit = self._dense_cache[tokens] = self.cost.dense_mlp(tokens).time_ns if tokens else 0
        return hit

    def expert_ns(self, tokens: float) -> int:
        hit = self._expert_cache.get(tokens)
        if hit is None:
            hit = self._expert_cache[tokens] = self.cost.expert(tokens).time_ns
        return hit

    def head_ns(self, tokens: float) -> tuple[int, int]:
        """(LM head, sampling) of ``tokens`` tokens on one die."""
        hit = self._head_cache.get(tokens)
        if hit is None:
            if len(self._head_cache) >= 65_536:
                self._head_cache.clear()
            hit = self._head_cache[tokens] = (
                self.cost.lm_head(tokens).time_ns,
                self.cost.sampling(tokens).time_ns,
            )
        return hit

    def expert_ns_of(self, counts: np.ndarray) -> np.ndarray:
        """``expert_ns(float(t))`` for each integer token count in ``counts`` (a table grown
        on demand: a layer's 256 experts cost one lookup)."""
        top = int(counts.max()) if counts.size else 0
        if top >= len(self._expert_table):
            size = max(top + 1, 2 * len(self._expert_table))
            self._expert_table = np.array(
                [self.expert_ns(float(t)) for t in range(size)], dtype=np.float64
            )
        return self._expert_table[counts]

    def busiest_expert_ns(
        self, gen: np.random.Generator, tokens_total: float, routed_dies: int, shared_dies: int
    ) -> int:
        """Expert time of the busiest die in one MoE layer: ``tokens_total`` tokens' routed
        copies spread over the routed experts (multinomial, uniform gating), experts placed
        contiguously on ``routed_dies`` (each expert on a die costs its own weight read), the
        shared expert split over its ``shared_dies`` instances."""
        m = self.model
        routed = gen.multinomial(
            round(tokens_total) * m.top_k, np.full(m.routed_experts, 1.0 / m.routed_experts)
        )
        die_of = np.arange(m.routed_experts) * routed_dies // m.routed_experts
        per_expert = self.expert_ns_of(routed)
        die_ns = np.bincount(die_of, weights=per_expert, minlength=routed_dies)
        busiest = float(die_ns.max())
        if shared_dies:
            busiest = max(busiest, self.expert_ns(tokens_total / shared_dies))
        return round(busiest)


_PassKey = tuple[float, int, int, int]
"""A forward pass: (tokens per sequence, first layer, dense layers, MoE layers)."""

_ROW = ("arrive", "attention", "other", "gate", "dense_mlp", "layer", "attn", "layer8", "attn8")
"""What :meth:`DecodeModel._pass_row` gives of one DP group in one pass (ns): its arrival at
the first dispatch (jitter aside), the attention, other MLA + norms, gating and dense-MLP time
up to there, then one later MoE layer's attention + other + gating and its attention, in BF16
(``layer``, ``attn``) and INT8 (``layer8``, ``attn8``) attention."""
_ARRIVE, _ATTENTION, _OTHER, _GATE, _DENSE_MLP, _LAYER, _ATTN, _LAYER8, _ATTN8 = range(len(_ROW))
_UNREAD = np.zeros(0, dtype=np.int64)
"""The per-die first dispatch times of a pass that does not give them."""


class DecodeModel(KernelTimes):
    """Per-iteration costs of the instance (shared by both tiers)."""

    def __init__(
        self,
        config: DecodeConfig,
        comm: CommCosts,
        comm_mtp: CommCosts | None = None,
        pod: CloudMatrix384 | None = None,
    ):
        self.config = config
        self.pod = pod or CloudMatrix384(servers=max(1, -(-config.dies // 16)))
        super().__init__(
            config.spec,
            self.pod.die_spec,
            precision=config.precision,
            efficiency=config.efficiency,
        )
        self.comm = comm
        self.comm_mtp = comm_mtp or comm
        self.online: OnlineEPLB | None = None
        """Online EPLB: routing drawn from its popularity, loads under its mapping."""
        self.routed_die_share: np.ndarray | None = None
        """Optional [moe_layers, dies]: each die's share of a layer's routed copies (EPLB
        placements on skewed routing); None means uniform routing drawn per pass."""
        self._rows: dict[_PassKey, dict[int, tuple[int, ...]]] = {}
        """:meth:`_pass_row` per pass and DP shape."""
        self._proj_cache: dict[float, int] = {}
        """The MTP eh_proj's time per widest DP batch."""
        self._layouts: dict[tuple[int, int, int], tuple[int, bool, int, int | None]] = {}

    # pieces of one pass ------------------------------------------------------------------------
    def _int8_layout(
        self, first_layer: int, dense: int, n_moe: int
    ) -> tuple[int, bool, int, int | None]:
        """For a pass over layers ``first_layer..`` (``dense`` dense, then ``n_moe`` MoE): the
        INT8-attention dense layers, whether the first MoE layer is one, how many of the later
        MoE layers are, and one such layer (None if none) - cached per pass shape."""
        key = (first_layer, dense, n_moe)
        hit = self._layouts.get(key)
        if hit is None:
            p = self.cost.precision
            flags = [p.int8_attention(first_layer + i) for i in range(dense + n_moe)]
            some = next((first_layer + i for i, q in enumerate(flags) if q), None)
            first = bool(n_moe) and flags[dense]
            hit = self._layouts[key] = (sum(flags[:dense]), first, sum(flags[dense + 1 :]), some)
        return hit

    def layer_expert_ns(self, gen: np.random.Generator, tokens_total: int) -> int:
        """Expert time of the busiest die in one MoE layer of this deployment."""
        cfg = self.config
        return self.busiest_expert_ns(
            gen, tokens_total, cfg.dies - cfg.shared_expert_dies, cfg.shared_expert_dies
        )

    def draw_experts(
        self, seqs: np.ndarray, gen: np.random.Generator
    ) -> tuple[list[int], list[int]]:
        """Expert-compute time of every MoE layer of this iteration: (MTP layer, main layers),
        drawn in that order from the routing stream (both tiers draw through here)."""
        m = self.model
        total = int(seqs.sum())
        k = self.config.mtp_config.k
        moe_layers = m.layers - m.dense_layers
        if self.online is not None:  # skewed routing under the current EPLB mapping
            busiest = self.online.busiest_die_tokens(total * (1 + k), m.top_k)
            main = [self.expert_ns(t) for t in busiest]
            mtp_tokens = float(np.mean(busiest)) / (1 + k)  # the MTP layer: a typical layer
            return [self.expert_ns(mtp_tokens)] * k, main
        if self.routed_die_share is not None:  # a fixed placement on a measured load
            mtp = [self.expert_ns(self.busiest_die(total, moe_layers // 2)) for _ in range(k)]
            main = [
                self.expert_ns(self.busiest_die(total * (1 + k), layer))
                for layer in range(moe_layers)
            ]
            return mtp, main
        mtp = [self.layer_expert_ns(gen, total) for _ in range(k)]
        main = [self.layer_expert_ns(gen, total * (1 + k)) for _ in range(moe_layers)]
        return mtp, main

    def busiest_die(self, tokens: int, layer: int) -> float:
        """Tokens on the busiest die of ``layer`` under ``routed_die_share`` (plus the shared
        expert's instances on the last dies)."""
        assert self.routed_die_share is not None
        cfg = self.config
        die = self.routed_die_share[layer] * tokens * self.model.top_k
        if cfg.shared_expert_dies:
            die = die.copy()
            die[cfg.dies - cfg.shared_expert_dies :] += tokens / cfg.shared_expert_dies
        return float(die.max())

    def iteration(
        self, seqs: np.ndarray, context: np.ndarray, jitter_ns: np.ndarray, gen: np.random.Generator
    ) -> IterationOutcome:
        """One iteration for all dies at once (iteration tier)."""
        return self.account(seqs, context, jitter_ns, *self.draw_experts(seqs, gen))

    def account(
        self,
        seqs: np.ndarray,
        context: np.ndarray,
        jitter_ns: np.ndarray,
        mtp_experts: list[int],
        main_experts: list[int],
    ) -> IterationOutcome:
        """Time and per-kernel breakdown of one iteration given its expert-compute draws."""
        jitter = jitter_ns if np.count_nonzero(jitter_ns) else None
        return self.account_shapes(DPShapes.of(seqs, context), jitter, mtp_experts, main_experts)

    def account_shapes(
        self,
        shapes: DPShapes,
        jitter: np.ndarray | None,
        mtp_experts: list[int],
        main_experts: list[int],
        *,
        per_die: bool = True,
    ) -> IterationOutcome:
        """:meth:`account` of the DP groups ``shapes``, each die delayed ``jitter`` ns before
        its first dispatch (None: none); ``per_die``: whether the outcome gives each die's
        first dispatch time (or :data:`_UNREAD`: a caller without jitter never reads them)."""
        m = self.model
        eff = self.config.efficiency
        k = self.config.mtp_config.k
        bd = Breakdown()
        t = 0
        proj = self._mtp_projection_ns(shapes.widest)  # the MTP eh_proj
        for draft in range(k):  # each draft depth is its own sequential MTP forward
            mtp = self._pass(
                shapes,
                1.0,
                m.layers,
                jitter=None,
                bd=bd,
                experts=[mtp_experts[draft]],
                comm=self.comm_mtp,
                per_die=False,  # only the main pass's are read
            )
            t += mtp.time_ns + eff.graph_launch_ns + proj
            bd.mla_other += proj
        main = self._pass(
            shapes,
            1.0 + k,
            0,
            jitter=jitter,
            bd=bd,
            experts=main_experts,
            dense=m.dense_layers,
            comm=self.comm,
            per_die=per_die,
        )
        t += main.time_ns + eff.graph_launch_ns
        bd.launch += (k + 1) * eff.graph_launch_ns
        return IterationOutcome(t, bd, main.first_dispatch_ns)

    def _mtp_projection_ns(self, tokens: float) -> int:
        hit = self._proj_cache.get(tokens)
        if hit is None:
            if len(self._proj_cache) >= 65_536:
                self._proj_cache.clear()
            hit = self._proj_cache[tokens] = self.cost.mtp_projection(tokens).time_ns
        return hit

    def _pass_row(self, shape: int, key: _PassKey) -> tuple[int, ...]:
        """The :data:`_ROW` times of a DP group of ``shape`` (``seqs << 32 | context``) in the
        pass ``key``, cached."""
        rows = self._rows.setdefault(key, {})
        hit = rows.get(shape)
        if hit is not None:
            return hit
        tokens_per_seq, first_layer, dense, n_moe = key
        n8_dense, first8, _, layer8 = self._int8_layout(first_layer, dense, n_moe)
        seqs, context = shape >> 32, shape & 0xFFFFFFFF
        attn, other, gate = self.attention_part(seqs, tokens_per_seq, context, None)
        attn8 = (
            self.attention_part(seqs, tokens_per_seq, context, layer8)[0]
            if layer8 is not None
            else attn
        )
        dense_mlp = self.dense_mlp_ns(float(seqs) * tokens_per_seq)
        # alone until the first dispatch: the dense layers, then the first MoE layer's attention
        attention = (dense - n8_dense) * attn + n8_dense * attn8 + (attn8 if first8 else attn)
        arrive = attention + dense * (other + dense_mlp) + other + gate
        row = (arrive, attention, other, gate, dense_mlp)
        row += (attn + other + gate, attn, attn8 + other + gate, attn8)
        if len(rows) >= 65_536:
            rows.clear()
        rows[shape] = row
        return row

    def _pass(
        self,
        shapes: DPShapes,
        tokens_per_seq: float,
        first_layer: int,
        *,
        jitter: np.ndarray | None,
        bd: Breakdown,
        experts: list[int],
        comm: CommCosts,
        dense: int = 0,
        per_die: bool = True,
    ) -> IterationOutcome:
        """One forward pass over the DP groups ``shapes``: ``dense`` dense layers then one MoE
        layer per ``experts`` entry, numbered from ``first_layer`` (the main model from 0, the
        MTP layer as ``layers``), each die delayed ``jitter`` ns before it (None: none);
        ``per_die``: whether to give each die's first dispatch time (or :data:`_UNREAD`).

        A die's times are its shape's :meth:`_pass_row`, so the first slowest die of a row is
        the first die of the first shape slowest in it (shapes go by first die)."""
        d, c = comm.dispatch_ns, comm.combine_ns
        n_moe = len(experts)
        n8_between = self._int8_layout(first_layer, dense, n_moe)[2]
        key = (tokens_per_seq, first_layer, dense, n_moe)
        known = self._rows.get(key, {})
        rows = [known.get(shape) or self._pass_row(shape, key) for shape in shapes.distinct]
        # dies run alone until the first dispatch: dense layers + first MoE layer's attention
        if jitter is None and not per_die:  # no die's own times needed: by shape alone
            row = max(rows, key=itemgetter(_ARRIVE))
            barrier = row[_ARRIVE]
            first_dispatch = _UNREAD
        else:
            arrive = np.array([r[_ARRIVE] for r in rows], dtype=np.int64)[shapes.of_die]
            if jitter is not None:
                arrive = arrive + jitter
            slowest = int(arrive.argmax())
            row = rows[int(shapes.of_die[slowest])]
            barrier = int(arrive[slowest])
            if jitter is not None:
                bd.jitter_wait += int(jitter[slowest])
            first_dispatch = (barrier + d) - arrive
        t = barrier
        bd.attention += row[_ATTENTION]
        bd.mla_other += (dense + 1) * row[_OTHER]
        bd.gating += row[_GATE]
        bd.dense_mlp += dense * row[_DENSE_MLP]
        # per MoE layer: dispatch, the slowest expert, combine, then the next layer's attention
        slowest_experts = sum(experts)
        t += n_moe * (d + c) + slowest_experts
        bd.dispatch += n_moe * d
        bd.experts += slowest_experts
        bd.combine += n_moe * c
        between = max(0, n_moe - 1)
        for layer, attn, count in (
            (_LAYER, _ATTN, between - n8_between),
            (_LAYER8, _ATTN8, n8_between),
        ):
            if not count:  # the layers after the first MoE one, by attention precision
                continue
            worst = max(rows, key=itemgetter(layer))  # the first slowest die's
            t += count * worst[layer]
            bd.attention += count * worst[attn]
            bd.mla_other += count * worst[_OTHER]
            bd.gating += count * worst[_GATE]
        head, samp = self.head_ns(shapes.widest * tokens_per_seq)
        t += head + samp
        bd.lm_head += head
        bd.sampling += samp
        return IterationOutcome(t, bd, first_dispatch)


def measure_comm(
    config: DecodeConfig,
    tokens_per_die: int,
    *,
    seed: int = 0,
    expert_map: ExpertMap | None = None,
    popularity: np.ndarray | None = None,
) -> CommCosts:
    """Dispatch/combine cost of one MoE layer with ``tokens_per_die`` tokens on every die
    (collective tier, common start). Routing is uniform over the routed experts unless
    ``popularity`` gives their probabilities; each token also visits one shared-expert
    instance. ``expert_map`` places logical experts (routed, then shared) on the dies,
    replicas included (EPLB)."""
    from ..fabric import UBFabric
    from ..fabric.xccl.ep import EPConfig, EPGroup
    from ..runtime import run

    require_instance(config, DecodeConfig, "config")
    tokens_per_die = require_int(tokens_per_die, "tokens_per_die", low=1)
    m = config.spec
    n = config.dies
    shared = config.shared_expert_dies
    pod = CloudMatrix384(servers=max(1, -(-n // 16)))

    async def main() -> CommCosts:
        fabric = UBFabric(pod, payload_mode="size")
        emap = expert_map or (
            ExpertMap(m.routed_experts + shared, n)
            if m.routed_experts + shared >= n
            else ExpertMap(m.routed_experts, n)
        )
        width = m.top_k + (1 if shared else 0)
        group = EPGroup(
            fabric,
            list(range(n)),
            emap,
            EPConfig(
                hidden=m.hidden,
                top_k=width,
                max_tokens_per_rank=max(1, tokens_per_die),
                dispatch_dtype=config.dispatch_dtype,
                combine_dtype=config.combine_dtype,
                scale_dtype=config.scale_dtype,
                pull_order=config.pull_order,
            ),  # type: ignore[arg-type]
            tier="collective",
        )
        pick = rng("decode/comm-routing")
        choice, experts, top_k = pick.choice, m.routed_experts, m.top_k  # one lookup each
        routes = []
        for r in range(n):
            idx = (
                np.stack(
                    [
                        choice(experts, top_k, replace=False, p=popularity)
                        for _ in range(tokens_per_die)
                    ]
                )
                if tokens_per_die
                else np.zeros((0, m.top_k), np.int64)
            )
            if shared:
                col = m.routed_experts + (r + np.arange(tokens_per_die)) % shared
                idx = np.concatenate([idx, col[:, None]], axis=1)
            routes.append(idx)
        ends = {"d": 0, "c": 0}
        t0 = now_ns() + 1_000
        t1 = t0 + 10 * MS

        async def rank(r: int) -> None:
            await sleep_until_ns(t0)
            h = await group.dispatch(r, tokens_per_die, routes[r], 2)
            ends["d"] = max(ends["d"], now_ns())
            await sleep_until_ns(t1)
            await group.combine(r, h, None, None, 3)
            ends["c"] = max(ends["c"], now_ns())

        async with anyio.create_task_group() as tg:
            for r in range(n):
                tg.start_soon(rank, r)
        return CommCosts(tokens_per_die, ends["d"] - t0, ends["c"] - t1, dies=n)

    return run(main, seed=seed, event_log=False)


def expert_slots_per_die(config: DecodeConfig) -> int:
    """Routed-expert slots of one routed-expert die: ``ceil(routed experts / routed dies)``
    plus the redundant slots (one, or the online EPLB's ``spare_slots``)."""
    routed_dies = max(1, config.dies - config.shared_expert_dies)
    spare = config.eplb.spare_slots if config.eplb is not None else 1
    return -(-config.spec.routed_experts // routed_dies) + spare


def decode_weight_bytes(config: DecodeConfig) -> int:
    """Weight bytes one decode die holds: attention and dense layers replicated per DP, its
    routed experts + its redundant slots per MoE layer (one, or the online EPLB's
    ``spare_slots``), at the config's precision (INT8 by default), embeddings and LM head in
    BF16; the MTP layer's when the deployment drafts."""
    return config.precision.weight_bytes(
        config.spec, experts=expert_slots_per_die(config), mtp=config.drafts
    )


def decode_kv_capacity(config: DecodeConfig, pod: CloudMatrix384) -> int:
    """KV blocks of one decode die: HBM left after the weights it holds (attention and dense
    layers replicated per DP, its routed experts + one redundant slot per MoE layer in INT8,
    embeddings and LM head in BF16) and the workspace; a block holds the MTP layer's KV too
    when the deployment drafts."""
    return kv_capacity_blocks(
        config.spec,
        pod.die_spec,
        weight_bytes=decode_weight_bytes(config),
        block_tokens=config.block_tokens,
        int8_nope=config.precision.kv_int8_nope,
        mtp=config.drafts,
    )


document_fields(DecodeConfig, CommCosts)
