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


def test_an_engine_down_for_want_of_servers_restarts_when_repairs_give_it_room():
    faults = [NodeFault(at_ns=3 * S, server=s, repair_ns=8 * S) for s in (0, 1, 2, 3, 6)]
    wl = Workload(tuple(Request(i, i * 200 * MS, 1500, 40) for i in range(120)))  # 24 s
    res = replay(wl, CFG, faults=faults, event_log=True)
    (restart,) = res.restarts
    assert restart.attempts == 2 and restart.prefill_tes == 3  # all five repaired at 11 s
    assert restart.prefill_up_ns == 11 * S + CFG.recovery.decode_restart_ns + 2 * S
    assert len(res.events.select("engine", "restart-after-repair")) == 1
    down = [r for r in res.records if 10 * S <= r.arrival_ns < 11 * S]  # placed at 9.5 s
    assert down and all("cannot hold the Decode TEs" in r.reason for r in down)
    again = [r for r in res.records if 11 * S <= r.arrival_ns < restart.prefill_up_ns]
    assert again and all("restarting again: repairs gave it room" in r.reason for r in again)
    later = [r for r in res.records if r.arrival_ns > restart.prefill_up_ns]
    assert later and all(r.outcome == "completed" for r in later)


def test_a_killed_prefill_te_comes_back_when_a_repair_frees_servers():
    fault = NodeFault(at_ns=3 * S, server=6, repair_ns=5 * S)  # repaired at 8 s
    res = replay(LONG, IND, faults=[fault], event_log=True)
    decode, killed = res.failovers
    assert decode.te == "D0" and killed.te == "P0"
    assert "killed to preserve Decode TE 0" in killed.reason
    assert killed.back_ns == 8 * S + CFG.recovery.prefill_restart_ns
    assert killed.servers == [1, 6]  # its healthy server and the repaired one
    later = [r for r in res.records if r.arrival_ns > killed.back_ns]
    assert any(r.prefill_placement.startswith("P0") for r in later)


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
    assert err.value.field == "faults[0].server"
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


IND = msgspec.structs.replace(
    CFG, recovery=msgspec.structs.replace(CFG.recovery, mode="independent")
)
LONG = Workload(tuple(Request(i, i * 200 * MS, 1500, 40) for i in range(130)))  # 26 s


def _in_flight_at(records, t_ns):
    return [r for r in records if r.arrival_ns < t_ns]


def test_independent_failover_of_a_prefill_te_never_touches_decode():
    """Stage 2 (P119): a Prefill TE's fault fails only what it holds; the Decode TE and the
    other Prefill TEs go on; with a spare it comes back."""
    spare = msgspec.structs.replace(
        IND, recovery=msgspec.structs.replace(IND.recovery, spare_servers=1)
    )
    heavy = Workload(tuple(Request(i, i * 100 * MS, 30_000, 40) for i in range(120)))
    res = replay(heavy, spare, faults=[NodeFault(at_ns=3 * S + 50 * MS, server=2)])
    (fo,) = res.failovers
    assert fo.te == "P1" and fo.down_ns == 3 * S + 50 * MS + CFG.recovery.detect_ns
    assert fo.failed > 0  # the prompts it was prefilling
    assert fo.back_ns == fo.down_ns + CFG.recovery.prefill_restart_ns and fo.servers == [3, 8]
    assert not res.restarts and not any("unavailable" in r.reason for r in res.records)
    for r in res.records:
        if r.outcome == "failed":
            assert r.reason == "Prefill TE 1 lost to an NPU fault on server 2"
            assert r.first_token_ns < 0  # still prefilling on P1
    assert fo.failed == len([r for r in res.records if r.outcome == "failed"])
    decoding = [r for r in res.records if 0 <= r.first_token_ns < fo.down_ns < r.finish_ns]
    assert decoding and all(r.outcome == "completed" for r in decoding)  # Decode untouched
    assert {r.prefill_placement[:2] for r in res.records if r.arrival_ns > fo.back_ns} >= {"P1"}


def test_a_prefill_te_that_cannot_come_back_stays_down_and_the_rest_serve():
    res = replay(LONG, IND, faults=[NodeFault(at_ns=3 * S, server=2)])
    (fo,) = res.failovers
    assert fo.back_ns == -1
    later = [r for r in res.records if r.arrival_ns > fo.down_ns]
    assert later and all(r.outcome == "completed" for r in later)
    assert not any(r.prefill_placement.startswith("P1") for r in later)


def test_a_decode_fault_kills_a_prefill_to_preserve_decode():
    """No spare: the Decode TE takes a Prefill TE's server (kill-P-to-preserve-D); requests
    decoding at the fault fail; requests prefilled during the outage wait for the Decode TE
    and complete."""
    res = replay(LONG, IND, faults=[NodeFault(at_ns=3 * S, server=6)], event_log=True)
    decode, killed = res.failovers
    assert decode.te == "D0" and killed.te == "P0" and killed.back_ns == -1
    assert "killed to preserve Decode TE 0" in killed.reason
    assert decode.back_ns == decode.down_ns + CFG.recovery.decode_restart_ns
    assert decode.servers == [0, 7]  # the killed Prefill TE's first server
    (kill,) = res.events.select("failover", "kill-p-to-preserve-d")
    assert kill.fields == {"prefill_te": 0, "decode_te": 0}
    failed = [r for r in res.records if r.outcome == "failed"]
    assert len(failed) == decode.failed + killed.failed > 0
    assert all(r.finish_ns == decode.down_ns for r in failed)
    waited = [r for r in res.records if decode.down_ns < r.arrival_ns < decode.back_ns]
    assert waited and all(r.outcome == "completed" for r in waited)
    assert all(r.finish_ns > decode.back_ns for r in waited)  # decode resumed only then
    assert res.summary.completed + res.summary.failed == len(LONG)


def test_with_a_spare_a_decode_fault_kills_no_prefill():
    spare = msgspec.structs.replace(
        IND, recovery=msgspec.structs.replace(IND.recovery, spare_servers=1)
    )
    res = replay(LONG, spare, faults=[NodeFault(at_ns=3 * S, server=6)])
    (decode,) = res.failovers
    assert decode.servers == [7, 8]


def test_losing_every_decode_server_fails_the_waiting_requests_with_a_reason():
    faults = [NodeFault(at_ns=3 * S, server=s) for s in range(8)]
    res = replay(LONG, IND, faults=faults)
    assert res.summary.completed + res.summary.failed == len(LONG)
    late = [r for r in res.records if r.arrival_ns > 4 * S]
    assert late and all(r.outcome == "failed" for r in late)
    assert {r.reason for r in late} <= {
        "service unavailable: no Prefill TE in service (node faults)",
        "Decode TE 0 lost to an NPU fault on server 6; too few healthy servers to restart it",
    }


def test_independent_failover_is_deterministic():
    fault = [NodeFault(at_ns=3 * S, server=6)]
    a, b = replay(LONG, IND, faults=fault), replay(LONG, IND, faults=fault)
    assert [(r.outcome, r.reason, r.finish_ns) for r in a.records] == [
        (r.outcome, r.reason, r.finish_ns) for r in b.records
    ]


def test_a_decode_te_never_restarts_on_a_server_that_failed_while_it_restarted():
    """Faults on the servers a restarting Decode TE was given: it re-places and restarts
    again, never on a tainted server."""
    spare = msgspec.structs.replace(
        IND, recovery=msgspec.structs.replace(IND.recovery, spare_servers=1)
    )
    for cfg, faults in (
        (IND, [NodeFault(at_ns=3 * S, server=6), NodeFault(at_ns=3 * S, server=7)]),
        (spare, [NodeFault(at_ns=3 * S, server=6), NodeFault(at_ns=4 * S, server=8)]),
    ):
        res = replay(LONG, cfg, faults=faults)
        decode = next(f for f in res.failovers if f.te == "D0")
        assert decode.back_ns > 0
        assert not set(decode.servers) & {f.server for f in faults}


def test_a_failover_racing_a_request_leaks_nothing():
    """D0 comes back at the instant P1's fault is detected: the requests P1 held, woken by
    D0's return, fail and give back their Decode reservations (the TEs' checks run at the
    end of every replay)."""
    faults = [NodeFault(at_ns=3 * S, server=6), NodeFault(at_ns=7 * S, server=2)]
    a = replay(LONG, IND, faults=faults)
    b = replay(LONG, IND, faults=faults, backend="trio")
    assert a.summary.completed + a.summary.failed == len(LONG)
    assert (a.summary.completed, a.summary.failed) == (b.summary.completed, b.summary.failed)


def test_a_lost_decode_te_waits_for_repairs_and_the_other_decode_te_serves():
    two = msgspec.structs.replace(IND, prefill=PrefillConfig(tes=2, long_pool_tes=0), decode_tes=2)
    wl = Workload(tuple(Request(i, i * 200 * MS, 1500, 40) for i in range(100)))
    faults = [
        NodeFault(at_ns=1 * S, server=0, repair_ns=1 * S),
        NodeFault(at_ns=1 * S, server=2, repair_ns=1 * S),
        NodeFault(at_ns=1 * S + 100 * MS, server=4),  # D0's
    ]
    res = replay(wl, two, faults=faults)
    late = [r for r in res.records if r.arrival_ns > 5 * S]
    assert late and all(r.outcome == "completed" for r in late)
    decode = next(f for f in res.failovers if f.te == "D0")
    assert decode.back_ns > 0 and 4 not in decode.servers


def test_transport_and_link_faults_on_one_pair_end_every_request():
    from xds.serve.probe import ProbeConfig
    from xds.serve.replay import DistFlowFault

    cfg = PDConfig(
        prefill=PrefillConfig(tes=1, long_pool_tes=0), decode=CFG.decode, probe=ProbeConfig()
    )
    faults = [
        DistFlowFault(at_ns=2_200 * MS, prefill_te=0, kind="link_down"),
        DistFlowFault(at_ns=2_500 * MS, prefill_te=0, kind="transport"),
    ]
    res = replay(WL, cfg, faults=faults)  # used to hang: the stalled transfers never ended
    assert res.summary.completed + res.summary.failed == len(WL) and res.summary.failed


def test_faults_on_spares_and_vanished_pairs_are_harmless():
    from xds.serve.replay import DistFlowFault

    spare = msgspec.structs.replace(
        CFG, recovery=msgspec.structs.replace(CFG.recovery, spare_servers=1)
    )
    res = replay(WL, spare, faults=[NodeFault(at_ns=3 * S, server=8)])  # an idle spare
    assert not res.restarts and res.summary.completed == len(WL)
    res = replay(
        WL,
        CFG,
        faults=[NodeFault(at_ns=3 * S, server=2), DistFlowFault(at_ns=12 * S, prefill_te=2)],
    )  # the restart brought back only Prefill TEs 0 and 1
    assert res.summary.completed + res.summary.failed == len(WL)


def test_a_replaced_distflow_instance_retires_once_drained_and_its_pollers_end():
    res = replay(LONG, IND, faults=[NodeFault(at_ns=3 * S, server=6)], event_log=True)
    decode, _killed = res.failovers
    retired = res.events.select("distflow", "retired")
    # Decode TE 0 came back: a fresh instance per pair (P0's too, for when P0 returns), the
    # old ones retired once drained
    assert sorted(e.fields["pair"] for e in retired) == ["P0-D0", "P1-D0", "P2-D0"]
    assert all(e.t_ns >= decode.back_ns for e in retired)
    assert res.summary.completed + res.summary.failed == len(LONG)


def test_prefill_tes_waiting_behind_a_decode_te_come_back_once_it_is_served():
    """Every Prefill server fails, then a Decode server; all are repaired at 20 s. The Prefill
    TEs wait while the Decode TE waits (it goes first), whatever order the tasks wake in."""
    wl = Workload(tuple(Request(i, i * 500 * MS, 1500, 20) for i in range(60)))  # 30 s
    faults = [NodeFault(at_ns=1 * S, server=s, repair_ns=19 * S) for s in range(6)]
    faults.append(NodeFault(at_ns=5 * S, server=6, repair_ns=15 * S))
    res = replay(wl, IND, faults=faults)
    back = {f.te: f.back_ns for f in res.failovers}
    assert set(back) == {"P0", "P1", "P2", "D0"} and min(back.values()) >= 20 * S
    late = [r for r in res.records if r.arrival_ns > 25 * S]
    assert late and all(r.outcome == "completed" for r in late)


def test_spares_fit_in_the_pod_and_are_counted_apart(tmp_path, capsys):
    from xds.cli.main import main

    with pytest.raises(ConfigError, match="one CloudMatrix384 has 48 servers") as info:
        msgspec.structs.replace(
            CFG, recovery=msgspec.structs.replace(CFG.recovery, spare_servers=1000)
        )
    assert info.value.field == "recovery.spare_servers"
    cfg = msgspec.structs.replace(
        CFG, recovery=msgspec.structs.replace(CFG.recovery, spare_servers=2)
    )
    assert cfg.spare_chips == 16 and cfg.chips == CFG.chips  # per-chip figures: serving chips
    toml = tmp_path / "spares.toml"
    toml.write_text("[recovery]\nspare_servers = 2\n")
    assert main(["replay", "--synthetic", "5", "--deployment", str(toml)]) == 0
    assert "chips + 16 spare)" in capsys.readouterr().out


def _one_prefill_te():
    """production-4p1d with one Prefill TE (servers 0-1) and its Decode TE (servers 2-9),
    failing over independently; one-token requests (prefill only) every 10 s."""
    from xds.serve.presets import pd_config

    base = pd_config("production-4p1d")
    cfg = msgspec.structs.replace(
        base,
        prefill=msgspec.structs.replace(base.prefill, tes=1),
        recovery=msgspec.structs.replace(base.recovery, mode="independent"),
    )
    return cfg, Workload(tuple(Request(i, i * 10 * S, 1000, 1) for i in range(40)))


def test_faults_detected_together_are_all_tainted_before_a_layout_is_chosen():
    cfg, wl = _one_prefill_te()
    rc = cfg.recovery
    # three Decode servers lost at once, for good: killing the Prefill TE (2 servers) could
    # not restart the Decode TE (8), so it is not killed and every request is served
    res = replay(wl, cfg, faults=[NodeFault(at_ns=S, server=s) for s in (2, 3, 4)])
    (decode,) = res.failovers
    assert decode.te == "D0" and decode.back_ns == -1
    assert res.summary.completed == len(wl)
    # two lost at once: the Prefill TE's servers make up for both, and the Decode TE is not
    # placed on the second failed server (it comes back after one restart, not two)
    res = replay(wl, cfg, faults=[NodeFault(at_ns=S, server=s) for s in (2, 3)])
    decode, killed = res.failovers
    assert killed.te == "P0" and decode.back_ns == decode.down_ns + rc.decode_restart_ns
    assert not {2, 3} & set(decode.servers)


def test_a_prefill_te_killed_for_a_decode_te_that_then_stays_down_comes_back():
    cfg, wl = _one_prefill_te()
    rc = cfg.recovery
    faults = [NodeFault(at_ns=S // 2, server=3), NodeFault(at_ns=S // 2, server=4)]
    faults.append(NodeFault(at_ns=S, server=2))  # after P0 was killed for the first two
    res = replay(wl, cfg, faults=faults)
    decode, killed = res.failovers
    assert killed.te == "P0" and decode.back_ns == -1
    # the Decode TE gave up as soon as server 2, one it was restarting on, was tainted (not
    # after its restart ran its course on it): P0's servers came back
    gave_up = S + rc.detect_ns
    assert killed.back_ns == gave_up + rc.prefill_restart_ns and killed.servers == [0, 1]
    served = [r for r in res.records if r.arrival_ns > killed.back_ns]
    assert served and all(r.outcome == "completed" for r in served)
    assert res.summary.completed + res.summary.failed == len(wl)


def test_a_prefill_te_that_stopped_waiting_returns_when_servers_come_back_later():
    """P0 is killed for D0, which comes back; P0 stops waiting (nothing could free servers).
    Later D0 loses a third server for good, cannot restart, and gives its healthy servers
    back: P0 looks again and returns on two of them."""
    cfg, wl = _one_prefill_te()
    rc = cfg.recovery
    faults = [NodeFault(at_ns=S // 2, server=s) for s in (3, 4)]
    faults.append(NodeFault(at_ns=200 * S, server=5))
    res = replay(wl, cfg, faults=faults)
    first, killed, second = res.failovers
    assert (first.te, killed.te, second.te) == ("D0", "P0", "D0")
    assert first.back_ns > 0 and second.back_ns == -1
    assert killed.back_ns == second.down_ns + rc.prefill_restart_ns
    assert not {3, 4, 5} & set(killed.servers)
    late = [r for r in res.records if r.arrival_ns > killed.back_ns]
    assert late and all(r.outcome == "completed" for r in late)


@pytest.mark.parametrize("detect_ns", [0, None])
@pytest.mark.parametrize("servers", [(2, 3, 4), (0, 3), (0, 1, 5)])
def test_simultaneous_faults_recover_the_same_whatever_their_order_and_backend(servers, detect_ns):
    cfg, wl = _one_prefill_te()
    if detect_ns is not None:  # detected as they strike
        cfg = msgspec.structs.replace(
            cfg, recovery=msgspec.structs.replace(cfg.recovery, detect_ns=detect_ns)
        )

    def run(order, backend):
        faults = [NodeFault(at_ns=S, server=s, repair_ns=(5 * S if s == 4 else 0)) for s in order]
        res = replay(wl, cfg, faults=faults, backend=backend)
        return res.failovers, [(r.outcome, r.reason, r.finish_ns) for r in res.records]

    first = run(servers, "asyncio")
    assert run(tuple(reversed(servers)), "asyncio") == first
    assert run(tuple(reversed(servers)), "trio") == first
    # the lowest server's handler decides first: the reasons name it
    assert str(min(servers)) in first[0][0].reason


def test_a_restart_hit_by_a_second_fault_starts_again_at_once():
    """A Decode TE restarting on a server that then fails restarts again when the taint is
    seen, not after its first restart has run its course (which took two restarts' time)."""
    cfg, wl = _one_prefill_te()
    rc = cfg.recovery
    cfg = msgspec.structs.replace(cfg, recovery=msgspec.structs.replace(rc, spare_servers=2))
    first, second = NodeFault(at_ns=S, server=3), NodeFault(at_ns=5 * S, server=4)
    res = replay(wl, cfg, faults=[first, second])
    (decode,) = res.failovers
    assert decode.te == "D0" and decode.down_ns == S + rc.detect_ns
    assert decode.back_ns == 5 * S + rc.detect_ns + rc.decode_restart_ns
    assert not {3, 4} & set(decode.servers)
    assert res.summary.completed + res.summary.failed == len(wl)
