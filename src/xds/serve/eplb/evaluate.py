"""Comparing balancing policies on the same held-out window (REFERENCE.md "fair comparison").

Each policy plans on a fit window of the load tensor and is evaluated on the next window:
per layer, the per-die load when each expert's tokens split evenly over its replicas,
balancedness (mean/max die load), and the modelled time of the busiest die's expert GEMM.
:func:`forward_latency` then runs the decode iteration model of :mod:`xds.serve.decode` with
the placement: the busiest die per layer sets the MoE time, and dispatch/combine are measured
on the collective tier with the skewed routing and the replicas in the expert map.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ...config import is_integer, require_int
from ...errors import ConfigError, ProtocolError
from ...fabric.xccl.moe import ExpertMap
from ..decode import DecodeConfig, DecodeModel, measure_comm
from .policies import (
    Layout,
    Plan,
    PlanFunction,
    Policy,
    as_counts,
    balancedness,
    checked_plan,
    plan_layer,
)
from .policies import policy as resolve_policy


class PolicyScore(msgspec.Struct):
    name: str
    balancedness_mean: float
    balancedness_min: float
    moe_ms: float
    """Busiest die's expert GEMM summed over the MoE layers, at peak-decode tokens per die."""
    replicas_used: int


def _counts(name: str, counts: np.ndarray, n_experts: int) -> np.ndarray:
    counts = as_counts(counts, name)
    if counts.ndim != 3 or counts.shape[2] != n_experts:
        raise ConfigError(
            f"must be [time_slice, layer, expert] counts with {n_experts} experts, got shape "
            f"{counts.shape}",
            field=name,
        )
    if counts.shape[0] == 0 or not counts.any():
        what = "no time slice" if counts.shape[0] == 0 else "no routed token"
        use = "plan from" if name == "fit" else "score on"
        raise ConfigError(f"holds {what}: there is nothing to {use}", field=name)
    return counts


def _is(value: object, kind: type, field: str) -> None:
    if not isinstance(value, kind):
        raise ConfigError(
            f"must be a {kind.__name__}, got {type(value).__name__} {value!r:.60}", field=field
        )


def _matches(layout: Layout, config: DecodeConfig) -> None:
    """``layout`` is one MoE layer of the deployment ``config`` describes: the same routed
    experts, dies and (with online EPLB configured) redundant slots per die."""
    _is(config, DecodeConfig, "config")
    _is(layout, Layout, "layout")
    m = config.spec
    n_e = len(layout.primary_die)
    if n_e != m.routed_experts:
        raise ConfigError(
            f"{n_e} experts, but config.model ({m.name}) has {m.routed_experts} routed experts",
            field="layout.primary_die",
        )
    if layout.n_dies != config.dies:
        raise ConfigError(
            f"{layout.n_dies} dies, but config.dies is {config.dies}", field="layout.n_dies"
        )
    if config.eplb is not None and layout.spare_slots != config.eplb.spare_slots:
        n = layout.spare_slots
        raise ConfigError(
            f"{n} redundant slot{'s' if n != 1 else ''} per die, but config.eplb.spare_slots "
            f"is {config.eplb.spare_slots}",
            field="layout.spare_slots",
        )


def plan_layers(
    policy: str | Policy | PlanFunction,
    fit: np.ndarray,
    layout: Layout,
    budget: int,
    shared_dies: int = 0,
) -> list[Plan]:
    """One plan per MoE layer from ``fit[t, l, e]``, each checked
    (:func:`~xds.serve.eplb.policies.checked_plan`). The last ``shared_dies`` dies carry a
    shared-expert instance: a load equal to the mean routed expert's (every token visits one
    of them), which placement takes into account. ``policy`` is a name, a
    :class:`~xds.serve.eplb.policies.Policy` or a ``(counts, layout, budget) -> Plan``
    function."""
    pol = resolve_policy(policy)
    _is(layout, Layout, "layout")
    if not is_integer(shared_dies) or not 0 <= shared_dies < layout.n_dies:
        raise ConfigError(
            f"must be an integer in 0..{layout.n_dies - 1} (dies carrying a shared-expert "
            f"instance, fewer than the layout's {layout.n_dies}), got {shared_dies!r}",
            field="shared_dies",
        )
    fit = _counts("fit", fit, len(layout.primary_die))
    plans = []
    for layer in range(fit.shape[1]):
        counts = fit[:, layer].T
        lay = layout
        if shared_dies:
            base = np.zeros(layout.n_dies)
            base[layout.n_dies - shared_dies :] = counts.sum() / counts.shape[0]
            lay = msgspec.structs.replace(layout, base_load=base)
        plans.append(plan_layer(pol, counts, lay, budget, layer=layer))
    return plans


def die_shares(plans: list[Plan], evaluation: np.ndarray, n_dies: int) -> np.ndarray:
    """[layers, dies]: each die's share of the layer's routed copies in the evaluation window."""
    load = evaluation.sum(axis=0).astype(np.float64)  # [layers, experts]
    out = np.zeros((len(plans), n_dies))
    for layer, plan in enumerate(plans):
        total = load[layer].sum()
        out[layer] = plan.die_loads(load[layer] / max(total, 1.0), n_dies)
    return out


def score(
    policy: str | Policy | PlanFunction,
    fit: np.ndarray,
    evaluation: np.ndarray,
    layout: Layout,
    budget: int,
    config: DecodeConfig,
) -> tuple[PolicyScore, list[Plan]]:
    """Plan on ``fit`` and score on ``evaluation`` (both ``[time_slice, layer, expert]``
    over every MoE layer of ``config``'s model); ``policy`` is a name, a Policy or a plan
    function. ``layout`` must be the deployment's: ``config``'s routed experts and dies (and
    its online EPLB's redundant slots per die, when it has one); a mismatch is a
    :class:`~xds.errors.ConfigError` naming the field and both values."""
    pol = resolve_policy(policy)
    _matches(layout, config)
    fit = _counts("fit", fit, len(layout.primary_die))
    evaluation = _counts("evaluation", evaluation, len(layout.primary_die))
    if evaluation.shape[1] != fit.shape[1]:
        raise ConfigError(
            f"has {evaluation.shape[1]} layers but fit has {fit.shape[1]}", field="evaluation"
        )
    m = config.spec
    if fit.shape[1] != m.moe_layers:
        raise ConfigError(
            f"has {fit.shape[1]} MoE layers, but config.model ({m.name}) has {m.moe_layers} "
            "(the score sums the busiest die's expert time over every MoE layer of the model)",
            field="fit",
        )
    plans = plan_layers(pol, fit, layout, budget, config.shared_expert_dies)
    load = evaluation.sum(axis=0)
    bal = [balancedness(p, load[layer], layout.n_dies) for layer, p in enumerate(plans)]
    model = DecodeModel(config, comm=None)  # type: ignore[arg-type]
    tokens = config.dies * config.batch_per_die * (1 + config.mtp_config.k) * config.spec.top_k
    shares = die_shares(plans, evaluation, layout.n_dies)
    moe = sum(model.expert_ns(float(s.max() * tokens)) for s in shares)
    used = int(sum(int(p.copies.sum()) - len(p.copies) for p in plans))
    return PolicyScore(pol.name, float(np.mean(bal)), float(np.min(bal)), moe / 1e6, used), plans


def expert_map_for(plan: Plan, n_routed: int, n_shared: int, n_dies: int) -> ExpertMap:
    """The EP group's map: routed experts (primary + replicas) then shared instances."""
    replicas: list[list[int]] = []
    slots_rank: list[int] = []
    for dies in plan.replica_dies:
        ids = []
        for d in dies:
            ids.append(len(slots_rank))
            slots_rank.append(d)
        replicas.append(ids)
    for i in range(n_shared):
        replicas.append([len(slots_rank)])
        slots_rank.append(n_dies - n_shared + i)
    return ExpertMap(n_routed + n_shared, n_dies, replicas=replicas, slots_rank=slots_rank)


def forward_latency(
    config: DecodeConfig,
    plans: list[Plan],
    evaluation: np.ndarray,
    *,
    seed: int = 0,
    layout: Layout | None = None,
    budget: int | None = None,
) -> float:
    """Iteration time (ns) of decode at the config's batch with this placement: one plan per
    MoE layer of the model, and ``evaluation[t, l, e]`` counts over those layers.

    Each plan is checked as a policy's is (:func:`~xds.serve.eplb.policies.checked_plan`)
    against ``layout`` (default: the deployment's, one routed expert per die with one
    redundant slot, or its online EPLB's ``spare_slots``) and ``budget`` redundant replicas
    (default: what the slots hold): a plan no placement can hold is a
    :class:`~xds.errors.ConfigError` naming ``plans[layer]``, never a price."""
    m = config.spec
    n = config.dies
    evaluation = _counts("evaluation", evaluation, m.routed_experts)
    if evaluation.shape[1] != m.moe_layers:
        raise ConfigError(
            f"has {evaluation.shape[1]} MoE layers, but {m.name} has {m.moe_layers} "
            "(forward latency needs counts for every MoE layer of the model)",
            field="evaluation",
        )
    if len(plans) != m.moe_layers:
        raise ConfigError(
            f"{len(plans)} plans for the {m.moe_layers} MoE layers of {m.name} (one per layer)",
            field="plans",
        )
    for layer, plan in enumerate(plans):
        _is(plan, Plan, f"plans[{layer}]")
        if len(plan.replica_dies) != m.routed_experts:
            raise ConfigError(
                f"places {len(plan.replica_dies)} experts, but config.model ({m.name}) has "
                f"{m.routed_experts} routed experts",
                field=f"plans[{layer}]",
            )
        for e, dies in enumerate(plan.replica_dies):
            if len(dies) == 0:
                raise ConfigError(
                    f"expert {e} has no die (every expert keeps at least its primary)",
                    field=f"plans[{layer}]",
                )
            for d in dies:
                if not is_integer(d) or not 0 <= d < n:
                    shown = int(d) if is_integer(d) else repr(d)
                    raise ConfigError(
                        f"uses die {shown}, but config.dies is {n} (dies 0..{n - 1}; expert {e})",
                        field=f"plans[{layer}]",
                    )
    if layout is None:
        spare = config.eplb.spare_slots if config.eplb is not None else 1
        layout = Layout.one_expert_per_die(m.routed_experts, n, spare)
    _matches(layout, config)
    if budget is not None:
        budget = require_int(budget, "budget")
    checked = []
    for layer, plan in enumerate(plans):
        try:
            checked.append(
                checked_plan(
                    plan, policy="", layer=layer, layout=layout, budget=budget, where="the plan"
                )
            )
        except ProtocolError as exc:
            raise ConfigError(str(exc), field=f"plans[{layer}]") from None
    plans = checked
    shares = die_shares(plans, evaluation, n)
    load = evaluation.sum(axis=0).astype(np.float64)
    # dispatch/combine on the layer with the median imbalance, replicas in the expert map
    ratio = load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12)
    rep = int(np.argsort(ratio)[len(ratio) // 2])
    popularity = load[rep] / load[rep].sum()
    emap = expert_map_for(plans[rep], m.routed_experts, config.shared_expert_dies, n)
    tokens = config.batch_per_die * (1 + config.mtp_config.k)
    comm = measure_comm(config, tokens, seed=seed, expert_map=emap, popularity=popularity)
    comm_mtp = measure_comm(
        config, config.batch_per_die, seed=seed, expert_map=emap, popularity=popularity
    )
    model = DecodeModel(config, comm, comm_mtp)
    model.routed_die_share = shares
    seqs = np.full(n, config.batch_per_die)
    context = np.full(n, config.input_tokens + config.output_tokens // 2)
    out = model.iteration(seqs, context, np.zeros(n, dtype=np.int64), np.random.default_rng(seed))
    return float(out.time_ns)
