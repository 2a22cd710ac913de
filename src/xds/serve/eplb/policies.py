"""Replica selection and placement policies (SPEC 7.3; REFERENCE.md "DeepSeek EPLB").

A policy turns one layer's load ``counts[e, t]`` (logical expert x time slice) into a
:class:`Plan`: which experts get how many replicas (within the redundancy budget) and on which
die each replica lives. Every die has ``primary`` slots (its own experts, fixed) and ``spare``
redundant slots; a redundant slot may hold any expert (A26), but never a second copy of an
expert the die already holds. Per-replica load is ``load / copies`` computed from the original
counts every time (the A12 fix).

* :class:`XdsGreedy` - xDeepServe's greedy: candidates are each slice's hottest expert; add the
  replica that most reduces ``sum_t max_e load[e, t] / copies[e]``; then place replicas largest
  first on the least-loaded die with a free slot.
* :class:`DeepSeekEPLB` - written from the public description of DeepSeek's EPLB (global
  policy): add replicas to the expert with the highest per-replica aggregate load, then balanced
  packing (largest first onto the least-loaded die with room).
* :class:`NoBalancing` - primaries only.

Users implement :class:`Policy` (one method) to try their own.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np

from ...errors import ConfigError


class Plan(msgspec.Struct):
    """One layer's replicas: ``copies[e]`` per logical expert and the die of each replica."""

    copies: np.ndarray  # [E]
    replica_dies: list[list[int]]  # per expert: dies of its replicas, primary first

    def die_loads(self, load: np.ndarray, n_dies: int) -> np.ndarray:
        """Per-die load when each expert's ``load`` splits evenly over its replicas."""
        out = np.zeros(n_dies)
        for e, dies in enumerate(self.replica_dies):
            share = load[e] / len(dies)
            for d in dies:
                out[d] += share
        return out


class Layout(msgspec.Struct, frozen=True):
    """Dies, their primary experts and spare slots (one layer)."""

    primary_die: np.ndarray  # [E]: the die holding each logical expert's primary
    n_dies: int
    spare_slots: int
    base_load: np.ndarray | None = None
    """Load a die carries besides routed experts (e.g. a shared-expert instance), [n_dies]."""

    @classmethod
    def one_expert_per_die(cls, n_experts: int, n_dies: int, spare_slots: int = 1) -> Layout:
        if n_experts > n_dies:
            raise ConfigError(
                f"{n_experts} experts do not fit one per die on {n_dies} dies", field="n_dies"
            )
        return cls(np.arange(n_experts), n_dies, spare_slots)


class Policy(Protocol):
    name: str

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        """Replicas for one layer; ``counts[e, t]``; at most ``budget`` redundant replicas."""


def _place(order: list[int], copies: np.ndarray, load: np.ndarray, layout: Layout) -> Plan:
    """Largest first onto the least-loaded die with a free slot (no two replicas of one
    expert on a die); ties to the lowest die. A die starts with the summed load of its
    primary expert plus its base load (A26)."""
    e_count = len(copies)
    replica_dies = [[int(layout.primary_die[e])] for e in range(e_count)]
    die_load = (
        np.zeros(layout.n_dies)
        if layout.base_load is None
        else np.asarray(layout.base_load, dtype=np.float64).copy()
    )
    for e in range(e_count):
        die_load[layout.primary_die[e]] += load[e]
    free = np.full(layout.n_dies, layout.spare_slots)
    for e in order:
        ok = free > 0
        ok[replica_dies[e]] = False
        if not ok.any() and not _make_room(e, replica_dies, free, die_load, load, copies):
            raise ConfigError("no free redundant slot left for a replica", field="budget")
        ok = free > 0
        ok[replica_dies[e]] = False
        cand = np.where(ok, die_load, np.inf)
        d = int(np.argmin(cand))
        replica_dies[e].append(d)
        free[d] -= 1
        die_load[d] += load[e] / copies[e]
    return Plan(copies.astype(np.int64), replica_dies)


def _make_room(
    e: int,
    replica_dies: list[list[int]],
    free: np.ndarray,
    die_load: np.ndarray,
    load: np.ndarray,
    copies: np.ndarray,
) -> bool:
    """The only free slots are on dies that already hold ``e``: move another expert's
    redundant replica from a die without ``e`` to one of those free slots (a die that expert
    does not use yet), freeing a slot ``e`` can take. Least-loaded source die first."""
    holds_e = set(replica_dies[e])
    targets = [int(d) for d in np.nonzero(free > 0)[0]]
    for src in sorted((d for d in range(len(free)) if d not in holds_e), key=die_load.__getitem__):
        for f, dies in enumerate(replica_dies):
            if src not in dies[1:]:  # only redundant replicas move; primaries stay
                continue
            dst = next((d for d in targets if d not in dies), None)
            if dst is None:
                continue
            dies[dies.index(src)] = dst
            free[src] += 1
            free[dst] -= 1
            share = load[f] / copies[f]
            die_load[src] -= share
            die_load[dst] += share
            return True
    return False


def _check(counts: np.ndarray, layout: Layout, budget: int) -> int:
    if counts.ndim != 2 or counts.shape[0] != len(layout.primary_die):
        raise ConfigError(f"counts must be [experts, slices], got {counts.shape}", field="counts")
    if budget < 0:
        raise ConfigError("budget must be >= 0", field="budget")
    return min(budget, layout.n_dies * layout.spare_slots)


class NoBalancing:
    name = "none"

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        _check(counts, layout, budget)
        e = counts.shape[0]
        return Plan(np.ones(e, np.int64), [[int(layout.primary_die[i])] for i in range(e)])


class XdsGreedy:
    """xDeepServe's greedy over time slices (SPEC 7.3)."""

    name = "xds-greedy"

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        budget = _check(counts, layout, budget)
        counts = counts.astype(np.float64)
        n_e = counts.shape[0]
        copies = np.ones(n_e)
        max_copies = 1 + min(layout.spare_slots * layout.n_dies, layout.n_dies - 1)
        chosen: list[int] = []
        for _ in range(budget):
            per_replica = counts / copies[:, None]  # always from the original counts (A12)
            hottest = per_replica.max(axis=0)
            # every expert that is the hottest in some slice (ties included)
            candidates = sorted({int(e) for e in np.nonzero(per_replica == hottest)[0]})
            best, best_score = -1, np.inf
            for c in candidates:
                if copies[c] + 1 > max_copies:
                    continue
                trial = per_replica.copy()
                trial[c] = counts[c] / (copies[c] + 1)
                score = trial.max(axis=0).sum()
                if score < best_score:  # ties go to the lower expert id (sorted order)
                    best, best_score = c, score
            if best < 0:
                break  # no feasible candidate
            copies[best] += 1
            chosen.append(best)
        total = counts.sum(axis=1)
        order = sorted(chosen, key=lambda e: (-total[e], e))  # by total load (SPEC 7.3)
        return _place(order, copies, total, layout)


class DeepSeekEPLB:
    """The global policy of DeepSeek's open-source EPLB, from its public description."""

    name = "deepseek-eplb"

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        budget = _check(counts, layout, budget)
        w = counts.sum(axis=1).astype(np.float64)
        copies = np.ones(len(w))
        max_copies = 1 + min(layout.spare_slots * layout.n_dies, layout.n_dies - 1)
        chosen: list[int] = []
        for _ in range(budget):
            per = np.where(copies < max_copies, w / copies, -np.inf)
            e = int(np.argmax(per))  # first index on ties
            if per[e] == -np.inf:
                break
            copies[e] += 1
            chosen.append(e)
        order = sorted(chosen, key=lambda e: (-w[e] / copies[e], e))  # per-replica load
        return _place(order, copies, w, layout)


POLICIES: dict[str, Policy] = {p.name: p for p in (XdsGreedy(), DeepSeekEPLB(), NoBalancing())}


def policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ConfigError(
            f"unknown EPLB policy {name!r}; known: {', '.join(POLICIES)}", field="policy"
        )
    return POLICIES[name]


def balancedness(plan: Plan, load: np.ndarray, n_dies: int) -> float:
    """Mean over max of per-die load (SGLang's definition; 1 is perfect)."""
    d = plan.die_loads(load, n_dies)
    return float(d.mean() / d.max()) if d.max() > 0 else 1.0
