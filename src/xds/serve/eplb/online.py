"""EPLB running inside a decode instance (SPEC 7.1-7.5, the whole loop).

Every iteration the routing of each MoE layer is drawn from the current (skewed, drifting)
expert popularity; the Collect kernel counts it; the busiest die's expert time follows the
mapping version the iteration started with. Every ``window_ns`` the TE-shell closes the window
(one report per DP), plans with the chosen policy and starts the four-phase reconfiguration in
the background (prefetch, disable, load, re-enable); iterations never wait for it, and pick up
the new mapping version once it is published.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
from msgspec import Meta

from ...config import check_fields
from ...docfields import document_fields
from ...errors import ConfigError
from ...units import MS, S
from .collect import LoadCollector
from .policies import Layout, Plan, plan_layer, policy
from .reconfigure import MappingTable
from .routing_model import SIGMA_20_PERCENT_ABOVE_MEAN


class OnlineEPLBConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str = "xds-greedy"
    """A policy name: built in, or your own added with
    :func:`~xds.serve.eplb.policies.register_policy`; "none" collects and never rebalances
    (the baseline)."""
    window_ns: Annotated[int, Meta(gt=0)] = 60 * S
    spare_slots: Annotated[int, Meta(ge=0)] = 1
    """Redundant slots per die and MoE layer (the budget is ``dies x spare_slots`` replicas
    per layer). 0: no replica can be placed and primaries never move, so EPLB only collects
    and reports load (no window rebalances)."""
    sigma: Annotated[float, Meta(ge=0)] = SIGMA_20_PERCENT_ABOVE_MEAN
    drift_rho: Annotated[float, Meta(ge=0, le=1)] = 0.95
    """Correlation of an expert's log-popularity from one window to the next."""
    prefetch_ns: Annotated[int, Meta(ge=0)] = 200 * MS
    """[emulator choice] storage -> host memory for the new replicas."""
    load_ns: Annotated[int, Meta(ge=0)] = 500 * MS
    """[emulator choice] host -> device for the new replicas (asynchronous)."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):  # configs stay plain data (TOML, JSON)
            raise ConfigError(
                f"takes a policy name, got {type(self.policy).__name__} {self.policy!r:.60}; "
                "register your policy first with xds.serve.eplb.register_policy(name, fn) and "
                "pass its name",
                field="policy",
            )
        check_fields(self)


class OnlineEPLB:
    """Routing, collection and rebalancing of one decode instance's MoE layers."""

    def __init__(
        self,
        config: OnlineEPLBConfig,
        *,
        layers: int,
        experts: int,
        dies: int,
        shared_dies: int,
        gen: np.random.Generator,
    ):
        if experts > dies - shared_dies:
            raise ConfigError("online EPLB needs one routed expert per die", field="dies")
        self.config = config
        self.policy = policy(config.policy)
        self.layers, self.experts, self.dies, self.shared = layers, experts, dies, shared_dies
        self.gen = gen
        self._z = gen.standard_normal((layers, experts))
        self.popularity = self._popularity()
        self.table = MappingTable(
            [list(range(experts)) for _ in range(layers)], spare_slots=config.spare_slots
        )
        self.collector = LoadCollector(layers, experts, 1, window_ns=config.window_ns)
        self.layout = Layout.one_expert_per_die(experts, dies, config.spare_slots)
        self._matrices: list[np.ndarray] = []
        self._version = -1
        self.last_report_ns = 0
        self.reconfigurations = 0
        """Rebalances started (one per window whose plans change the placement; counted by
        the decode loop)."""
        self._target = self._placement([[[int(d)] for d in self.layout.primary_die]] * layers)
        """The placement of the plans last handed out (primaries only at the start)."""
        self.versions_used: list[int] = []

    def _popularity(self) -> np.ndarray:
        pop = np.exp(self.config.sigma * self._z)
        return pop / pop.sum(axis=1, keepdims=True)

    def _drift(self) -> None:
        rho = self.config.drift_rho
        self._z = rho * self._z + np.sqrt(1 - rho**2) * self.gen.standard_normal(self._z.shape)
        self.popularity = self._popularity()

    def _share_matrices(self) -> list[np.ndarray]:
        """Per layer, [experts, dies]: the share of an expert's tokens each die gets under the
        current mapping (replicas split evenly by batch-position rotation)."""
        mapping = self.table.current
        if mapping.version != self._version:
            mats = []
            for layer in range(self.layers):
                m = np.zeros((self.experts, self.dies))
                for e, dies in enumerate(mapping.replicas[layer]):
                    m[e, list(dies)] = 1.0 / len(dies)
                mats.append(m)
            self._matrices, self._version = mats, mapping.version
        return self._matrices

    def busiest_die_tokens(self, tokens: int, top_k: int) -> list[float]:
        """One pass: draw each layer's routing, count it (Collect), and return the busiest
        die's tokens per layer under the mapping version in force."""
        mats = self._share_matrices()
        self.versions_used.append(self._version)
        out = []
        shared_load = tokens / self.shared if self.shared else 0.0
        for layer in range(self.layers):
            counts = self.gen.multinomial(tokens * top_k, self.popularity[layer])
            self.collector._dp_counts[0, layer] += counts
            die = counts @ mats[layer]
            if self.shared:
                die[self.dies - self.shared :] += shared_load
            out.append(float(die.max()))
        return out

    def plans_for(self, window: np.ndarray) -> list[Plan]:
        budget = self.dies * self.config.spare_slots
        plans = []
        for layer in range(self.layers):
            counts = window[layer][:, None]
            lay = self.layout
            if self.shared:
                base = np.zeros(self.dies)
                base[self.dies - self.shared :] = counts.sum() / self.experts
                lay = msgspec.structs.replace(self.layout, base_load=base)
            plans.append(plan_layer(self.policy, counts, lay, budget, layer=layer))
        return plans

    @staticmethod
    def _placement(replica_dies: list[list[list[int]]]) -> list[list[tuple[int, ...]]]:
        """Per layer and expert: primary, then the set of redundant dies (their order only
        sets the rotation, and a reconfiguration keeps a replica that stays in its slot)."""
        return [[(dies[0], *sorted(dies[1:])) for dies in layer] for layer in replica_dies]

    def window_plans(self, now_ns: int) -> list[Plan] | None:
        """At a window boundary: the TE-shell's report and, when they change the placement,
        new plans to install (None otherwise). Plans that move nothing are no rebalance: with
        ``spare_slots=0`` that is every window (there is no redundant slot, and primaries
        never move), so the policy is not even asked."""
        if not self.collector.window_due(now_ns, self.last_report_ns):
            return None
        self.last_report_ns = now_ns
        window = self.collector.close_window()
        self._drift()
        if self.config.policy == "none" or self.config.spare_slots == 0:
            return None
        if not window.any():  # an idle window says nothing about the load: keep the placement
            return None
        plans = self.plans_for(window)
        placement = self._placement([p.replica_dies for p in plans])
        if placement == self._target:
            return None  # the same placement as installed (or being installed)
        self._target = placement
        return plans


document_fields(OnlineEPLBConfig)
