"""SPEC 11.3 in a PD replay: Decode vertical scale-down (stage 2, P119), the hang a node fault
causes until it is handled, and on-chip memory faults masking KV blocks (stage 3, P120)."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xds
from xds.errors import ConfigError
from xds.serve.decode import DecodeConfig
from xds.serve.decode_model import expert_slots_per_die
from xds.serve.eplb.online import OnlineEPLBConfig
from xds.serve.jitter import JitterConfig
from xds.serve.kv import KVBlockManager
from xds.serve.prefill import PrefillConfig
from xds.serve.recovery import MemoryFault, NodeFault, RecoveryConfig
from xds.serve.replay import DistFlowFault, PDConfig, replay
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


# -- on-chip memory faults (SPEC 11.2 stage 3, P120) ------------------------------------------


def test_a_memory_fault_fails_only_the_requests_whose_kv_lay_there():
    busy = Workload(tuple(Request(i, i * 20 * MS, 1500, 200) for i in range(200)))
    fault = MemoryFault(at_ns=2 * S, dp=0, first_block=0, blocks=20)
    res = replay(busy, CFG, faults=[fault], event_log=True)
    (mask,) = res.kv_masks
    assert (mask.te, mask.dp, mask.first_block, mask.blocks, mask.skipped) == ("D0", 0, 0, 20, "")
    failed = [r for r in res.records if r.outcome == "failed"]
    assert len(failed) == mask.failed >= 1
    for r in failed:
        assert (
            r.reason
            == "KV lost to an on-chip memory fault on Decode TE 0 DP 0 (blocks 0..19 masked)"
        )
        assert r.decode_placement in (None, "D0/DP0") and r.finish_ns == 2 * S
    for r in res.records:  # every other request decodes every token, once
        if r.outcome == "completed":
            assert len(r.token_ns) == r.output_tokens - 1
            assert all(b >= a for a, b in zip(r.token_ns, r.token_ns[1:], strict=False))
    later = [r for r in res.records if r.decode_placement == "D0/DP0" and r.arrival_ns > 2 * S]
    assert later and all(r.outcome == "completed" for r in later)  # the DP serves on
    assert not res.failovers  # nothing restarted or scaled down


def test_memory_faults_on_a_dp_out_of_service_are_skipped_with_a_reason():
    res = replay(
        WL,
        CFG,
        faults=[
            NodeFault(at_ns=AT, server=5),  # DP 1 is on server 5: scaled down at 3.5 s
            MemoryFault(at_ns=AT + 1 * S, dp=1),
        ],
    )
    (mask,) = res.kv_masks
    assert mask.failed == 0 and "was not in service" in mask.skipped


def test_bad_memory_faults_name_the_field():
    for fault, field in (
        (MemoryFault(at_ns=0, dp=64), "dp"),
        (MemoryFault(at_ns=0, dp=0, decode_te=1), "decode_te"),
        (MemoryFault(at_ns=0, dp=0, first_block=10**9), "first_block"),
    ):
        with pytest.raises(ConfigError) as err:
            replay(WL, CFG, faults=[fault])
        assert err.value.field == f"faults[0].{field}"  # the CLI says --fault #1 {field}
    with pytest.raises(ConfigError, match="blocks"):
        MemoryFault(at_ns=0, dp=0, blocks=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 6)), max_size=80))
def test_kv_blocks_by_address_with_masks_are_conserved_and_isolated(ops):
    kv = KVBlockManager(64, block_tokens=4)
    live: list[int] = []
    for i, (op, a, b) in enumerate(ops):
        if op == 0 and kv.can_admit(a):
            kv.admit(i, a)
            live.append(i)
        elif op == 1 and live:
            kv.extend(live[a % len(live)], b)
        elif op == 2 and live:
            kv.release(live.pop(a % len(live)))
        elif op == 3:
            first = min(a, 63)
            count = min(b, 64 - first)
            bad = set(range(first, first + count))
            hit = kv.mask(first, count)
            assert hit == [r for r in live if bad & _blocks(kv, r)]
            for r in hit:
                kv.release(r)
                live.remove(r)
        kv.check()
        masked = {x for s, e in kv.masked for x in range(s, e)}
        for r in live:  # nothing admitted or grown after a mask lands in it
            assert not _blocks(kv, r) & masked  # hit requests failed; nothing lands there
    for r in live:
        kv.release(r)
    kv.check()
    assert kv.free + len({x for s, e in kv.masked for x in range(s, e)}) == 64


def _blocks(kv: KVBlockManager, request: int) -> set[int]:
    return {x for s, e in kv.blocks_of(request) for x in range(s, e)}


def test_a_repaired_server_rejoins_the_scaled_down_decode_te():
    repair = 4 * S
    res = replay(WL, CFG, faults=[NodeFault(at_ns=AT, server=5, repair_ns=repair)], event_log=True)
    down, up = res.failovers
    assert (down.kind, down.dies, up.kind, up.dies) == ("scale_down", 48, "scale_up", 64)
    assert up.down_ns == AT + repair and up.back_ns == AT + repair + CFG.recovery.scale_down_ns
    assert up.servers == [4, 5, 6, 7]
    back = {dp for dp in range(64) if dp % 4 == 1}
    rejoined = [
        r
        for r in res.records
        if r.arrival_ns > up.back_ns and r.decode_placement and _dp(r.decode_placement) in back
    ]
    assert rejoined and all(r.outcome == "completed" for r in rejoined)
    assert [e.fields["dies"] for e in res.events.select("decode-te", "scaled-up")] == [64]
    assert res.summary.completed + res.summary.failed == len(WL)


def test_a_kv_transfer_to_a_dropped_dp_group_ends_cancelled():
    # the P0-D0 link is down while the fault is handled: transfers to the lost DP groups are
    # stalled in flight when their requests fail (the balanced prefill steps' timing puts
    # some there)
    balanced = msgspec.structs.replace(
        CFG, prefill=msgspec.structs.replace(CFG.prefill, balance_split=True)
    )
    res = replay(
        WL,
        balanced,
        faults=[
            NodeFault(at_ns=AT, server=5),
            DistFlowFault(
                at_ns=AT + 200 * MS, prefill_te=0, decode_te=0, kind="link_down", duration_ns=S
            ),
        ],
        event_log=True,
    )
    assert res.summary.completed + res.summary.failed == len(WL)  # and every check passed
    assert res.events.select("distflow", "abandoned")


def test_a_scale_down_record_stays_open_if_a_later_fault_restarts_the_te():
    res = replay(
        WL, CFG, faults=[NodeFault(at_ns=AT, server=5), NodeFault(at_ns=AT + 200 * MS, server=6)]
    )
    first, second = res.failovers[:2]
    assert first.kind == "scale_down" and second.kind == "restart"
    assert first.back_ns == -1 and first.dies == -1  # it never served again as such
    assert second.back_ns > second.down_ns


def test_a_te_restarted_onto_a_struck_server_loses_its_iteration_when_scaled_down():
    decode = msgspec.structs.replace(DECODE, dies=96, shared_expert_dies=8)  # servers 4-9
    cfg = msgspec.structs.replace(
        CFG,
        decode=decode,
        recovery=msgspec.structs.replace(CFG.recovery, detect_ns=2 * S, spare_servers=2),
    )
    res = replay(
        WL,
        cfg,
        faults=[
            NodeFault(at_ns=AT, server=5),  # scaled down at 5 s
            NodeFault(at_ns=AT + 100 * MS, server=6),  # refused: restart on 4, 7-11 until 9.1 s
            NodeFault(at_ns=8500 * MS, server=10),  # the restarting TE's new server
        ],
    )
    kinds = [(f.kind, f.back_ns >= 0) for f in res.failovers]
    assert kinds == [("scale_down", False), ("restart", True), ("scale_down", True)]
    for r in res.records:
        if r.outcome == "completed":
            assert len(r.token_ns) == r.output_tokens - 1


@pytest.mark.parametrize(
    ("backend", "schedule_seed"), [("asyncio", None)] + [("trio", s) for s in range(4)]
)
def test_requests_held_under_backpressure_are_routed_first_come_first_served(
    backend, schedule_seed
):
    from xds.serve.decode_te import DecodeTE, comm_grid
    from xds.trace.metrics import RequestRecord

    config = DecodeConfig(
        dies=4,
        batch_per_die=1,
        shared_expert_dies=0,
        kv_blocks_per_die=1000,
        jitter=JitterConfig(enabled=False),
    )
    grid = comm_grid(config)
    order: list[int] = []

    async def main() -> None:
        te = DecodeTE(config, grid)
        recs = [RequestRecord(i, 0, 100, 10) for i in range(10)]

        async def one(rec: RequestRecord) -> None:
            dp = await te.route(rec)
            order.append(rec.request_id)
            if rec.request_id >= 4:  # a held one: give its slot back a little later
                await xds.sleep_ns(1_000)
            else:
                await xds.sleep_ns(10_000 * (rec.request_id + 1))
            te.abandon(dp, rec)

        async with anyio.create_task_group() as tg:
            for rec in recs[:8]:
                tg.start_soon(one, rec)
                await xds.sleep_ns(10)  # arrival order 0, 1, ..., 7
            await xds.sleep_ns(20_000 - 80)  # request 1 frees its slot at 20 us
            for rec in recs[8:]:
                tg.start_soon(one, rec)  # newcomers, one at that very instant: behind 5-7
                await xds.sleep_ns(10)

    xds.run(main, backend=backend, schedule_seed=schedule_seed)
    assert order == list(range(10))


def test_a_dp_whose_masked_kv_cannot_hold_a_request_is_not_offered_it():
    small = msgspec.structs.replace(DECODE, batch_per_die=1, kv_blocks_per_die=100)
    cfg = msgspec.structs.replace(CFG, decode=small)
    burst = Workload(tuple(Request(i, 1 * S + i * MS, 3000, 400) for i in range(100)))  # 27 blocks
    res = replay(burst, cfg, faults=[MemoryFault(at_ns=0, dp=0, first_block=10, blocks=90)])
    assert res.summary.completed == 100  # DP0 keeps 10 usable blocks: nobody waits on it
    assert not [r for r in res.records if r.decode_placement == "D0/DP0"]


def test_a_deferred_recv_that_can_no_longer_fit_fails_with_a_reason():
    small = msgspec.structs.replace(DECODE, batch_per_die=4, kv_blocks_per_die=100)
    cfg = msgspec.structs.replace(CFG, decode=small)
    burst = Workload(tuple(Request(i, i * MS, 7000, 600) for i in range(128)))  # 60 blocks each
    res = replay(burst, cfg, faults=[MemoryFault(at_ns=3 * S, dp=0, first_block=30, blocks=70)])
    failed = [r for r in res.records if r.outcome == "failed"]
    assert failed and res.summary.completed + len(failed) == len(burst)
    reasons = {r.reason for r in failed}
    assert (
        "sequence of 7600 tokens no longer fits decode DP D0/DP0 (a memory fault masked part "
        "of its KV)" in reasons
    )


def test_memory_faults_while_the_engine_restarts_are_skipped():
    rw = msgspec.structs.replace(
        CFG, recovery=msgspec.structs.replace(CFG.recovery, mode="restart_world")
    )
    res = replay(WL, rw, faults=[NodeFault(at_ns=AT, server=5), MemoryFault(at_ns=5 * S, dp=0)])
    (mask,) = res.kv_masks
    assert mask.skipped.startswith("Decode TE 0 was not in service") and mask.failed == 0


def test_a_server_failing_again_rejoins_only_after_its_last_repair():
    twice = [
        NodeFault(at_ns=AT, server=5, repair_ns=4 * S),  # repaired at 7 s
        NodeFault(at_ns=5 * S, server=5, repair_ns=10 * S),  # while scaled out: until 15 s
    ]
    long = Workload(tuple(Request(i, i * 100 * MS, 1500, 60) for i in range(180)))  # 18 s
    res = replay(long, CFG, faults=twice, event_log=True)
    up = [f for f in res.failovers if f.kind == "scale_up"]
    assert len(up) == 1 and up[0].down_ns == 15 * S
    back = {dp for dp in range(64) if dp % 4 == 1}
    early = [
        r
        for r in res.records
        if r.decode_placement
        and _dp(r.decode_placement) in back
        and DETECTED < r.first_token_ns < 15 * S
    ]
    assert not early
    again = [
        NodeFault(at_ns=AT, server=5, repair_ns=2 * S),
        NodeFault(at_ns=5100 * MS, server=5, repair_ns=3 * S),
    ]
    res = replay(long, CFG, faults=again)  # fails again while rejoining: its next repair
    assert [(f.kind, f.dies) for f in res.failovers] == [("scale_down", 48), ("scale_up", 64)]


def test_the_command_line_reports_scale_down_and_scale_up(capsys, tmp_path):
    import json

    from xds.cli.main import main

    argv = ["replay", "--synthetic", "60", "--rate", "2", "--recovery", "scale_down"]
    fault = ["--fault", "node:at=10,server=12,repair=10", "--out", str(tmp_path)]
    assert main([*argv, *fault]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "scale-down D0" in out and "on 112 dies" in out
    assert "scale-up D0" in out and "serving on 128 dies again" in out
    assert "failover D0" not in out
    written = json.loads((tmp_path / "faults.json").read_text())
    assert [(f["kind"], f["dies"]) for f in written["failovers"]] == [
        ("scale_down", 112),
        ("scale_up", 128),
    ]
    assert written["restarts"] == [] and written["kv_masks"] == []


def test_a_scaled_down_te_restarted_by_a_second_fault_ends_every_request():
    faults = [
        NodeFault(at_ns=1 * S, server=0),  # Prefill TE 0 gone for good
        NodeFault(at_ns=1 * S, server=2),  # Prefill TE 1 too: no kill-P can help Decode
        NodeFault(at_ns=AT, server=5, repair_ns=4 * S),  # D0 scales down; repaired at 7 s
        NodeFault(at_ns=AT + 200 * MS, server=6, repair_ns=4300 * MS),  # refused; back 7.5 s
    ]
    res = replay(WL, CFG, faults=faults)
    d0 = [f for f in res.failovers if f.te == "D0"]
    assert [f.kind for f in d0] == ["scale_down", "restart"]
    assert d0[1].back_ns >= 0 and 5 not in d0[1].servers  # restarted before 5 was repaired
    assert res.summary.completed + res.summary.failed == len(WL)


@pytest.mark.parametrize(
    ("mode", "failed_server", "remasked"),
    [
        ("independent", 5, ["D0/DP1"]),  # D0 restarts on 0, 4, 6, 7: DP 1 lands on (4, die 0)
        ("restart_world", 5, ["D0/DP0"]),  # the same layout shifted: DP 0 on (4, die 0)
        ("restart_world", 4, []),  # server 4 itself failed and was repaired: a new die
    ],
)
def test_bad_memory_outlives_a_restart_of_its_te_until_the_server_is_repaired(
    mode, failed_server, remasked
):
    cfg = msgspec.structs.replace(CFG, recovery=msgspec.structs.replace(CFG.recovery, mode=mode))
    faults = [
        MemoryFault(at_ns=1 * S, dp=0, first_block=0, blocks=20),  # DP 0: server 4, die 0
        NodeFault(at_ns=AT, server=failed_server, repair_ns=2 * S),
    ]
    res = replay(WL, cfg, faults=faults, event_log=True)
    (mask,) = res.kv_masks
    assert (mask.server, mask.skipped) == (4, "")
    assert mask.remasked == remasked
    remasks = [e for e in res.events if e.event == "memory-remasked"]
    assert [f"{e.fields['te']}/DP{e.fields['dp']}" for e in remasks] == remasked
    if mode == "restart_world":  # DP 0 is back on server 4's die 0 either way
        assert res.restarts[0].placement.decode[0][0] == 4
