"""Decode vertical scale-down: which Decode TE is left when a server's dies are lost (P119).

With EPLB's redundant expert slots a Decode TE can survive losing dies: it drops their DP groups
and EP ranks, loads the lost dies' experts into redundant slots on the survivors, and serves on
with fewer, busier dies, instead of restarting on healthy servers (SPEC 11.2 stage 2). The rule
SPEC 7.5 and 11.3 set: **at least one replica of every expert is kept**; a scale-down that
would leave an expert without one is refused (the TE restarts instead).

The layout is :class:`~xds.serve.decode_model.DecodeModel`'s: the first
``dies - shared_expert_dies`` dies hold the routed experts, ``ceil(routed / routed dies)`` each
plus the redundant slots (one, or the online EPLB's ``spare_slots``; the same count
:func:`~xds.serve.decode_model.decode_weight_bytes` reserves HBM for); the others hold one
shared-expert instance each. A die keeps its memory layout through a scale-down, so its KV
capacity does not change; its expert slots bound how far the TE can shrink. When the failed
server is repaired the TE scales back up (:func:`resized_config` of the dies in service).
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..errors import ConfigError
from .decode_model import DecodeConfig, expert_slots_per_die


def scaled_down_config(
    config: DecodeConfig, alive: np.ndarray, lost: list[int], kv_blocks_per_die: int
) -> tuple[DecodeConfig | None, str]:
    """The Decode TE left when the dies ``lost`` go, of those ``alive`` (a mask over
    ``config``'s dies, the TE as first deployed), with ``kv_blocks_per_die`` each; or None and
    why the scale-down is refused."""
    if not lost:
        return None, "none of the TE's dies in service is on that server"
    m = config.spec
    n0, s0 = config.dies, config.shared_expert_dies
    r0 = n0 - s0
    keep = np.asarray(alive, dtype=bool).copy()
    keep[lost] = False
    routed_left, shared_left = int(keep[:r0].sum()), int(keep[r0:].sum())
    slots = expert_slots_per_die(config)
    if not routed_left:
        return None, "no routed-expert die would be left"
    need = -(-m.routed_experts // routed_left)
    if need > slots:
        return None, (
            f"{m.routed_experts} routed experts on the {routed_left} routed-expert dies left "
            f"need {need} slots each; they have {slots}"
        )
    if s0 and not shared_left:
        return (
            None,
            "every shared-expert die was on that server: the shared expert would have no replica",
        )
    try:
        return resized_config(config, keep, kv_blocks_per_die), ""
    except ConfigError as exc:  # e.g. the online EPLB's one routed expert per die
        return None, str(exc)


def resized_config(config: DecodeConfig, keep: np.ndarray, kv_blocks_per_die: int) -> DecodeConfig:
    """The Decode TE made of the dies ``keep`` (a mask over ``config``'s dies, the TE as first
    deployed) with ``kv_blocks_per_die`` each: ``config`` itself when every die is kept."""
    keep = np.asarray(keep, dtype=bool)
    if keep.all():
        return config
    r0 = config.dies - config.shared_expert_dies
    shared = int(keep[r0:].sum())
    return msgspec.structs.replace(
        config,
        dies=int(keep.sum()),
        shared_expert_dies=shared,
        kv_blocks_per_die=kv_blocks_per_die,
    )
