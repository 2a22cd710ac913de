"""Which dies hold which experts, and what losing dies does to them (SPEC 11.2 stage 2).

Decode vertical scale-down (P119) removes DP groups and EP ranks after a fault and relies on
EPLB's redundancy: it is allowed only if **every expert keeps at least one replica**. Slots
are filled round-robin (die ``d``'s slot ``j`` holds expert ``(d * slots + j) % experts``), so
with ``slots_per_die * dies >= 2 * experts`` every expert has replicas on two different dies.

Tokens of an expert are spread evenly over its replicas (SPEC 7.5), so a die's load is the sum
over its slots of ``1 / (experts * replicas)``: when a die goes, its experts' remaining
replicas take its share, and the busiest die's load grows. The decode group scales its expert
time by that growth (a first-order model: expert GEMM time proportional to the busiest die's
share of routed tokens).
"""

from __future__ import annotations

from ...errors import ConfigError


class ExpertPlacement:
    """Replicas of ``experts`` logical experts over a set of dies."""

    def __init__(self, replicas: dict[int, list[int]], experts: int):
        self.replicas = replicas
        """Expert -> the dies holding a replica (a die may appear twice)."""
        self.experts = experts

    @classmethod
    def round_robin(cls, experts: int, dies: int, slots_per_die: int) -> ExpertPlacement:
        if dies * slots_per_die < experts:
            raise ConfigError(
                f"{dies} dies x {slots_per_die} slots cannot hold {experts} experts",
                field="slots_per_die",
            )
        replicas: dict[int, list[int]] = {e: [] for e in range(experts)}
        for die in range(dies):
            for j in range(slots_per_die):
                replicas[(die * slots_per_die + j) % experts].append(die)
        return cls(replicas, experts)

    def orphans(self, lost: set[int]) -> list[int]:
        """Experts whose every replica sits on a die in ``lost``."""
        return [e for e, dies in self.replicas.items() if set(dies) <= lost]

    def without(self, lost: set[int]) -> ExpertPlacement:
        """The placement after removing the dies in ``lost`` (their replicas go with them)."""
        if orphans := self.orphans(lost):
            raise ConfigError(f"experts {orphans} would have no replica left", field="lost")
        return ExpertPlacement(
            {e: [d for d in dies if d not in lost] for e, dies in self.replicas.items()},
            self.experts,
        )

    def busiest_share(self) -> float:
        """The largest share of all routed tokens that one die computes."""
        load: dict[int, float] = {}
        for dies in self.replicas.values():
            for d in dies:
                load[d] = load.get(d, 0.0) + 1.0 / (self.experts * len(dies))
        return max(load.values())

    def min_replicas(self) -> int:
        return min(len(set(d)) for d in self.replicas.values())
