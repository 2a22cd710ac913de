"""Expert load balancing (SPEC 7): skewed routing, collect, plan and place, reconfigure, rotate.

* :mod:`~xds.serve.eplb.routing_model` - skewed routing calibrated to Figure 11, uniform, or a
  user's ``[time_slice, layer, expert]`` counts from ``.npy``/CSV.
* :mod:`~xds.serve.eplb.collect` - per-layer counts aggregated per DP, reported per window.
* :mod:`~xds.serve.eplb.policies` - xDeepServe's greedy, a DeepSeek-EPLB-style policy, none;
  the :class:`~xds.serve.eplb.policies.Policy` interface for your own.
* :mod:`~xds.serve.eplb.reconfigure` - the four-phase swap with versioned mappings.
* Rotation is :meth:`xds.fabric.xccl.moe.ExpertMap.physical` (replica = position mod copies).
* :mod:`~xds.serve.eplb.evaluate` - held-out comparison and modelled forward latency.
"""

from .collect import LoadCollector
from .policies import POLICIES, DeepSeekEPLB, Layout, NoBalancing, Plan, Policy, XdsGreedy, policy
from .reconfigure import Mapping, MappingTable

__all__ = [
    "POLICIES",
    "DeepSeekEPLB",
    "Layout",
    "LoadCollector",
    "Mapping",
    "MappingTable",
    "NoBalancing",
    "Plan",
    "Policy",
    "XdsGreedy",
    "policy",
]
