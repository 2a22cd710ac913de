"""Reliability: detection, recovery and fault injection (SPEC 11, P113-P120).

* :mod:`.config`: the decode group, heartbeat and rollback knobs, and the injectable faults
  (:class:`ExecutorHang`, :class:`ExecutorCrash`, :class:`SlowIteration`,
  :class:`NetworkError`, :class:`MemoryFault`).
* :mod:`.engine`: :class:`ReliableDecode`, DP masters, executors and output processors run
  layer by layer with busy-polled global barriers.
* :mod:`.heartbeat`: control plane -> TE-shell -> DP master heartbeats.
* :mod:`.rollback`: the rollback broadcaster, busy-poll barriers and the epoch barrier.
* :mod:`.kv_space`: block-addressed KV with checkpoints and memory-fault masking.
* :mod:`.content`: the tiny greedy decoder that makes tokens comparable across runs.
* :mod:`.times`: per-layer kernel times from the decode cost model.

Link probing of the PD KV-transfer path lives with DistFlow (:mod:`xds.serve.probe`).
"""

from .config import (
    ExecutorCrash,
    ExecutorHang,
    Fault,
    HeartbeatConfig,
    LayerTimes,
    MemoryFault,
    NetworkError,
    ReliabilityConfig,
    RollbackConfig,
    SlowIteration,
    parse_fault,
)
from .engine import ReliabilityResult, ReliableDecode, RequestOutcome, ScaleDown
from .heartbeat import Verdict
from .rollback import RollbackRecord
from .times import layer_times

__all__ = [
    "ExecutorCrash",
    "ExecutorHang",
    "Fault",
    "HeartbeatConfig",
    "LayerTimes",
    "MemoryFault",
    "NetworkError",
    "ReliabilityConfig",
    "ReliabilityResult",
    "ReliableDecode",
    "RequestOutcome",
    "RollbackConfig",
    "RollbackRecord",
    "ScaleDown",
    "SlowIteration",
    "Verdict",
    "layer_times",
    "parse_fault",
]
