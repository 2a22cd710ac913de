"""Hardware: Ascend 910C/910B specs with sources, links, and the CloudMatrix384 topology."""

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
    aiv_mte_bandwidth,
    collective_efficiency,
    sources,
)
from .topology import CloudMatrix384, DieLocation, PodConfig

__all__ = [
    "ASCEND_910B2",
    "ASCEND_910C_DIE",
    "B_SCALE_OUT_LINK",
    "DEFAULT_ENGINES",
    "HCCS_LINK",
    "NOC_LINK",
    "ROCE_LINK",
    "UB_LINK",
    "VPC_LINK",
    "CloudMatrix384",
    "DieLocation",
    "DieSpec",
    "EngineSpec",
    "LinkSpec",
    "Network",
    "PodConfig",
    "aiv_mte_bandwidth",
    "collective_efficiency",
    "sources",
]
