"""SPEC 11.3 "Stage 2": Decode vertical scale-down in a PD replay (P119), and the hang a node
fault causes until it is handled."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from xds.errors import ConfigError
from xds.serve.decode import DecodeConfig
from xds.serve.decode_model import expert_slots_per_die
from xds.serve.eplb.online import OnlineEPLBConfig
from xds.serve.jitter import JitterConfig
from xds.serve.prefill import PrefillConfig
from xds.serve.recovery import NodeFault, RecoveryConfig
from xds.serve.replay import PDConfig, replay
from xds.serve.scale_down import scaled_down_config
from xds.trace.workload import Request, Workload
from xds.units import MS, S

DECODE = DecodeConfig(
    dies=64, batch_per_die=4, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
)
CFG = PDConfig(
    prefill=PrefillConfig(tes=2, long_pool_tes=0),
    decode=DECODE,
    recovery=RecoveryConfig(
        mode="scale_down",
        detect_ns=500 * MS,
        decode_restart_ns=4 * S,
        prefill_restart_ns=2 * S,
        scale_down_ns=1 * S,
    ),
)
"""Servers: Prefill TEs 0-1 and 2-3; the Decode TE 4-7 (16 dies each, DP groups striped)."""

WL = Workload(tuple(Request(i, i * 100 * MS, 1500, 60) for i in range(120)))  # 12 s
AT = 3 * S
DETECTED = AT + CFG.recovery.detect_ns


def _dp(placement: str) -> int:
    return int(placement.split("/DP")[1])


@pytest.fixture(scope="module")
def scaled():
    return replay(WL, CFG, faults=[NodeFault(at_ns=AT, server=5)], event_log=True)


def test_the_deployment_has_room_to_lose_a_server():
    assert (CFG.servers, CFG.decode_servers) == (8, 4)
    assert expert_slots_per_die(DECODE) == 6  # ceil(256 / 60) + 1 redundant


def test_a_decode_fault_drops_only_that_servers_dp_groups(scaled):
    (fo,) = scaled.failovers
    assert fo.kind == "scale_down" and fo.te == "D0"
    assert fo.down_ns == DETECTED and fo.back_ns == DETECTED + CFG.recovery.scale_down_ns
    assert fo.dies == 48 and fo.servers == [4, 6, 7]
    lost = {dp for dp in range(64) if dp % 4 == 1}  # striped: server 5 is the 2nd of 4
    failed = [r for r in scaled.records if r.outcome == "failed"]
    assert len(failed) == fo.failed > 0
    for r in failed:  # exactly the requests held by the lost DP groups, with the reason
        assert "scaled down after an NPU fault on server 5" in r.reason
        assert r.finish_ns == DETECTED and _dp(r.decode_placement or "/DP-1") in lost | {-1}
    done = [r for r in scaled.records if r.outcome == "completed"]
    assert len(done) + len(failed) == len(WL)
    later = [r for r in done if r.arrival_ns > DETECTED]
    assert later and all(_dp(r.decode_placement) not in lost for r in later)
    assert not [r for r in scaled.records if r.outcome == "failed" and r.arrival_ns > DETECTED]
    assert [e.fields["dies"] for e in scaled.events.select("decode-te", "scaled-down")] == [48]


def test_the_decode_te_hangs_from_the_fault_until_it_serves_again(scaled):
    resumed = DETECTED + CFG.recovery.scale_down_ns
    survivors = [r for r in scaled.records if r.outcome == "completed" and r.arrival_ns < AT]
    spanning = [r for r in survivors if r.first_token_ns < AT < r.finish_ns]
    assert spanning
    for r in spanning:
        assert not [t for t in r.token_ns if AT < t < resumed]  # no token while hung
        gaps = np.diff([r.first_token_ns, *r.token_ns])
        assert gaps.max() >= resumed - AT
    (hang,) = scaled.events.select("decode-te", "hang")
    assert hang.t_ns == AT


def test_scale_down_keeps_more_requests_than_a_restart(scaled):
    independent = msgspec.structs.replace(
        CFG, recovery=msgspec.structs.replace(CFG.recovery, mode="independent")
    )
    res = replay(WL, independent, faults=[NodeFault(at_ns=AT, server=5)])
    assert res.summary.completed < scaled.summary.completed
    assert res.failovers[0].kind == "restart"


def test_scale_down_replays_are_deterministic(scaled):
    again = replay(WL, CFG, faults=[NodeFault(at_ns=AT, server=5)], event_log=True)
    assert msgspec.json.encode(again.records) == msgspec.json.encode(scaled.records)
    assert again.events.digest() == scaled.events.digest()


def test_a_second_fault_scales_down_again_until_experts_would_lose_their_last_replica():
    res = replay(
        WL,
        CFG,
        faults=[NodeFault(at_ns=AT, server=5), NodeFault(at_ns=AT + 2 * S, server=6)],
    )
    first, second = res.failovers[:2]
    assert (first.kind, first.dies) == ("scale_down", 48)
    # 256 experts on the 30 routed-expert dies left would need 9 slots; they have 6
    assert second.kind == "restart" and "no scale-down: 256 routed experts" in second.reason
    assert res.summary.completed + res.summary.failed == len(WL)


def test_scaled_down_config_keeps_a_replica_of_every_expert():
    alive = np.ones(64, dtype=bool)
    smaller, why = scaled_down_config(DECODE, alive, list(range(1, 64, 4)), 1000)
    assert why == "" and smaller is not None
    assert (smaller.dies, smaller.shared_expert_dies, smaller.kv_blocks_per_die) == (48, 3, 1000)
    # 43 routed dies x 6 slots hold 256 experts; 42 do not (ceil(256 / 42) = 7)
    lose = [dp for dp in range(60) if dp < 17]
    assert scaled_down_config(DECODE, alive, lose, 1000)[0] is not None
    none, why = scaled_down_config(DECODE, alive, [*lose, 17], 1000)
    assert none is None and "need 7 slots each; they have 6" in why
    none, why = scaled_down_config(DECODE, alive, [60, 61, 62, 63], 1000)
    assert none is None and "shared expert would have no replica" in why
    assert scaled_down_config(DECODE, alive, [], 1000)[1].startswith("none of the TE's dies")
    eplb = msgspec.structs.replace(
        DECODE, dies=260, shared_expert_dies=4, eplb=OnlineEPLBConfig(), kv_blocks_per_die=1000
    )
    none, why = scaled_down_config(eplb, np.ones(260, dtype=bool), [0], 1000)
    assert none is None and "online EPLB places one routed expert per die" in why


def test_a_prefill_te_hangs_until_its_fault_is_handled():
    independent = msgspec.structs.replace(
        CFG, recovery=msgspec.structs.replace(CFG.recovery, mode="independent")
    )
    res = replay(WL, independent, faults=[NodeFault(at_ns=AT, server=1)])
    p0 = [r for r in res.records if (r.prefill_placement or "").startswith("P0")]
    assert not [r for r in p0 if AT < r.first_token_ns < DETECTED]  # no step ends while hung
    assert all("Prefill TE 0 lost" in r.reason for r in res.records if r.outcome == "failed")


def test_scale_down_is_a_recovery_mode():
    with pytest.raises(ConfigError, match="mode"):
        RecoveryConfig(mode="shrink")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="scale_down_ns"):
        RecoveryConfig(scale_down_ns=-1)
