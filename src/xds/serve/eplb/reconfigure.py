"""Four-phase expert reconfiguration with versioned mappings (SPEC 7.4, P077).

The logical-to-physical mapping of every MoE layer is an immutable :class:`Mapping` with a
version. A forward pass takes the current mapping once and uses it for all its layers and dies
(it is stamped with the version). Reconfiguring a redundant slot:

1. **prefetch** the new expert's weights from storage into host memory;
2. publish a mapping in which the affected slots are **disabled** (no replica points there),
   and let every pass that took an older mapping finish (it may still route to them, and
   their old weights serve it); a pass registers with :meth:`MappingTable.begin_pass`;
3. **load** the weights into the slots asynchronously (forward passes keep running);
4. publish a mapping that **re-enables** the slots with their new experts.

A die may have several redundant slots per layer (``spare_slots``); a replica that stays on a
die keeps its slot, and only the slots whose expert changes go through the four phases.

So no forward pass routes a token to a slot that is disabled or loading, every logical expert
keeps at least one enabled replica (its primary, which never moves) at every instant, and no
iteration waits for a weight load.
"""

from __future__ import annotations

from typing import Literal

import anyio
import msgspec

from ...errors import ConfigError
from ...runtime import emit, sleep_ns, waiting_for
from .policies import Plan

SlotState = Literal["enabled", "disabled", "loading", "empty"]


class Mapping(msgspec.Struct, frozen=True):
    """One version of the logical->physical table: per layer, per expert, replica dies."""

    version: int
    replicas: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][expert] -> dies

    def dies_of(self, layer: int, expert: int) -> tuple[int, ...]:
        return self.replicas[layer][expert]


class MappingTable:
    """The current mapping plus the state of every redundant slot (``spare_slots`` per die and
    layer)."""

    def __init__(self, primaries: list[list[int]], *, spare_slots: int = 1):
        """``primaries[layer][expert]``: the die holding the expert's primary."""
        if spare_slots < 0:
            raise ConfigError(f"must be >= 0, got {spare_slots}", field="spare_slots")
        self.layers = len(primaries)
        self.spare_slots = spare_slots
        self._current = Mapping(0, tuple(tuple((d,) for d in layer) for layer in primaries))
        self.primaries = primaries
        # (layer, die, slot) -> (expert or -1, state) of one of the die's redundant slots
        self.slots: dict[tuple[int, int, int], tuple[int, SlotState]] = {}
        self.history: list[Mapping] = [self._current]
        self._lock = anyio.Lock()  # one reconfiguration at a time
        self._passes: dict[int, int] = {}
        """Mapping version -> forward passes in flight that took it."""
        self._pass_ended = anyio.Event()

    @property
    def current(self) -> Mapping:
        return self._current

    def begin_pass(self) -> Mapping:
        """A forward pass starts: the mapping it uses for all its layers (held until
        :meth:`end_pass`; a reconfiguration loads no slot an older mapping routes to while a
        pass holds that mapping)."""
        m = self._current
        self._passes[m.version] = self._passes.get(m.version, 0) + 1
        return m

    def end_pass(self, mapping: Mapping) -> None:
        """The pass that took ``mapping`` has finished."""
        left = self._passes.get(mapping.version, 0) - 1
        if left < 0:
            raise ConfigError(
                f"end_pass for mapping v{mapping.version}: no pass holds it", field="mapping"
            )
        if left:
            self._passes[mapping.version] = left
        else:
            del self._passes[mapping.version]
        self._pass_ended.set()

    async def _drain(self, version: int) -> None:
        """Until no pass holds a mapping older than ``version``."""
        while any(v < version for v in self._passes):
            self._pass_ended = ended = anyio.Event()
            with waiting_for(f"forward passes on mappings older than v{version} to finish"):
                await ended.wait()

    def slot_states(self, layer: int, die: int) -> list[tuple[int, SlotState]]:
        """(expert or -1, state) of each redundant slot of ``die`` in ``layer``."""
        return [self.slots.get((layer, die, s), (-1, "empty")) for s in range(self.spare_slots)]

    def _serving(self) -> set[tuple[int, int, int]]:
        """(layer, die, expert) of every enabled redundant slot."""
        return {(layer, d, e) for (layer, d, _), (e, st) in self.slots.items() if st == "enabled"}

    def _publish(self, replicas: list[list[list[int]]]) -> Mapping:
        serving = self._serving()
        for layer, experts in enumerate(replicas):
            for e, dies in enumerate(experts):
                if not dies:
                    raise ConfigError(
                        f"layer {layer} expert {e} would have no enabled replica", field="plan"
                    )
                for d in dies[1:]:
                    if (layer, d, e) not in serving:
                        raise ConfigError(
                            f"layer {layer} die {d}: no enabled slot holds expert {e} "
                            f"(slots: {self.slot_states(layer, d)}), cannot serve tokens",
                            field="plan",
                        )
        self._current = Mapping(
            self._current.version + 1, tuple(tuple(tuple(d) for d in layer) for layer in replicas)
        )
        self.history.append(self._current)
        return self._current

    def _replicas(self) -> list[list[list[int]]]:
        return [[list(dies) for dies in layer] for layer in self._current.replicas]

    async def reconfigure(self, plans: list[Plan], *, prefetch_ns: int, load_ns: int) -> None:
        """Move to ``plans`` (one per layer) in four phases while passes keep running."""
        if len(plans) != self.layers:
            raise ConfigError(f"need one plan per layer ({self.layers})", field="plans")
        target: dict[tuple[int, int], list[int]] = {}
        for layer, plan in enumerate(plans):
            if len(plan.replica_dies) != len(self.primaries[layer]):
                raise ConfigError(
                    f"layer {layer}: {len(plan.replica_dies)} experts in the plan, "
                    f"{len(self.primaries[layer])} in the table",
                    field="plans",
                )
            for e, dies in enumerate(plan.replica_dies):
                if not dies:
                    raise ConfigError(
                        f"layer {layer} expert {e} would have no enabled replica", field="plans"
                    )
                if dies[0] != self.primaries[layer][e]:
                    raise ConfigError(
                        f"layer {layer} expert {e}: primaries do not move", field="plans"
                    )
                if len(set(dies)) != len(dies):
                    raise ConfigError(
                        f"layer {layer} expert {e}: two replicas on one die ({list(dies)})",
                        field="plans",
                    )
                for d in dies[1:]:
                    placed = target.setdefault((layer, d), [])
                    placed.append(e)
                    if len(placed) > self.spare_slots:
                        n = self.spare_slots
                        names = ", ".join(map(str, placed[:-1])) + f" and {placed[-1]}"
                        raise ConfigError(
                            f"layer {layer} die {d} has {n} redundant slot{'s' if n != 1 else ''}"
                            f", but experts {names} are all placed there",
                            field="plans",
                        )
        async with self._lock:  # one reconfiguration at a time
            await self._swap(self._assign(target), prefetch_ns, load_ns)

    def _assign(self, target: dict[tuple[int, int], list[int]]) -> dict[tuple[int, int, int], int]:
        """Slot of every placed replica: an expert already in one of the die's slots stays
        there; newcomers take the other slots in order."""
        out: dict[tuple[int, int, int], int] = {}
        dies = set(target) | {(layer, d) for layer, d, _ in self.slots}
        for layer, d in sorted(dies):
            want = target.get((layer, d), [])
            current = [e for e, _ in self.slot_states(layer, d)]
            newcomers = [e for e in want if e not in current]
            for s, e in enumerate(current):
                if e >= 0 and e in want:
                    out[(layer, d, s)] = e
                elif newcomers:
                    out[(layer, d, s)] = newcomers.pop(0)
        return out

    async def _swap(
        self, target: dict[tuple[int, int, int], int], prefetch_ns: int, load_ns: int
    ) -> None:
        changed = sorted(
            key
            for key in set(target) | set(self.slots)
            if self.slots.get(key, (-1, "empty"))[0] != target.get(key, -1)
        )
        # 1. prefetch the new weights into host memory
        await sleep_ns(prefetch_ns)
        # 2. publish a mapping without the affected slots; passes that took an older one may
        # still route to them (with their old weights): they finish before the slots go
        replicas = self._replicas()
        for key in changed:
            layer, d, _ = key
            old = self.slots.get(key, (-1, "empty"))[0]
            if old >= 0:
                replicas[layer][old] = [x for x in replicas[layer][old] if x != d]
        self._publish(replicas)
        await self._drain(self._current.version)
        for key in changed:
            self.slots[key] = (self.slots.get(key, (-1, "empty"))[0], "disabled")
        # 3. load asynchronously; passes keep using the mapping that excludes these slots
        for key in changed:
            self.slots[key] = (target.get(key, -1), "loading")
        await sleep_ns(load_ns)
        # 4. re-enable with the new experts
        for key in changed:
            layer, d, _ = key
            e = target.get(key, -1)
            self.slots[key] = (e, "enabled" if e >= 0 else "empty")
            if e >= 0:
                replicas[layer][e].append(d)
        self._publish(replicas)
        emit("eplb", "reconfigured", version=self._current.version, slots=len(changed))

    def check_pass(self, mapping: Mapping) -> None:
        """A forward pass using ``mapping`` now: every replica it routes to is enabled."""
        serving = self._serving()
        for layer, experts in enumerate(mapping.replicas):
            for e, dies in enumerate(experts):
                if not dies:
                    raise AssertionError(f"layer {layer} expert {e} has no replica")
                for d in dies[1:]:
                    if (layer, d, e) not in serving:
                        raise AssertionError(
                            f"pass v{mapping.version} routes layer {layer} expert {e} to die "
                            f"{d} whose slots are {self.slot_states(layer, d)}"
                        )
