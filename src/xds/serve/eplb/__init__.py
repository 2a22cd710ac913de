"""Expert load balancing (SPEC 7): skewed routing, collect, plan and place, reconfigure, rotate.

* :mod:`~xds.serve.eplb.routing_model` - skewed routing calibrated to Figure 11, uniform, or a
  user's ``[time_slice, layer, expert]`` counts from ``.npy``/CSV.
* :mod:`~xds.serve.eplb.collect` - per-layer counts aggregated per DP, reported per window.
* :mod:`~xds.serve.eplb.policies` - xDeepServe's greedy, a DeepSeek-EPLB-style policy, none;
  the :class:`~xds.serve.eplb.policies.Policy` interface (or a plain function) for your own,
  :func:`~xds.serve.eplb.policies.register_policy` to use it by name, and
  :func:`~xds.serve.eplb.policies.checked_plan`, the check every policy's plan goes through.
* :mod:`~xds.serve.eplb.reconfigure` - the four-phase swap with versioned mappings.
* Rotation is :meth:`xds.fabric.xccl.moe.ExpertMap.physical` (replica = position mod copies).
* :mod:`~xds.serve.eplb.evaluate` - held-out comparison and modelled forward latency.
"""

from .collect import LoadCollector
from .policies import (
    POLICIES,
    DeepSeekEPLB,
    FunctionPolicy,
    Layout,
    NoBalancing,
    Plan,
    PlanFunction,
    Policy,
    XdsGreedy,
    checked_plan,
    policy,
    policy_names,
    register_policy,
    unregister_policy,
)
from .reconfigure import Mapping, MappingTable

__all__ = [
    "POLICIES",
    "DeepSeekEPLB",
    "FunctionPolicy",
    "Layout",
    "LoadCollector",
    "Mapping",
    "MappingTable",
    "NoBalancing",
    "Plan",
    "PlanFunction",
    "Policy",
    "XdsGreedy",
    "checked_plan",
    "policy",
    "policy_names",
    "register_policy",
    "unregister_policy",
]
