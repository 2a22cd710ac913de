"""The CloudMatrix384 topology: servers, chips, dies, and the network between any two dies.

A pod is ``servers x chips_per_server x dies_per_chip`` dies (48 x 8 x 2 = 768 by default,
SPEC 1.1). Dies have a flat index ``0..n_dies-1`` in server-major order, so
``index = (server * chips_per_server + chip) * dies_per_chip + die``. Ascend 910B servers
(one die per chip) can be attached for Prefill over RoCE (SPEC 10.2, P104); their dies follow
the pod's dies in the flat index.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
from msgspec import Meta

from xds.errors import ConfigError

from ..config import check_fields
from .specs import (
    ASCEND_910B2,
    ASCEND_910C_DIE,
    B_SCALE_OUT_LINK,
    DEFAULT_ENGINES,
    HCCS_LINK,
    NOC_LINK,
    ROCE_LINK,
    UB_LINK,
    VPC_LINK,
    DieSpec,
    EngineSpec,
    LinkSpec,
    Network,
)


class DieLocation(msgspec.Struct, frozen=True):
    """Where a die sits: its server, the chip in that server, the die in that chip."""

    index: int
    server: int
    chip: int
    die: int
    in_pod: bool = True
    """False for dies of attached Ascend 910B servers."""

    def __str__(self) -> str:
        kind = "" if self.in_pod else "910B "
        return f"{kind}die {self.index} (server {self.server}, chip {self.chip}, die {self.die})"


class PodConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape and parts of a CloudMatrix384 pod (defaults: the real one, SPEC 1.1)."""

    servers: Annotated[int, Meta(ge=1, le=48)] = 48
    """910C servers of the pod: a CloudMatrix384 has 48 (384 chips, 768 dies); fewer model
    a slice of it."""
    chips_per_server: Annotated[int, Meta(ge=1)] = 8
    dies_per_chip: Annotated[int, Meta(ge=1)] = 2
    die: DieSpec = ASCEND_910C_DIE
    ub: LinkSpec = UB_LINK
    noc: LinkSpec = NOC_LINK
    roce: LinkSpec = ROCE_LINK
    vpc: LinkSpec = VPC_LINK
    engines: EngineSpec = DEFAULT_ENGINES
    cpus_per_server: Annotated[int, Meta(ge=0)] = 4
    """Kunpeng CPUs per server [S: CMI, EM]."""
    attached_910b_servers: Annotated[int, Meta(ge=0)] = 0
    """Ascend 910B servers (8 single-die chips each) reachable over RoCE."""
    b_die: DieSpec = ASCEND_910B2
    hccs: LinkSpec = HCCS_LINK
    b_scale_out: LinkSpec = B_SCALE_OUT_LINK
    """Between 910B servers: each die's own RDMA interface (a Prefill TE of 910B dies spans
    servers of 8)."""

    def __post_init__(self) -> None:
        check_fields(self)


class CloudMatrix384:
    """A CloudMatrix384 pod (optionally with attached 910B servers).

    ``CloudMatrix384()`` is the full 768-die pod; ``CloudMatrix384(servers=4)`` a 64-die slice
    for tests. Keyword arguments are :class:`PodConfig` fields.
    """

    def __init__(self, config: PodConfig | None = None, **overrides: object):
        if config is None:
            config = PodConfig()
        if overrides:
            unknown = sorted(set(overrides) - set(PodConfig.__struct_fields__))
            if unknown:
                raise ConfigError(
                    f"unknown pod parameter(s) {', '.join(unknown)}; known: "
                    f"{', '.join(PodConfig.__struct_fields__)}",
                    field=unknown[0],
                )
            config = msgspec.structs.replace(config, **overrides)
        self.config = config  # checked when it was built (PodConfig.__post_init__)
        c = self.config
        self.dies_per_server = c.chips_per_server * c.dies_per_chip
        self.n_pod_dies = c.servers * self.dies_per_server
        self.n_pod_chips = c.servers * c.chips_per_server
        self.n_910b_dies = c.attached_910b_servers * 8
        self.n_dies = self.n_pod_dies + self.n_910b_dies
        idx = np.arange(self.n_pod_dies)
        self.server_of = np.concatenate(
            [
                idx // self.dies_per_server,
                c.servers + np.arange(self.n_910b_dies) // 8,
            ]
        )
        self.chip_of = np.concatenate(
            [(idx // c.dies_per_chip) % c.chips_per_server, np.arange(self.n_910b_dies) % 8]
        )
        self.die_in_chip = np.concatenate(
            [idx % c.dies_per_chip, np.zeros(self.n_910b_dies, dtype=idx.dtype)]
        )

    # -- identities --------------------------------------------------------------------------
    @property
    def die_spec(self) -> DieSpec:
        return self.config.die

    @property
    def engines(self) -> EngineSpec:
        return self.config.engines

    def check_die(self, index: int, *, what: str = "die") -> int:
        """Validate a flat die index, raising a clear error for one that does not exist."""
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise ConfigError(f"{what} must be an integer die index, got {index!r}", field=what)
        if not 0 <= index < self.n_dies:
            raise ConfigError(
                f"{what} {index} does not exist: this pod has dies 0..{self.n_dies - 1}",
                field=what,
            )
        return int(index)

    def spec_of(self, index: int) -> DieSpec:
        """The spec of die ``index`` (910C in the pod, 910B on attached servers)."""
        return self.config.die if self.check_die(index) < self.n_pod_dies else self.config.b_die

    def location(self, index: int) -> DieLocation:
        i = self.check_die(index)
        return DieLocation(
            i,
            int(self.server_of[i]),
            int(self.chip_of[i]),
            int(self.die_in_chip[i]),
            in_pod=i < self.n_pod_dies,
        )

    def index_of(self, server: int, chip: int, die: int = 0) -> int:
        """Flat index of ``(server, chip, die)`` in the pod."""
        c = self.config
        if not 0 <= server < c.servers:
            raise ConfigError(
                f"server {server} does not exist (0..{c.servers - 1})", field="server"
            )
        if not 0 <= chip < c.chips_per_server:
            raise ConfigError(
                f"chip {chip} does not exist (0..{c.chips_per_server - 1})", field="chip"
            )
        if not 0 <= die < c.dies_per_chip:
            raise ConfigError(f"die {die} does not exist (0..{c.dies_per_chip - 1})", field="die")
        return (server * c.chips_per_server + chip) * c.dies_per_chip + die

    def dies_of_server(self, server: int) -> range:
        if not 0 <= server < self.config.servers:
            raise ConfigError(f"server {server} does not exist", field="server")
        return range(server * self.dies_per_server, (server + 1) * self.dies_per_server)

    # -- networks ----------------------------------------------------------------------------
    def network_between(self, a: int, b: int) -> Network:
        """The network that joins dies ``a`` and ``b`` (SPEC 1.2)."""
        a = self.check_die(a, what="die a")
        b = self.check_die(b, what="die b")
        if a == b:
            return Network.LOCAL
        a_pod, b_pod = a < self.n_pod_dies, b < self.n_pod_dies
        if a_pod and b_pod:
            same_chip = (
                self.server_of[a] == self.server_of[b] and self.chip_of[a] == self.chip_of[b]
            )
            return Network.NOC if same_chip else Network.UB
        if not a_pod and not b_pod and self.server_of[a] == self.server_of[b]:
            return Network.HCCS
        return Network.ROCE

    def link(self, network: Network) -> LinkSpec:
        """Link parameters of a network."""
        c = self.config
        table = {
            Network.NOC: c.noc,
            Network.UB: c.ub,
            Network.ROCE: c.roce,
            Network.HCCS: c.hccs,
            Network.VPC: c.vpc,
        }
        if network not in table:
            raise ConfigError(f"{network.value} is not a network link", field="network")
        return table[network]

    def link_between(self, a: int, b: int) -> LinkSpec | None:
        """Link parameters between two dies (``None`` for the same die)."""
        net = self.network_between(a, b)
        return None if net is Network.LOCAL else self.link(net)

    # -- summary -----------------------------------------------------------------------------
    def summary(self) -> dict[str, object]:
        """Totals a person wants to see first (used by ``xds info``)."""
        c = self.config
        d = c.die
        return {
            "servers": c.servers,
            "chips": self.n_pod_chips,
            "dies": self.n_pod_dies,
            "aic": self.n_pod_dies * d.aic,
            "aiv": self.n_pod_dies * d.aiv,
            "kunpeng_cpus": c.servers * c.cpus_per_server,
            "hbm_bytes": self.n_pod_dies * d.hbm_bytes,
            "hbm_bandwidth": self.n_pod_dies * d.hbm_bandwidth,
            "bf16_flops": self.n_pod_dies * d.bf16_flops,
            "int8_ops": self.n_pod_dies * d.int8_ops,
            "attached_910b_dies": self.n_910b_dies,
        }

    def __repr__(self) -> str:
        c = self.config
        extra = f" + {c.attached_910b_servers} 910B servers" if c.attached_910b_servers else ""
        return (
            f"CloudMatrix384({c.servers} server{'s' * (c.servers != 1)} x "
            f"{c.chips_per_server} chips x "
            f"{c.dies_per_chip} dies = {self.n_pod_dies} dies{extra})"
        )
