"""SPEC 11.3 "Stage 1": restart-the-world of a PD deployment after a node fault."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds.errors import ConfigError
from xds.serve.decode import DecodeConfig
from xds.serve.jitter import JitterConfig
from xds.serve.prefill import PrefillConfig
from xds.serve.recovery import NodeFault, RecoveryConfig, restart_placement
from xds.serve.replay import PDConfig, replay
from xds.trace.workload import Request, Workload
from xds.units import MS, S

CFG = PDConfig(
    prefill=PrefillConfig(tes=3, long_pool_tes=0),
    decode=DecodeConfig(
        dies=32, batch_per_die=4, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
    ),
    recovery=RecoveryConfig(detect_ns=500 * MS, decode_restart_ns=4 * S, prefill_restart_ns=2 * S),
)
"""Servers: Prefill TEs 0-1, 2-3, 4-5; the Decode TE 6-7."""

WL = Workload(tuple(Request(i, i * 200 * MS, 1500, 40) for i in range(80)))  # 16 s


def test_the_deployment_numbers_its_servers():
    assert (CFG.servers, CFG.prefill_servers_per_te, CFG.decode_servers) == (8, 2, 2)


def test_a_node_fault_restarts_the_world_decode_first():
    fault = NodeFault(at_ns=3 * S, server=2)
    res = replay(WL, CFG, faults=[fault], event_log=True)
    (restart,) = res.restarts
    detected = 3 * S + CFG.recovery.detect_ns
    assert restart.started_ns == detected
    assert restart.decode_up_ns == detected + 4 * S
    assert restart.prefill_up_ns == restart.decode_up_ns + 2 * S  # Decode, then Prefill
    assert restart.prefill_tes == 2  # server 2 is tainted: Prefill TE 1 cannot come back
    assert restart.placement is not None and restart.placement.prefill == [[0, 1], [3, 4]]
    assert [e.event for e in res.events.select("engine")] == [
        "restart-the-world",
        "decode-restarted",
        "prefill-restarted",
    ]
    (taint,) = res.events.select("k8s", "taint")
    assert taint.t_ns == detected and taint.fields == {"server": 2}
    records = res.records
    in_flight = [r for r in records if r.reason.startswith("restart-the-world")]
    unavailable = [r for r in records if r.reason.startswith("service unavailable")]
    assert len(in_flight) == restart.failed > 0
    assert all(r.arrival_ns < detected and r.finish_ns == detected for r in in_flight)
    assert unavailable and all(
        detected <= r.arrival_ns < restart.prefill_up_ns for r in unavailable
    )
    after = [r for r in records if r.arrival_ns >= restart.prefill_up_ns]
    assert after and all(r.outcome == "completed" for r in after)
    early = [r for r in records if r.finish_ns < 3 * S and r.outcome == "completed"]
    assert early  # what finished before the fault stays completed
    assert res.summary.completed + res.summary.failed == len(WL)


def test_a_spare_server_brings_every_prefill_te_back():
    spare = msgspec.structs.replace(
        CFG, recovery=msgspec.structs.replace(CFG.recovery, spare_servers=1)
    )
    res = replay(WL, spare, faults=[NodeFault(at_ns=3 * S, server=7)])  # a Decode server
    (restart,) = res.restarts
    assert restart.placement is not None
    assert restart.placement.decode == [[6, 8]] and len(restart.placement.prefill) == 3


def test_a_decode_fault_without_spares_takes_a_prefill_server():
    res = replay(WL, CFG, faults=[NodeFault(at_ns=3 * S, server=6)])
    (restart,) = res.restarts
    assert restart.placement is not None
    assert restart.placement.decode == [[5, 7]]  # the last Prefill TE's server
    assert restart.placement.prefill == [[0, 1], [2, 3]]


def test_too_few_healthy_servers_keep_the_engine_down_and_every_request_ends():
    faults = [NodeFault(at_ns=3 * S, server=s) for s in (0, 1, 2, 3, 6)]  # 4, 5, 7 left
    res = replay(WL, CFG, faults=faults)
    (restart,) = res.restarts
    assert restart.prefill_tes == 0 and restart.prefill_up_ns == -1
    late = [r for r in res.records if r.arrival_ns > restart.decode_up_ns + 2 * S]
    assert late and all("cannot hold the Decode TEs" in r.reason for r in late)


def test_a_repaired_node_serves_again_at_the_next_restart():
    faults = [
        NodeFault(at_ns=1 * S, server=2, repair_ns=10 * S),  # untainted at 11 s
        NodeFault(at_ns=12 * S, server=0),
    ]
    res = replay(
        Workload(tuple(Request(i, i * 200 * MS, 1500, 40) for i in range(130))), CFG, faults=faults
    )
    first, second = res.restarts
    assert first.prefill_tes == 2  # server 2 still tainted when the first restart places TEs
    assert second.placement is not None and 2 in {s for te in second.placement.prefill for s in te}


def test_node_fault_replays_agree_across_backends():
    fault = NodeFault(at_ns=3 * S, server=2)
    a = replay(WL, CFG, faults=[fault])
    b = replay(WL, CFG, faults=[fault], backend="trio")
    assert [(r.outcome, r.reason, r.finish_ns) for r in a.records] == [
        (r.outcome, r.reason, r.finish_ns) for r in b.records
    ]


def test_bad_node_faults_name_the_field():
    with pytest.raises(ConfigError) as err:
        replay(WL, CFG, faults=[NodeFault(at_ns=0, server=8)])
    assert err.value.field == "server"
    with pytest.raises(ConfigError) as err:
        NodeFault(at_ns=-1, server=0)
    assert err.value.field == "at_ns"
    xccl = msgspec.structs.replace(CFG, kv_transfer="xccl")
    with pytest.raises(ConfigError) as err:
        replay(WL, xccl, faults=[NodeFault(at_ns=0, server=0)])
    assert err.value.field == "kv_transfer"


@settings(max_examples=80, deadline=None)
@given(
    prefill_tes=st.integers(1, 5),
    per_prefill=st.integers(1, 3),
    decode_tes=st.integers(1, 2),
    per_decode=st.integers(1, 8),
    spares=st.integers(0, 3),
    taint=st.sets(st.integers(0, 40)),
)
def test_a_restart_never_places_a_te_on_a_tainted_server(
    prefill_tes, per_prefill, decode_tes, per_decode, spares, taint
):
    servers = prefill_tes * per_prefill + decode_tes * per_decode + spares
    tainted = {s for s in taint if s < servers}
    p = restart_placement(
        servers=servers,
        tainted=tainted,
        prefill_tes=prefill_tes,
        prefill_servers_per_te=per_prefill,
        decode_tes=decode_tes,
        decode_servers_per_te=per_decode,
    )
    used = [s for te in p.decode + p.prefill for s in te]
    assert not set(used) & tainted and len(used) == len(set(used))
    healthy = servers - len(tainted)
    if healthy >= decode_tes * per_decode + per_prefill:  # Decode first, then a Prefill TE
        assert len(p.decode) == decode_tes and all(len(t) == per_decode for t in p.decode)
        want = min(prefill_tes, (healthy - decode_tes * per_decode) // per_prefill)
        assert len(p.prefill) == want and all(len(t) == per_prefill for t in p.prefill)
    else:
        assert p.decode == [] and p.prefill == []
