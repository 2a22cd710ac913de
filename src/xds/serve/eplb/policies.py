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

Both select only replicas that fit. When several experts share a primary die, a free slot is
not free for everyone (the experts living on that die cannot use it), so a replica fits when
some placement holds it with those already chosen; an expert that no longer fits is passed over
(the next candidate gets the replica). Placement then puts each replica on the least-loaded die
that can take it; when none can, earlier replicas move along the shortest chain that frees a
slot for it (such a chain exists whenever the replicas fit), so the built-ins never fail on a
valid layout and use ``min(budget, slots the layout can fill)`` replicas when any expert may
take one (``deepseek-eplb``).

Users implement :class:`Policy` (one method), or write a plain function
``(counts, layout, budget) -> Plan``, to try their own: pass it to
:func:`~xds.serve.eplb.evaluate.score`, or :func:`register_policy` it under a name that
``OnlineEPLBConfig(policy=...)`` (and a TOML config) can then use.

Every plan that enters xds - from a built-in policy or your own - goes through
:func:`checked_plan` first (scoring and online EPLB alike): a plan that is not a :class:`Plan`,
lists a die out of range or one die twice for an expert, moves a primary, disagrees with its
``copies``, leaves an expert without a replica, exceeds the budget or a die's redundant slots is
a :class:`~xds.errors.ProtocolError` naming the policy, the layer and the expert.
"""

from __future__ import annotations

import difflib
import heapq
import inspect
import numbers
import operator
from collections.abc import Callable
from typing import Protocol

import msgspec
import numpy as np

from ...config import require_int
from ...errors import ConfigError, ProtocolError
from ..policies import binds


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

    def __post_init__(self) -> None:
        for name in ("n_dies", "spare_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"must be an integer, got {value!r}", field=name)
        if self.n_dies < 1:
            raise ConfigError(f"n_dies must be >= 1, got {self.n_dies}", field="n_dies")
        if self.spare_slots < 0:
            raise ConfigError(
                f"spare_slots (redundant slots per die) must be >= 0, got {self.spare_slots}",
                field="spare_slots",
            )
        primary = np.asarray(self.primary_die)
        if (
            primary.ndim != 1
            or primary.size == 0
            or not np.issubdtype(primary.dtype, np.integer)
            or not 0 <= primary.min() <= primary.max() < self.n_dies
        ):
            raise ConfigError(
                f"primary_die must list one integer die in 0..{self.n_dies - 1} per expert "
                "(at least one expert)",
                field="primary_die",
            )
        if self.base_load is not None:
            base = as_counts(self.base_load, "base_load")
            if base.shape != (self.n_dies,):
                raise ConfigError(
                    f"base_load must hold one load per die ({self.n_dies}), got shape {base.shape}",
                    field="base_load",
                )

    @classmethod
    def one_expert_per_die(cls, n_experts: int, n_dies: int, spare_slots: int = 1) -> Layout:
        n_experts = require_int(n_experts, "n_experts", low=1)
        if n_experts > n_dies:
            raise ConfigError(
                f"{n_experts} experts do not fit one per die on {n_dies} dies", field="n_dies"
            )
        return cls(np.arange(n_experts), n_dies, spare_slots)


class Policy(Protocol):
    name: str

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        """Replicas for one layer; ``counts[e, t]``; at most ``budget`` redundant replicas."""


PlanFunction = Callable[[np.ndarray, Layout, int], Plan]
"""A policy as a plain function: ``(counts[e, t], layout, budget) -> Plan``."""


class _Slots:
    """The redundant slots of one layer as they fill: which dies hold a copy of which expert
    and how many slots each die has left.

    A die can take a replica of ``e`` when it has a free slot and holds no copy of ``e``. On
    layouts where several experts share a primary die, a slot that is free is not free for
    everyone, so one more replica of ``e`` may still fit when no die can take it directly:
    another expert's replica moves out of the way, perhaps making a third one move, and so on
    until the chain ends at a die with a free slot. :meth:`room` searches for the shortest such
    chain (breadth first, an augmenting path of the flow from experts to dies); when there is
    none, no assignment of the replicas placed so far plus this one exists at all (max-flow
    min-cut), so the replica does not fit (and never will as more are added)."""

    def __init__(
        self,
        layout: Layout,
        die_load: np.ndarray | None = None,
        share: np.ndarray | None = None,
    ):
        """``die_load``: each die's load so far (updated as replicas land and move);
        ``share``: the load one replica of each expert adds to its die."""
        primary = np.asarray(layout.primary_die, dtype=np.int64)
        self.n_dies = layout.n_dies
        self.dies: list[list[int]] = [[int(d)] for d in primary]  # primary first
        self.holds = np.zeros((len(primary), layout.n_dies), dtype=bool)
        self.holds[np.arange(len(primary)), primary] = True
        self.free = np.full(layout.n_dies, layout.spare_slots, dtype=np.int64)
        self.open = layout.n_dies if layout.spare_slots else 0
        """Dies with a free slot."""
        self.guests: list[list[int]] = [[] for _ in range(layout.n_dies)]
        """Per die, the experts whose redundant replicas sit there (placement order)."""
        self.die_load = np.zeros(layout.n_dies) if die_load is None else die_load
        self.share = np.zeros(len(primary)) if share is None else share

    def open_dies(self, e: int) -> np.ndarray:
        """Dies that can take a replica of ``e`` as they are."""
        return (self.free > 0) & ~self.holds[e]

    def takes(self, e: int) -> bool:
        """Whether some die can take a replica of ``e`` as it is (more dies with a free slot
        than ``e`` has copies settles it without a look at the dies)."""
        return self.open > len(self.dies[e]) or bool(self.open_dies(e).any())

    def _move(self, e: int, src: int, dst: int) -> None:
        """Replica of ``e`` from ``src`` (-1: a new replica) to ``dst``."""
        if src < 0:
            self.dies[e].append(dst)
        else:
            self.dies[e][self.dies[e].index(src)] = dst
            self.holds[e, src] = False
            self.guests[src].remove(e)
            self.open += self.free[src] == 0
            self.free[src] += 1
            self.die_load[src] -= self.share[e]
        self.holds[e, dst] = True
        self.guests[dst].append(e)
        self.free[dst] -= 1
        self.open -= self.free[dst] == 0
        self.die_load[dst] += self.share[e]

    def _by_load(self, dies: np.ndarray) -> list[int]:
        """``dies`` least loaded first, ties to the lowest die."""
        return [int(d) for d in dies[np.lexsort((dies, self.die_load[dies]))]]

    def room(self, e: int) -> list[tuple[int, int, int]] | None:
        """The moves that fit one more replica of ``e``, as ``(expert, from die or -1 for
        the new replica, to die)``: the least-loaded die that can take it as it is (ties to
        the lowest die), else the shortest chain of other replicas moving out of the way;
        None if it cannot fit. Changes nothing."""
        ok = self.open_dies(e)
        if ok.any():
            return [(e, -1, int(np.argmin(np.where(ok, self.die_load, np.inf))))]
        # breadth first from e: die d is reachable from expert x when x holds no copy on d;
        # a full die leads on to the experts whose redundant replicas could leave it
        came_to: dict[int, int] = {}  # die -> expert that would move there
        came_from: dict[int, int] = {e: -1}  # expert -> die it would leave (-1: new replica)
        seen = np.zeros(self.n_dies, dtype=bool)
        frontier = [e]
        while frontier:
            nxt: list[int] = []
            for x in frontier:
                reach = ~self.holds[x] & ~seen
                if not reach.any():
                    continue
                seen |= reach
                ordered = self._by_load(np.nonzero(reach)[0])
                for d in ordered:
                    came_to[d] = x
                end = next((d for d in ordered if self.free[d] > 0), None)
                if end is not None:  # walk back: each mover leaves the die the next one takes
                    moves: list[tuple[int, int, int]] = []
                    dst = end
                    while dst >= 0:
                        mover = came_to[dst]
                        moves.append((mover, came_from[mover], dst))
                        dst = came_from[mover]
                    return moves
                for d in ordered:
                    for f in self.guests[d]:
                        if f not in came_from:
                            came_from[f] = d
                            nxt.append(f)
            frontier = nxt
        return None

    def put(self, e: int) -> bool:
        """Place one more replica of ``e`` (:meth:`room`); False if it cannot fit."""
        moves = self.room(e)
        if moves is None:
            return False
        for x, src, dst in moves:
            self._move(x, src, dst)
        return True


def _place(order: list[int], copies: np.ndarray, load: np.ndarray, layout: Layout) -> Plan:
    """Largest first onto the least-loaded die with a free slot (no two replicas of one
    expert on a die); ties to the lowest die. A die starts with the summed load of its
    primary expert plus its base load (A26). When no die that could take a replica has a free
    slot, earlier replicas move along the shortest chain that frees one (:class:`_Slots`), so
    any ``copies`` that some placement can hold gets placed."""
    e_count = len(copies)
    die_load = (
        np.zeros(layout.n_dies)
        if layout.base_load is None
        else np.asarray(layout.base_load, dtype=np.float64).copy()
    )
    for e in range(e_count):
        die_load[layout.primary_die[e]] += load[e]
    share = np.asarray(load, dtype=np.float64) / np.asarray(copies, dtype=np.float64)
    slots = _Slots(layout, die_load, share)
    for e in order:
        if not slots.put(e):
            raise ConfigError(
                f"expert {e}: no die can hold another replica of it (every die without a copy "
                f"of it has its {layout.spare_slots} redundant slot(s) taken, by replicas that "
                "cannot move elsewhere)",
                field="layout",
            )
    return Plan(copies.astype(np.int64), slots.dies)


class _Fit:
    """Which experts can still take one more replica, given those selected so far: selection
    keeps a placement of its replicas (:class:`_Slots`) as proof that they fit. Once an expert
    does not fit, it never will (more replicas only take room), so it is marked ``full``."""

    def __init__(self, layout: Layout):
        self.slots = _Slots(layout)
        self.full = np.zeros(len(layout.primary_die), dtype=bool)

    def add(self, e: int) -> bool:
        """Select one more replica of ``e`` if it fits; False (and ``full[e]``) if not."""
        if self.full[e]:
            return False
        if self.slots.put(e):
            return True
        self.full[e] = True
        return False

    def can_add(self, e: int) -> bool:
        """Whether one more replica of ``e`` fits (without selecting it)."""
        if self.full[e] or self.slots.takes(e):
            return not self.full[e]
        if self.slots.room(e) is None:
            self.full[e] = True
        return not self.full[e]


def as_counts(counts: object, field: str = "counts") -> np.ndarray:
    """Token counts as a float64 array: numeric, finite and non-negative."""
    try:
        arr = np.asarray(counts, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("counts must be numbers", field=field) from None
    if arr.size and (not np.isfinite(arr).all() or arr.min() < 0):
        raise ConfigError("counts must be finite and >= 0", field=field)
    return arr


def replica_budget(budget: object) -> int:
    """A redundant-replica budget: a non-negative integer."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise ConfigError(f"budget must be an integer >= 0, got {budget!r}", field="budget")
    return int(budget)


def _check(counts: np.ndarray, layout: Layout, budget: int) -> int:
    if counts.ndim != 2 or counts.shape[0] != len(layout.primary_die):
        raise ConfigError(f"counts must be [experts, slices], got {counts.shape}", field="counts")
    return min(replica_budget(budget), layout.n_dies * layout.spare_slots)


class NoBalancing:
    name = "none"

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        counts = as_counts(counts)
        _check(counts, layout, budget)
        e = counts.shape[0]
        return Plan(np.ones(e, np.int64), [[int(layout.primary_die[i])] for i in range(e)])


class XdsGreedy:
    """xDeepServe's greedy over time slices (SPEC 7.3)."""

    name = "xds-greedy"

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        counts = as_counts(counts)
        budget = _check(counts, layout, budget)
        counts = counts.astype(np.float64)
        copies = np.ones(counts.shape[0])
        fits = _Fit(layout)
        select = self._one_slice if counts.shape[1] == 1 else self._by_slices
        chosen = select(counts, copies, fits, budget)
        total = counts.sum(axis=1)
        order = sorted(chosen, key=lambda e: (-total[e], e))  # by total load (SPEC 7.3)
        return _place(order, copies, total, layout)

    @staticmethod
    def _by_slices(counts: np.ndarray, copies: np.ndarray, fits: _Fit, budget: int) -> list[int]:
        """Up to ``budget`` redundant replicas, one at a time: among the experts that are the
        hottest in some slice, the one whose extra replica leaves the lowest sum over slices
        of the hottest per-replica load (ties to the lowest id). Modifies ``copies``."""
        n_e = counts.shape[0]
        chosen: list[int] = []
        per_replica = counts / copies[:, None]  # always from the original counts (A12)
        for _ in range(budget):
            hottest = per_replica.max(axis=0)
            if not hottest.any():
                break  # no load left to split: a replica would balance nothing
            # every expert that is the hottest in some slice with load (ties included): in an
            # idle slice every expert ties at zero, and a replica there balances nothing
            hot = (per_replica == hottest) & (hottest > 0)
            candidates = np.flatnonzero(hot.any(axis=1)).tolist()
            ok = [c for c in candidates if fits.can_add(c)]  # ascending: ties to the lowest
            if not ok:
                break  # no candidate can take another replica
            # a candidate's score is the sum over slices of the hottest replica once it has one
            # more copy: where it was the hottest, the next one down (a tie: the same value)
            runner_up = (
                np.partition(per_replica, -2, axis=0)[-2]
                if n_e > 1
                else np.full_like(hottest, -np.inf)
            )
            rest = np.where(per_replica[ok] == hottest, runner_up, hottest)
            scores = np.maximum(rest, counts[ok] / (copies[ok] + 1)[:, None]).sum(axis=1)
            best = ok[int(np.argmin(scores))]
            fits.add(best)
            copies[best] += 1
            per_replica[best] = counts[best] / copies[best]
            chosen.append(best)
        return chosen

    @staticmethod
    def _one_slice(counts: np.ndarray, copies: np.ndarray, fits: _Fit, budget: int) -> list[int]:
        """:meth:`_by_slices` for a single time slice, where it reduces to: the hottest
        replica's expert, the lowest id among ties that can take one more (each tied
        candidate's score is the tie's load; a lone one's is all there is to choose), kept
        in a heap rather than scanned per replica. Modifies ``copies``."""
        heap = [(-c, e) for e, c in enumerate((counts[:, 0] / copies).tolist())]
        heapq.heapify(heap)
        chosen: list[int] = []
        for _ in range(budget):
            top = heap[0][0]
            if not top < 0:
                break  # no load left to split: a replica would balance nothing
            tied = []
            while heap and heap[0][0] == top:
                tied.append(heapq.heappop(heap)[1])  # ascending expert ids
            ok = [c for c in tied if fits.can_add(c)]
            if not ok:
                break  # no candidate can take another replica
            best = ok[0]
            fits.add(best)
            copies[best] += 1
            chosen.append(best)
            for e in tied:
                load = counts[e, 0] / copies[e] if e == best else -top
                heapq.heappush(heap, (-load, e))
        return chosen


class DeepSeekEPLB:
    """The global policy of DeepSeek's open-source EPLB, from its public description."""

    name = "deepseek-eplb"

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        counts = as_counts(counts)
        budget = _check(counts, layout, budget)
        w = counts.sum(axis=1).astype(np.float64)
        copies = np.ones(len(w))
        fits = _Fit(layout)
        chosen: list[int] = []
        for _ in range(budget):
            per = np.where(fits.full, -np.inf, w / copies)
            e = int(np.argmax(per))  # first index on ties
            while per[e] > 0 and not fits.add(e):
                per[e] = -np.inf  # no room for another replica of e: the next heaviest
                e = int(np.argmax(per))
            if per[e] <= 0:
                break  # no loaded expert can take one: a replica would balance nothing
            copies[e] += 1
            chosen.append(e)
        order = sorted(chosen, key=lambda e: (-w[e] / copies[e], e))  # per-replica load
        return _place(order, copies, w, layout)


POLICIES: dict[str, Policy] = {p.name: p for p in (XdsGreedy(), DeepSeekEPLB(), NoBalancing())}
"""The built-in policies (what ``xds reproduce eplb`` compares). Add your own with
:func:`register_policy`, not by editing this dict."""

_REGISTERED: dict[str, Policy] = {}


class FunctionPolicy:
    """A :class:`Policy` made from a name and a ``(counts, layout, budget) -> Plan`` function."""

    def __init__(self, name: str, fn: PlanFunction):
        self.name = name
        self.fn = fn

    def plan(self, counts: np.ndarray, layout: Layout, budget: int) -> Plan:
        return self.fn(counts, layout, budget)

    def __repr__(self) -> str:
        return f"FunctionPolicy({self.name!r}, {getattr(self.fn, '__qualname__', self.fn)!r})"


def policy_names() -> list[str]:
    """Every name :func:`policy` knows: the built-ins, then the registered ones."""
    return [*POLICIES, *_REGISTERED]


def policy(name: str | Policy | PlanFunction) -> Policy:
    """The policy called ``name`` (built in or registered); a :class:`Policy` object is
    returned as is, and a plain ``(counts, layout, budget) -> Plan`` function is wrapped
    (named after the function)."""
    if isinstance(name, str):
        found = POLICIES.get(name) or _REGISTERED.get(name)
        if found is None:
            close = difflib.get_close_matches(name, policy_names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown EPLB policy {name!r}{hint}; known: {', '.join(policy_names())} "
                "(add yours with xds.serve.eplb.register_policy; from the command line, in a "
                "module loaded with xds --import MODULE)",
                field="policy",
            )
        return found
    plan = getattr(name, "plan", None)
    if callable(plan):
        if isinstance(getattr(name, "name", None), str):
            return name  # type: ignore[return-value]
        return FunctionPolicy(type(name).__name__, plan)
    if callable(name):
        return FunctionPolicy(getattr(name, "__name__", repr(name)), name)
    raise ConfigError(
        "an EPLB policy is a name, an object with plan(counts, layout, budget) -> Plan, or a "
        f"function (counts, layout, budget) -> Plan; got {type(name).__name__} {name!r:.80}",
        field="policy",
    )


def register_policy(name: str, fn: Policy | PlanFunction, *, replace: bool = False) -> Policy:
    """Make ``fn`` available as the EPLB policy ``name`` (for :func:`policy`,
    ``OnlineEPLBConfig(policy=name)`` and configs loaded from TOML/JSON). ``fn`` is a
    ``(counts, layout, budget) -> Plan`` function or a :class:`Policy` object. Built-in names
    cannot be taken; an already registered name only with ``replace=True``. Returns the
    registered policy (whose ``name`` is ``name``)."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ConfigError(
            f"a policy name is a non-empty string without surrounding spaces, got {name!r}",
            field="name",
        )
    if name in POLICIES:
        raise ConfigError(f"{name!r} is a built-in EPLB policy; choose another name", field="name")
    if name in _REGISTERED and not replace:
        raise ConfigError(
            f"EPLB policy {name!r} is already registered ({_REGISTERED[name]!r}); "
            "pass replace=True to replace it",
            field="name",
        )
    if isinstance(fn, str) or not (callable(getattr(fn, "plan", None)) or callable(fn)):
        raise ConfigError(
            "register a function (counts, layout, budget) -> Plan or an object with "
            f"plan(counts, layout, budget) -> Plan; got {type(fn).__name__} {fn!r:.80}",
            field="fn",
        )
    plan = getattr(fn, "plan", None)
    target = plan if callable(plan) else fn
    if inspect.iscoroutinefunction(target) or binds(target, 3) is False:
        raise ConfigError(
            f"EPLB policy {name!r}: {getattr(target, '__name__', target)!r} must be a plain "
            "function taking (counts, layout, budget)",
            field="fn",
        )
    registered = FunctionPolicy(name, target)  # type: ignore[arg-type]
    _REGISTERED[name] = registered
    return registered


def unregister_policy(name: str) -> None:
    """Forget the registered policy ``name`` (built-ins stay)."""
    if name not in _REGISTERED:
        raise ConfigError(
            f"no registered EPLB policy {name!r}; registered: {', '.join(_REGISTERED) or 'none'}",
            field="name",
        )
    del _REGISTERED[name]


def _whole(value: object) -> int | None:
    """``value`` as an int when it is a whole number (not a bool), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        pass
    if isinstance(value, float | np.floating) and float(value).is_integer():
        return int(value)
    return None


def checked_plan(
    plan: object,
    *,
    policy: str,
    layer: int,
    layout: Layout,
    budget: int | None,
    where: str | None = None,
) -> Plan:
    """``plan``, the answer of policy ``policy`` for ``layer``, checked and normalised
    (``copies`` as int64, dies as Python ints). Raises :class:`~xds.errors.ProtocolError`
    naming the policy (or ``where`` the plan came from), the layer, the expert and what is
    wrong."""
    where = where or f"EPLB policy {policy!r}, layer {layer}"
    n_e, n_d = len(layout.primary_die), layout.n_dies

    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"{where}: {what}")

    if not isinstance(plan, Plan):
        shown = repr(plan)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        got = "None" if plan is None else f"a {type(plan).__name__} ({shown})"
        raise bad(f"returned {got}, not a Plan")
    raw = plan.replica_dies
    if not isinstance(raw, list | tuple) or len(raw) != n_e:
        got = f"{len(raw)} entries" if isinstance(raw, list | tuple) else type(raw).__name__
        raise bad(f"replica_dies must hold one list of dies per expert ({n_e}), got {got}")
    copies = np.asarray(plan.copies)
    if copies.shape != (n_e,):
        raise bad(f"copies must have one entry per expert ({n_e}), got shape {copies.shape}")
    if n_e and not (
        np.issubdtype(copies.dtype, np.integer)
        or (np.issubdtype(copies.dtype, np.floating) and np.all(copies == np.round(copies)))
    ):
        raise bad(f"copies must be whole numbers, got {copies.dtype} values")
    dies_of: list[list[int]] = []
    for e, dies in enumerate(raw):
        if not isinstance(dies, list | tuple | np.ndarray):
            raise bad(f"expert {e}: replica_dies[{e}] must be a list of dies, got {dies!r:.60}")
        if len(dies) == 0:
            raise bad(f"expert {e} has no replica (every expert keeps at least its primary)")
        ds = [_whole(d) for d in dies]
        for d, given in zip(ds, dies, strict=True):
            if d is None:
                raise bad(f"expert {e}: die {given!r} is not an integer")
            if not 0 <= d < n_d:
                raise bad(f"expert {e}: die {d} is out of range (dies 0..{n_d - 1})")
        dies_i: list[int] = ds  # type: ignore[assignment]
        if dies_i[0] != int(layout.primary_die[e]):
            raise bad(
                f"expert {e}: its first replica must be its primary on die "
                f"{int(layout.primary_die[e])}, got die {dies_i[0]}"
            )
        if len(set(dies_i)) != len(dies_i):
            twice = next(d for d in dies_i if dies_i.count(d) > 1)
            raise bad(
                f"expert {e}: die {twice} listed twice (two replicas of one expert cannot "
                "share a die)"
            )
        c = _whole(copies[e])
        if c != len(dies_i):
            n = len(dies_i)
            raise bad(
                f"expert {e}: copies[{e}] is {copies[e]} but replica_dies[{e}] lists {n} "
                f"die{'s' if n != 1 else ''} {dies_i}"
            )
        dies_of.append(dies_i)
    redundant = sum(len(d) - 1 for d in dies_of)
    if budget is not None and redundant > budget:
        seen, over = 0, -1
        for e, dies_i in enumerate(dies_of):
            seen += len(dies_i) - 1
            if seen > budget:
                over = e
                break
        raise bad(
            f"{redundant} redundant replicas, over the budget of {budget} (expert {over}'s "
            "replicas are the first beyond it)"
        )
    used = np.zeros(n_d, dtype=np.int64)
    for e, dies_i in enumerate(dies_of):
        for d in dies_i[1:]:
            used[d] += 1
            if used[d] > layout.spare_slots:
                n = layout.spare_slots
                if not n:
                    raise bad(f"expert {e}: die {d} has no redundant slot (spare_slots = 0)")
                taken = "it is taken" if n == 1 else "they are all taken"
                raise bad(
                    f"expert {e}: die {d} has {n} redundant slot{'s' if n != 1 else ''} and "
                    f"{taken} by other experts' replicas"
                )
    return Plan(copies.astype(np.int64), dies_of)


def plan_layer(pol: Policy, counts: np.ndarray, layout: Layout, budget: int, *, layer: int) -> Plan:
    """``pol``'s plan for one layer, checked (:func:`checked_plan`): the one way plans enter
    scoring and online EPLB."""
    name = getattr(pol, "name", type(pol).__name__)
    counts = as_counts(counts)
    budget = replica_budget(budget)
    # the policy gets copies: whatever it writes into them cannot reach the caller's arrays
    # or the layout its plan is checked against
    mine = msgspec.structs.replace(
        layout,
        primary_die=np.array(layout.primary_die, copy=True),
        base_load=None if layout.base_load is None else np.array(layout.base_load, copy=True),
    )
    try:
        plan = pol.plan(np.array(counts, copy=True), mine, budget)
    except ConfigError as exc:  # printed as one line (the message alone): say whose it is
        raise ConfigError(
            f"EPLB policy {name!r} planning layer {layer}: {exc.message}",
            field=exc.field,
            source=exc.source,
        ) from exc
    except Exception as exc:
        exc.add_note(f"(raised by the EPLB policy {name!r} planning layer {layer})")
        exc.xds_policy = "eplb"  # type: ignore[attr-defined]  # the CLI reports it briefly
        raise
    return checked_plan(
        plan,
        policy=name,
        layer=layer,
        layout=layout,
        budget=budget,
    )


def balancedness(plan: Plan, load: np.ndarray, n_dies: int) -> float:
    """Mean over max of per-die load (SGLang's definition; 1 is perfect)."""
    d = plan.die_loads(load, n_dies)
    return float(d.mean() / d.max()) if d.max() > 0 else 1.0
