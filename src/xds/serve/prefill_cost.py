"""The step time of a Prefill TE (SPEC 2.1, 6.4, 12.4): eager-mode kernels of all its DP groups
in lockstep, sequence-parallel shares, microbatched two-batch overlap, per-layer INT8 attention.

See :mod:`xds.serve.prefill` for the model this prices (TP attention per DP group, EP MoE over
the TE's dies, the SP ring) and for the scheduler that uses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ConfigError
from ..hw import DieSpec, EngineSpec, LinkSpec, PodConfig, collective_efficiency
from ..model import CostModel, ModelSpec

if TYPE_CHECKING:
    from .prefill import PrefillConfig


Piece = tuple[int, int] | tuple[int, int, int]
"""Work a DP group holds in a step: (new tokens, cached tokens[, SP degree])."""


class _Form(NamedTuple):
    """A group's (or one piece's) attention work per die in one of MLA's forms."""

    flops: float
    """Attention FLOPs."""
    kv_bytes: float
    """Keys and values the attention kernel reads."""
    up_tokens: float
    """Latent tokens ``kv_b_proj`` up-projects first (the non-absorbed form)."""
    absorb_tokens: float
    """New tokens through the absorb kernels (the absorbed form)."""


def _sp(piece: Piece) -> int:
    return piece[2] if len(piece) == 3 else 1  # type: ignore[misc]


def _tokens(piece: Piece) -> float:
    """New tokens this group projects and sends through the MoE layers."""
    return piece[0] / _sp(piece)


def check_attention_tp(model: ModelSpec, tp: int, *, field: str = "prefill.attention_tp") -> None:
    """``model``'s attention splits over ``tp`` ranks by head: its query heads evenly, and a
    GQA model's KV heads evenly or each replicated on an equal number of ranks."""
    if model.heads % tp:
        raise ConfigError(
            f"{model.name}'s {model.heads} attention heads do not split evenly over "
            f"attention_tp = {tp} ranks",
            field=field,
        )
    if model.attention == "gqa" and model.kv_heads % tp and tp % model.kv_heads:
        raise ConfigError(
            f"{model.name}'s {model.kv_heads} KV heads neither split evenly over nor "
            f"replicate evenly on attention_tp = {tp} ranks",
            field=field,
        )


class PrefillCost:
    """Step time of one Prefill TE (all its DP groups in lockstep). ``link`` is the one its
    all-to-all and SP ring run over (:func:`prefill_te_link`), ``tp_link`` the one inside a
    TP group (:func:`prefill_tp_link`; default ``link``); ``mtp=False`` leaves the model's
    MTP layer out (a deployment that does not draft)."""

    def __init__(
        self,
        model: ModelSpec,
        config: PrefillConfig,
        die: DieSpec,
        engines: EngineSpec,
        link: LinkSpec,
        tp_link: LinkSpec | None = None,
        *,
        mtp: bool | None = None,
    ):
        check_attention_tp(model, config.attention_tp)
        tp = config.attention_tp
        self.model = model
        self.mtp = bool(model.mtp_layers) and (mtp is None or mtp)
        """Whether a step runs the MTP layer after the main model (the deployment drafts;
        by default, whenever the model has one)."""
        self.config = config
        self.cost = CostModel(model, die, precision=config.precision, efficiency=config.efficiency)
        self.engines = engines
        self.link = link
        self.tp_link = tp_link or link
        ep = config.dies_per_te
        self.a2a_share = collective_efficiency(engines, ep - 1)
        self._kv_token = model.kv_bytes_per_token_layer(int8_nope=config.precision.kv_int8_nope)
        """KV-cache bytes of one token in one layer (MLA: the latent and RoPE key)."""
        self._rank_kv_token = self._kv_token * model.kv_rank_share(tp)
        """Of them, what one TP rank holds, reads and passes round the SP ring (MLA's latent
        is replicated on the ranks; GQA's KV heads are split over them)."""
        self._blom = NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25)) if ep > 1 else 0.0
        self._work: tuple[float, float, float] | None = None
        self._kinds: list[tuple[bool, int]] | None = None
        self._runs: list[tuple[bool, int, int]] | None = None
        self._steps: dict[tuple[tuple[Piece, ...], ...], int] = {}
        self._groups: dict[tuple[tuple[Piece, ...], bool], tuple[list[int], ...]] = {}
        self._cheaper: dict[tuple[Piece, bool], tuple[int, _Form]] = {}

    def piece_work(self, new: int, cached: int) -> float:
        """A job's weight when the leader balances a step:
        ``a new + b new (cached + new/2) + e cached`` (per-token projections, experts and
        all-to-all; causal attention; up-projecting the cached context), with ``a``, ``b``
        and ``e`` read off this cost model's own step times (cached on first use)."""
        if self._work is None:
            short, long, ctx = 2_048, 8_192, 16_384
            t1, t2 = self.step_ns([[(short, 0)]]), self.step_ns([[(long, 0)]])
            t3, t4 = self.step_ns([[(short, ctx)]]), self.step_ns([[(long, ctx)]])
            b = max(0.0, ((t4 - t2) - (t3 - t1)) / ((long - short) * ctx))
            e = max(0.0, (t3 - t1 - b * short * ctx) / ctx)
            a = max(1e-9, (t2 - t1 - b * (long**2 - short**2) / 2) / (long - short))
            self._work = (a, b, e)
        a, b, e = self._work
        return new * (a + b * (cached + new / 2)) + e * cached

    def _scaled(self, times: list[int], tp: int) -> list[int]:
        return [-(-t // tp) for t in times]

    def layer_times(
        self, groups: Sequence[Sequence[Piece]], *, int8_attention: bool | None = None
    ) -> tuple[list[int], ...]:
        """(dense layer, MoE layer, MTP layer, head) kernel times of one lockstep step, for
        ``groups`` = per DP group the pieces of work it holds: (new tokens, cached tokens) of
        each of its requests, or (new, cached, sp) for a request split sequence-parallel over
        ``sp`` groups (each group then holds a 1/sp share, see :meth:`sp_step`).
        The groups meet at every MoE layer, so each kernel takes as long as it does on the
        slowest group; the routed experts serve every group's tokens at once."""
        m, cfg = self.model, self.config
        if int8_attention is None:  # the all-layer switch (per-layer: :meth:`step_ns`)
            int8_attention = cfg.precision.attention_int8
        busy = [g for g in groups if g]
        all_tokens = sum(_tokens(p) for g in busy for p in g)
        experts_here = max(1, -(-m.routed_experts // cfg.dies_per_te))  # the fullest die's
        busiest = self.busiest_die_copies(all_tokens * m.top_k)
        routed = experts_here * self.cost.expert(busiest / experts_here).time_ns
        # the slowest group's time of each kernel (the routed experts are every group's)
        times = [self._group_times(g, int8_attention) for g in busy]
        dense, before, after, mtp_proj, head = (
            list(map(max, *lists)) if len(lists) > 1 else list(lists[0])
            for lists in zip(*times, strict=True)
        )
        moe = [*before, routed, *after]
        return dense, moe, [*mtp_proj, *moe], head

    def busiest_die_copies(self, copies: float) -> float:
        """Routed copies on the TE's busiest expert die when ``copies`` spread over its dies
        (uniform gating, as decode's default draws them: each copy lands on a die with
        probability 1/dies, so a die's load is binomial): the expected largest of the dies'
        loads, in the normal approximation with Blom's score for the top of ``dies`` order
        statistics (2.07 sd above the mean for 32 dies: a 2,048-token prompt's busiest die
        holds 9 % over the mean, a 32K-token step's 2 %). The experts wait for it."""
        dies, experts = self.config.dies_per_te, self.model.routed_experts
        if experts % dies:  # uneven: the fullest dies hold ceil(experts / dies) experts each
            share = -(-experts // dies) / experts
            mean = copies * share
            return mean + self._blom * math.sqrt(copies * share * (1 - share))
        mean = copies / dies
        if dies == 1 or copies <= 0:
            return mean
        return mean + self._blom * math.sqrt(copies * (1 / dies) * (1 - 1 / dies))

    def _group_times(
        self, group: Sequence[Piece], int8_attention: bool
    ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """One DP group's kernel times (attention side on ``tp`` dies) but the routed
        experts': (dense layer, MoE layer before and after the routed experts, MTP projection,
        head). A pure function of the group's pieces, remembered (steps and plans repeat
        groups: a spread job's shares, the leader's estimates)."""
        key = (tuple(group), int8_attention)
        hit = self._groups.get(key)
        if hit is None:
            if len(self._groups) >= 16_384:
                self._groups.clear()
            hit = self._groups[key] = self._group_parts(group, int8_attention)
        return hit

    def _group_parts(
        self, group: Sequence[Piece], int8_attention: bool
    ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """:meth:`_group_times`, computed."""
        c, m, cfg = self.cost, self.model, self.config
        tp = cfg.attention_tp
        tokens = float(sum(_tokens(p) for p in group))
        kv_token = self._rank_kv_token
        mha, absorbed = self._attention_plan(group, int8_attention)
        attn = self._attention_ns(mha.flops, mha.kv_bytes, int8_attention) + self._attention_ns(
            absorbed.flops, absorbed.kv_bytes, int8_attention
        )
        up = self._context_up_projection(mha.up_tokens)
        absorb = absorbed.absorb_tokens
        # SP ring: each share's KV (MLA: latent) travels to the other sp - 1 groups, overlapped with
        # the attention compute, at the rate of one link
        ring = max(
            (
                round((_sp(p) - 1) * (p[0] + p[1]) / _sp(p) * kv_token / self.link.bandwidth * 1e9)
                for p in group
            ),
            default=0,
        )
        # projections split over the TP ranks (MLA's by token, GQA's by head); the attention
        # kernel is already per die (its FLOPs count this rank's heads; each rank reads the
        # whole context, as latents or as its heads' keys and values)
        gather, scatter = self._tp_exchange(tokens)
        if m.attention == "mla":  # each rank projects its own tokens: 1/tp of the work
            prolog = self._scaled([k.time_ns for k in c.mla_prolog(tokens, absorb=absorb)], tp)
            output = self._scaled([k.time_ns for k in c.mla_output(tokens, absorb=absorb)], tp)
        else:  # each rank projects every token to its heads
            prolog = [k.time_ns for k in c.gqa_prolog(tokens, tp=tp)]
            output = [k.time_ns for k in c.gqa_output(tokens, tp=tp)]
        attn_side = [*prolog, *gather, max(attn + up, ring), *output, *scatter]
        dense = [*attn_side, -(-c.dense_mlp(tokens).time_ns // tp)]
        shared = c.expert(tokens / tp, name="shared_expert").time_ns if m.shared_experts else 0
        copies = tokens / tp * m.top_k  # each TP rank dispatches its share of the tokens
        bw = self.link.bandwidth * self.a2a_share
        dispatch = self.engines.dma_startup_ns + round(copies * m.hidden / bw * 1e9)
        combine = self.engines.dma_startup_ns + round(copies * m.hidden * 2 / bw * 1e9)
        gate = -(-c.gating(tokens).time_ns // tp)
        mtp_proj = [-(-c.mtp_projection(tokens).time_ns // tp)]
        reqs = float(len(group))
        head = [c.lm_head(reqs).time_ns, c.sampling(reqs).time_ns]
        return dense, [*attn_side, gate, dispatch], [shared, combine], mtp_proj, head

    def _tp_exchange(self, tokens: float) -> tuple[list[int], list[int]]:
        """The TP group's two collectives per layer, as ring exchanges over ``tp_link`` (none
        at TP1). Each rank projects its 1/tp of the tokens down (the cost above splits those
        projections over the ranks), so before the attention core the ranks all-gather the
        compressed latents (q and kv LoRA ranks plus the RoPE key; the hidden state for a
        model without MLA); after the row-parallel output projection they reduce-scatter its
        BF16 partial sums, each rank keeping its tokens' hidden states for the gate, its
        share of the dispatch and the next layer. Each moves (tp - 1) / tp of its bytes in
        tp - 1 steps."""
        tp, m = self.config.attention_tp, self.model
        if tp == 1:
            return [], []
        mla = m.attention == "mla"
        latent = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim if mla else m.hidden
        steps = (tp - 1) * self.tp_link.latency_ns
        share = (tp - 1) / tp * tokens * 2 / self.tp_link.bandwidth * 1e9  # per BF16 element
        return [steps + round(share * latent)], [steps + round(share * m.hidden)]

    def _attention_plan(self, group: Sequence[Piece], int8_attention: bool) -> tuple[_Form, _Form]:
        """A group's attention work, each piece in the cheaper of MLA's two forms
        (:meth:`_forms`; compared on kernel time: attention compute or K/V reads, whichever
        binds, plus the up-projection or the absorb kernels the form needs), summed per form:
        (non-absorbed, absorbed). The two forms are different kernels, run one after the
        other; the pieces of one form share its kernel."""
        totals = [_Form(0.0, 0.0, 0.0, 0.0), _Form(0.0, 0.0, 0.0, 0.0)]
        for p in group:
            i, form = self._cheaper_form(p, int8_attention)
            totals[i] = _Form(*(a + b for a, b in zip(totals[i], form, strict=True)))
        return totals[0], totals[1]

    def _cheaper_form(self, piece: Piece, int8_attention: bool) -> tuple[int, _Form]:
        """(0 non-absorbed or 1 absorbed, its work) for one piece (remembered: the leader's
        plans price the same pieces in many groups)."""
        key = (piece, int8_attention)
        hit = self._cheaper.get(key)
        if hit is None:
            if len(self._cheaper) >= 16_384:
                self._cheaper.clear()
            if self.model.attention != "mla":
                hit = self._cheaper[key] = (0, self._gqa_form(piece))
                return hit
            mha, absorbed = self._forms(piece, int8_attention)
            if self._form_ns(mha, int8_attention) <= self._form_ns(absorbed, int8_attention):
                hit = (0, mha)
            else:
                hit = (1, absorbed)
            self._cheaper[key] = hit
        return hit

    def _forms(self, piece: Piece, int8_attention: bool) -> tuple[_Form, _Form]:
        """A piece's causal attention in MLA's two forms, per die (heads split by TP; an SP
        share does 1/sp of its request's work, a load-balanced causal split): each new token
        attends to the cached prefix and, on average, half of the new tokens.

        - *Non-absorbed* (MHA over 192-dim keys and 128-dim values): ``kv_b_proj`` first
          up-projects the keys and values of all the context it attends to from the latent
          cache: the cached prefix, its own new tokens, and for an SP share the other shares'
          new tokens, which arrive by the ring as latents. The attention kernel then reads
          those per-head keys and values (16 KB per token per TP4 rank in BF16, against the
          latent's 656 B) and the shared RoPE key. Queries and outputs need no absorb kernels.
        - *Absorbed* (MQA over the 512 + 64-dim latent, 512-dim values): no up-projection and
          only the latent is read, but about 3.4x the FLOPs per attended pair (DeepSeek-V3's
          dims), and every new token goes through the absorb kernels (W_UK into the latent
          before, W_UV out of it after).

        Returns (non-absorbed, absorbed)."""
        m, cfg = self.model, self.config
        new, cached, sp = piece[0], piece[1], _sp(piece)
        heads = m.heads / cfg.attention_tp
        pairs = 2.0 * new * (cached + new / 2) * heads / sp
        context = float(cached + new)  # every share reads the whole context as it passes by
        element = 1 if int8_attention else 2
        per_head = heads * (m.qk_nope_head_dim + m.v_head_dim) * element
        mha = _Form(
            flops=pairs * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim),
            kv_bytes=context * (per_head + m.qk_rope_head_dim * 2),
            up_tokens=context,
            absorb_tokens=0.0,
        )
        absorbed = _Form(
            flops=pairs * (m.kv_lora_rank + m.qk_rope_head_dim + m.kv_lora_rank),
            kv_bytes=context * self._kv_token,
            up_tokens=0.0,
            absorb_tokens=new / sp,
        )
        return mha, absorbed

    def _gqa_form(self, piece: Piece) -> _Form:
        """A piece's causal GQA attention per die (GQA has one form, :meth:`_forms` for the
        split): this rank's query heads score and sum over ``head_dim``-wide keys and values
        (2 x 2 x head_dim FLOPs per attended pair and head), reading its KV heads' cached keys
        and values over the whole context once; no up-projection, no absorb kernels."""
        m = self.model
        new, cached, sp = piece[0], piece[1], _sp(piece)
        heads = m.heads / self.config.attention_tp
        pairs = 2.0 * new * (cached + new / 2) * heads / sp
        return _Form(
            flops=pairs * 2 * m.head_dim,
            kv_bytes=float(cached + new) * self._rank_kv_token,
            up_tokens=0.0,
            absorb_tokens=0.0,
        )

    def _form_ns(self, form: _Form, int8_attention: bool) -> int:
        """The time a form's attention work takes on its own: the attention kernel (compute
        or K/V reads), the up-projection and the absorb kernels (per rank)."""
        return (
            self._attention_ns(form.flops, form.kv_bytes, int8_attention)
            + self._context_up_projection(form.up_tokens)
            + self._absorb_ns(form.absorb_tokens)
        )

    def _attention_ns(self, flops: float, kv_bytes: float, int8_attention: bool) -> int:
        if not flops and not kv_bytes:
            return 0
        engine = "cube_int8" if int8_attention else "cube_bf16"
        return self.cost.kernel(
            f"{self.model.attention}_prefill_attention", flops, kv_bytes, engine, attention=True
        ).time_ns

    def _absorb_ns(self, tokens: float) -> int:
        """The absorb kernels (q before attention, v after) on ``tokens``, per TP rank."""
        if tokens <= 0:
            return 0
        kernels = self.cost.mla_absorbs(tokens)
        return sum(self._scaled([k.time_ns for k in kernels], self.config.attention_tp))

    def _context_up_projection(self, tokens: float) -> int:
        """Up-projecting ``tokens`` of latent to this rank's heads' keys and values (0 for
        none)."""
        if tokens <= 0:
            return 0
        heads = self.model.heads // self.config.attention_tp
        return self.cost.kv_up_projection(tokens, heads).time_ns

    def sp_step(self, new: int, cached: int) -> list[list[Piece]]:
        """The step of one request run sequence-parallel over every DP group of the TE."""
        d = self.config.dps_per_te
        return [[(new, cached, d)] for _ in range(d)]

    def step_ns(self, groups: Sequence[Sequence[Piece]]) -> int:
        """Eager-mode time of one step over all layers, the MTP layer and the head (a pure
        function of the pieces: remembered, since the leader prices plans it then runs)."""
        if not any(groups):
            return 0
        key = tuple(tuple(g) for g in groups)
        hit = self._steps.get(key)
        if hit is not None:
            return hit
        single = self._single_step_ns(groups)
        if self.config.microbatches == 2:  # split only where it pays (small steps: it doubles
            single = min(single, self._overlapped_step_ns(groups))  # the eager dispatches)
        if len(self._steps) >= 8_192:
            self._steps.clear()
        self._steps[key] = single
        return single

    def _layer_kinds(self) -> list[tuple[bool, int]]:
        """Per layer in order (dense, MoE, then the MTP layer): whether its attention runs in
        INT8, and its kind (0 dense, 1 MoE, 2 MTP) as :meth:`layer_times` orders them."""
        if self._kinds is None:
            m, p = self.model, self.config.precision
            kinds = [0] * m.dense_layers + [1] * (m.layers - m.dense_layers)
            kinds += [2] * (m.mtp_layers if self.mtp else 0)
            self._kinds = [(p.int8_attention(x), kind) for x, kind in enumerate(kinds)]
        return self._kinds

    def _layer_runs(self) -> list[tuple[bool, int, int]]:
        """:meth:`_layer_kinds` as runs of consecutive equal layers: (INT8 attention, kind,
        layers)."""
        if self._runs is None:
            runs: list[tuple[bool, int, int]] = []
            for int8, kind in self._layer_kinds():
                if runs and runs[-1][:2] == (int8, kind):
                    runs[-1] = (int8, kind, runs[-1][2] + 1)
                else:
                    runs.append((int8, kind, 1))
            self._runs = runs
        return self._runs

    def _times_by_precision(
        self, groups: Sequence[Sequence[Piece]]
    ) -> dict[bool, tuple[list[int], ...]]:
        """:meth:`layer_times` with BF16 attention, and with INT8 where some layer uses it."""
        times = {False: self.layer_times(groups, int8_attention=False)}
        if any(int8 for int8, _, _ in self._layer_runs()):
            times[True] = self.layer_times(groups, int8_attention=True)
        return times

    def _single_step_ns(self, groups: Sequence[Sequence[Piece]]) -> int:
        times = self._times_by_precision(groups)
        runs = [(times[int8][kind], layers) for int8, kind, layers in self._layer_runs()]
        runs.append((times[False][3], 1))  # LM head and sampling
        return _eager_step_ns(runs, self.cost.eff.eager_op_dispatch_ns)

    def _overlapped_step_ns(self, groups: Sequence[Sequence[Piece]]) -> int:
        """Two-batch overlap: every piece's new tokens split into a first half and a second
        half that attends to the first (causal); per MoE layer each half runs its attention
        side, gating and shared expert on the compute stream, dispatch on the communication
        stream, routed experts on compute, combine on communication. The host issues every
        operator in program order (A0 D0 A1 D1 X0 C0 X1 C1), one eager dispatch each."""
        halves = [[[_half(p, first) for p in g] for g in groups] for first in (True, False)]
        by_precision = [self._times_by_precision(h) for h in halves]
        step = self.cost.eff.eager_op_dispatch_ns
        host = compute = comm = 0
        ready = [0, 0]  # when each half's previous layer output is there

        def on(stream: int, t: int, after: int) -> int:
            nonlocal host
            host += step
            return max(stream, host, after) + t

        for int8, kind in self._layer_kinds():
            times = [by_precision[0][int8], by_precision[1][int8]]
            if kind == 0:  # dense: compute only
                for mb in (0, 1):
                    for t in times[mb][0]:
                        compute = ready[mb] = on(compute, t, ready[mb])
                continue
            sent = [0, 0]
            for mb in (0, 1):
                ops = times[mb][kind]
                for t in [*ops[:-4], ops[-2]]:  # attention side, gating, shared expert
                    compute = ready[mb] = on(compute, t, ready[mb])
                comm = sent[mb] = on(comm, ops[-4], ready[mb])  # dispatch
            for mb in (0, 1):
                ops = times[mb][kind]
                compute = on(compute, ops[-3], sent[mb])  # routed experts
                comm = ready[mb] = on(comm, ops[-1], compute)  # combine
        done = max(ready)
        for t in by_precision[1][False][3]:  # LM head and sampling: each request's last
            # token, in the second half
            compute = done = on(compute, t, done)
        return done


def _eager_step_ns(runs: Sequence[tuple[Sequence[int], int]], dispatch_ns: int) -> int:
    """The time of operators issued eagerly, one host dispatch of ``dispatch_ns`` each:
    operator ``i`` (from 0) starts at max(device free, its dispatch done at (i + 1) d), so
    the step ends at the max over ``i`` of (i + 1) d + (the time of operators i..n-1).
    ``runs`` gives the operators in order as (block of operator times, repeats): a run of
    identical layers.

    Over the repeats of a block, an operator's bound moves by ``L d - S`` a repeat (``L``
    operators of total time ``S`` between two repeats), so it peaks at the first repeat or
    the last: each run costs one pass over its block, whatever its repeats."""
    end = sum(len(block) * repeats for block, repeats in runs)
    tail = 0  # the time of the operators after the run
    best = 0
    for block, repeats in reversed(runs):
        if not block or repeats <= 0:
            continue
        per_repeat = sum(block)
        start = end - len(block) * repeats
        # the first repeat: operator start + j, followed by the rest of its block (``rest``),
        # the other repeats and the tail
        first = rest = 0
        for j in reversed(range(len(block))):
            rest += block[j]
            bound = (start + j + 1) * dispatch_ns + rest
            if bound > first:
                first = bound
        later = max(0, (repeats - 1) * (len(block) * dispatch_ns - per_repeat))
        best = max(best, first + tail + (repeats - 1) * per_repeat + later)
        tail += repeats * per_repeat
        end = start
    return best


def _half(piece: Piece, first: bool) -> Piece:
    """One causal half of a piece's new tokens: the second half sees the first as context."""
    new, cached = piece[0], piece[1]
    a = new // 2
    part = (max(1, a), cached) if first else (new - a, cached + a)
    return (*part, piece[2]) if len(piece) == 3 else part  # type: ignore[misc]


def prefill_hardware(
    config: PrefillConfig, pod: PodConfig | None = None
) -> tuple[DieSpec, LinkSpec]:
    """The prefill die and the link its KV leaves by: UB inside the pod, RoCE from attached
    910B servers (P104), at the receiving 910C die's RDMA rate."""
    pod = pod or PodConfig()
    if config.hardware == "910b":
        return pod.b_die, pod.roce
    return pod.die, pod.ub


def prefill_tp_link(config: PrefillConfig, pod: PodConfig | None = None) -> LinkSpec:
    """The link inside one TP group of a Prefill TE (its ranks share a server): UB in the pod,
    HCCS in a 910B server."""
    pod = pod or PodConfig()
    return pod.hccs if config.hardware == "910b" else pod.ub


def prefill_te_link(config: PrefillConfig, pod: PodConfig | None = None) -> LinkSpec:
    """The link a Prefill TE's own all-to-all (dispatch, combine) and SP ring run over, per
    die: UB inside the pod. 910B dies sit 8 to a server on HCCS, and a TE of more spans
    servers joined by each die's scale-out RDMA: of a die's ``dies_per_te - 1`` peers, those
    in its server take their share of its bytes over HCCS and the rest over scale-out, both at
    once, so the rate is that of the slower share."""
    pod = pod or PodConfig()
    if config.hardware != "910b":
        return pod.ub
    peers = config.dies_per_te - 1
    inside = min(config.dies_per_te, 8) - 1
    outside = peers - inside
    if not outside:
        return pod.hccs
    per_byte = max(inside / peers / pod.hccs.bandwidth, outside / peers / pod.b_scale_out.bandwidth)
    return LinkSpec(
        name="910B HCCS + scale-out",
        bandwidth=1.0 / per_byte,
        latency_ns=pod.b_scale_out.latency_ns,
        source=f"{inside} of {peers} peers over {pod.hccs.name}, {outside} over "
        f"{pod.b_scale_out.name}",
    )
