"""SPEC 11.3: heartbeats, rollback, memory-fault remap and the global one-outcome invariant."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xds
from xds.errors import ConfigError
from xds.runtime import run
from xds.serve.reliability import (
    ExecutorCrash,
    ExecutorHang,
    HeartbeatConfig,
    LayerTimes,
    MemoryFault,
    NetworkError,
    ReliabilityConfig,
    ReliabilityResult,
    ReliableDecode,
    RollbackConfig,
    SlowIteration,
)
from xds.serve.reliability.kv_space import AddressedKV
from xds.units import MS, US

SMALL = ReliabilityConfig(dps=4, batch_per_dp=3, layers=3, output_tokens=10)


def _run(cfg: ReliabilityConfig, *, seed: int = 0, backend: str = "asyncio", events=None):
    async def main() -> ReliabilityResult:
        result = await ReliableDecode(cfg).run()
        if events is not None:
            events.extend(xds.current_runtime().events)
        return result

    return run(main, seed=seed, backend=backend, event_log=events is not None)


def _faults(*faults) -> ReliabilityConfig:
    return msgspec.structs.replace(SMALL, faults=tuple(faults))


@pytest.fixture(scope="module")
def clean() -> ReliabilityResult:
    return _run(SMALL)


def _check_one_outcome_each(cfg: ReliabilityConfig, res: ReliabilityResult) -> None:
    """The global invariant: every admitted request ends exactly once; tokens are streamed
    once each, in order, and only after their commit."""
    assert [o.request for o in res.outcomes] == list(range(cfg.dps * cfg.batch_per_dp))
    for o in res.outcomes:
        assert o.streamed == o.tokens  # every committed token streamed once, nothing else
        if o.state == "completed":
            assert len(o.tokens) == cfg.output_tokens
        else:
            assert o.reason


def test_a_fault_free_run_completes_every_request(clean):
    _check_one_outcome_each(SMALL, clean)
    assert clean.completed() == 12 and not clean.stopped and not clean.rollbacks
    assert clean.iterations == SMALL.output_tokens - 1
    per = SMALL.times.iteration_ns(SMALL.layers) + SMALL.scheduler_gap_ns
    # host jitter only ever delays the first dispatch; in lockstep the time is exact
    assert clean.iterations * per < clean.elapsed_ns < clean.iterations * (per + MS)
    lockstep = _run(msgspec.structs.replace(SMALL, host_jitter_mean_ns=0))
    assert lockstep.elapsed_ns == clean.iterations * per
    assert [o.tokens for o in lockstep.outcomes] == [o.tokens for o in clean.outcomes]
    assert len({t for o in clean.outcomes for t in o.tokens}) > 3  # tokens do vary


def test_rollback_redoes_the_iteration_and_gives_the_fault_free_tokens(clean):
    cfg = _faults(NetworkError(dp=2, iteration=4, layer=1))
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    assert [o.tokens for o in res.outcomes] == [o.tokens for o in clean.outcomes]
    assert res.completed() == 12 and res.iterations == clean.iterations
    (rb,) = res.rollbacks
    assert (rb.iteration, rb.attempt, rb.code, rb.origin_dp) == (4, 0, "LINK_FLAP", 2)
    assert rb.broadcast_ns == rb.error_ns + cfg.rollback.broadcast_ns
    assert sorted(rb.observed_ns) == [0, 1, 2, 3]  # every DP saw it
    assert rb.polling == [0, 1, 3]  # the others were in the layer-1 dispatch busy-poll
    for dp in rb.polling:  # reach: within one poll interval
        assert 0 <= rb.observed_ns[dp] - rb.broadcast_ns <= cfg.poll_ns
    assert rb.redo_ns >= max(rb.observed_ns.values())  # nobody redoes before all acknowledged
    # the cost: the lost part of the iteration, up to the broadcast
    assert res.elapsed_ns > clean.elapsed_ns


def test_rollback_reaches_a_die_busy_computing_at_its_next_poll():
    """SPEC 11.3 "Reach": every DP sees the rollback within one poll interval of the
    broadcast, the ones polling at a barrier and the one still computing a kernel alike (its
    poll loop reads the flag between polls; the kernel is abandoned)."""
    cfg = msgspec.structs.replace(
        _faults(
            NetworkError(dp=0, iteration=2, layer=0),
            SlowIteration(dp=3, iteration=2, extra_ns=300 * US + 3),
        ),
        host_jitter_mean_ns=0,  # lockstep, so DP 3's arrival is known to the nanosecond
    )
    res = _run(cfg)
    (rb,) = res.rollbacks
    assert 3 not in rb.polling and rb.polling == [1, 2]
    arrival_3 = rb.error_ns + 300 * US + 3  # when DP 3's slow kernel would have ended
    assert rb.observed_ns[3] < arrival_3
    assert all(0 <= rb.observed_ns[d] - rb.broadcast_ns <= cfg.poll_ns for d in (1, 2, 3))
    assert res.completed() == 12


def test_tokens_differ_if_the_kv_is_not_restored(clean, monkeypatch):
    """The exactness check has teeth: skip the KV restore and the redo's tokens change."""
    monkeypatch.setattr(AddressedKV, "restore", lambda self: None)
    res = _run(_faults(NetworkError(dp=1, iteration=3, layer=2)))
    assert [o.tokens for o in res.outcomes] != [o.tokens for o in clean.outcomes]


def test_repeated_errors_escalate_after_max_retries():
    cfg = _faults(NetworkError(dp=1, iteration=3, layer=0, attempts=10))
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    assert len(res.rollbacks) == cfg.rollback.max_retries
    assert [r.attempt for r in res.rollbacks] == [0, 1]
    assert "rolled back 2 times and failed again with LINK_FLAP" in res.stopped
    assert res.completed() == 0 and res.iterations == 3
    assert all(o.reason == res.stopped for o in res.failed())
    assert all(len(o.tokens) == 4 for o in res.outcomes)  # committed before the fault only


def test_a_code_outside_the_rollback_list_escalates_at_once():
    res = _run(_faults(NetworkError(dp=0, iteration=1, code="HBM_ECC")))
    assert not res.rollbacks and "HBM_ECC" in res.stopped and res.completed() == 0
    off = msgspec.structs.replace(
        _faults(NetworkError(dp=0, iteration=1)), rollback=RollbackConfig(enabled=False)
    )
    assert "LINK_FLAP" in _run(off).stopped


@pytest.mark.parametrize("fault", [ExecutorHang, ExecutorCrash])
def test_a_hang_or_crash_is_caught_by_the_heartbeat_within_period_plus_timeout(fault):
    hb = HeartbeatConfig(dp_period_ns=40 * MS, control_period_ns=100 * MS, timeout_ns=60 * MS)
    cfg = msgspec.structs.replace(SMALL, heartbeat=hb, faults=(fault(dp=2, iteration=3),))
    events: list = []
    res = _run(cfg, events=events)
    _check_one_outcome_each(cfg, res)
    kind = "hang" if fault is ExecutorHang else "crashed"
    (struck,) = [e.t_ns for e in events if (e.component, e.event) == ("executor", kind)]
    (v2,) = [v for v in res.verdicts if v.dp == 2]
    assert v2.fault_injected
    assert 0 < v2.marked_ns - struck <= hb.dp_period_ns + hb.timeout_ns
    assert v2.marked_ns == v2.ping_ns + hb.timeout_ns
    # the others stall at the next dispatch barrier, so their masters go quiet too
    assert {v.dp for v in res.verdicts} == {0, 1, 2, 3}
    # the two periods are independent: pings on the DP grid, the control plane on its own
    assert all(v.ping_ns % hb.dp_period_ns == 0 for v in res.verdicts)
    assert v2.seen_by_control_plane_ns % hb.control_period_ns == 0
    assert 0 <= v2.seen_by_control_plane_ns - v2.marked_ns <= hb.control_period_ns
    assert res.stopped.startswith("restart-the-world: DPs 0, 1, 2, 3 missed")
    assert res.completed() == 0 and res.iterations == 3
    assert res.elapsed_ns == v2.seen_by_control_plane_ns


def test_a_long_healthy_iteration_is_a_false_positive():
    """The reply sits on the progress path: an iteration longer than the timeout gets the DP
    marked although nothing is wrong (SPEC 11.3's trade-off)."""
    hb = HeartbeatConfig(
        dp_period_ns=5 * MS, control_period_ns=10 * MS, timeout_ns=20 * MS, on_unhealthy="report"
    )
    cfg = msgspec.structs.replace(
        SMALL, heartbeat=hb, faults=(SlowIteration(dp=1, iteration=2, extra_ns=50 * MS),)
    )
    res = _run(cfg)
    assert res.verdicts and not any(v.fault_injected for v in res.verdicts)
    assert res.completed() == 12 and not res.stopped  # "report": the run goes on
    # the same slow iteration under a generous timeout raises nothing
    relaxed = msgspec.structs.replace(
        cfg, heartbeat=msgspec.structs.replace(hb, timeout_ns=MS * 80)
    )
    assert not _run(relaxed).verdicts
    # and restarts the world when the control plane acts on it
    strict = msgspec.structs.replace(
        cfg, heartbeat=msgspec.structs.replace(hb, on_unhealthy="restart")
    )
    assert _run(strict).stopped.startswith("restart-the-world")


def test_a_hang_nobody_detects_ends_by_the_watchdog():
    """Heartbeats off, or on but only reporting: the watchdog still ends the run, naming the
    DP stopped outside a barrier, and every request ends with that reason."""
    for hb in (HeartbeatConfig(enabled=False), HeartbeatConfig(on_unhealthy="report")):
        cfg = msgspec.structs.replace(
            _faults(ExecutorHang(dp=1, iteration=2)), heartbeat=hb, stall_limit_ns=5_000 * MS
        )
        res = _run(cfg)
        _check_one_outcome_each(cfg, res)
        assert res.stopped.startswith("watchdog: no iteration committed for 5 s")
        assert res.stopped.endswith("outside a global barrier: 1")
        assert res.completed() == 0 and res.iterations == 2


def test_a_memory_fault_fails_only_the_requests_whose_kv_lay_there(clean):
    # after prefill DP 1's sequences (requests 3, 4, 5) hold blocks 0-1, 2-3 and 4-5
    # (8 prompt tokens, 4 a block); decoding takes blocks from 6 up
    cfg = _faults(MemoryFault(dp=1, iteration=5, first_block=3, blocks=1))
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    failed = res.failed()
    assert [o.request for o in failed] == [4]  # DP 1's second sequence
    assert "on-chip memory fault (blocks 3..3)" in failed[0].reason
    assert len(failed[0].tokens) == 6  # what it had committed stays streamed
    assert res.masked_blocks == {1: [3]}
    ok = {o.request: o.tokens for o in clean.outcomes}
    assert all(o.tokens == ok[o.request] for o in res.outcomes if o.state == "completed")
    assert res.completed() == 11 and not res.stopped


def test_masked_blocks_are_never_allocated_again():
    kv = AddressedKV(10, block_tokens=2)
    kv.admit(1, 4)  # blocks 0, 1
    assert kv.mask(1, 3) == [1]  # blocks 1-3 bad; request 1 held block 1
    kv.release(1)
    kv.check()
    kv.admit(2, 12)  # six blocks: only 0 and 4.. are usable
    assert kv.blocks_of(2) == [0, 4, 5, 6, 7, 8]
    assert not kv.append(2, 4)  # two more blocks needed, one left
    kv.check()


def test_restore_truncates_to_the_checkpoint_and_frees_the_blocks():
    kv = AddressedKV(8, block_tokens=2)
    kv.admit(1, 3)
    kv.admit(2, 2)
    assert kv.append(1, 1) and kv.append(2, 1)  # 2 grows into a new block
    kv.restore()
    assert (kv.tokens(1), kv.tokens(2)) == (3, 2) and kv.blocks_of(2) == [2]
    assert kv.free == 5
    assert kv.append(2, 1)
    kv.commit()
    kv.restore()
    assert kv.tokens(2) == 3
    kv.check()


def test_the_same_seed_gives_the_same_run_on_both_backends():
    cfg = _faults(
        NetworkError(dp=3, iteration=2, layer=2), MemoryFault(dp=0, iteration=6, first_block=0)
    )
    a = _run(cfg, seed=4)
    assert a == _run(cfg, seed=4) == _run(cfg, seed=4, backend="trio")
    assert a != _run(cfg, seed=5)  # content weights and prompts come from the seed


def test_bad_fault_plans_name_the_field():
    cases = [
        (dict(faults=(ExecutorHang(dp=4, iteration=0),)), "faults[0].dp"),
        (dict(faults=(NetworkError(dp=0, iteration=0, layer=3),)), "faults[0].layer"),
        (
            dict(faults=(MemoryFault(dp=0, iteration=0, first_block=63, blocks=2),)),
            "faults[0].blocks",
        ),
        (
            dict(faults=(MemoryFault(dp=0, iteration=0, first_block=64),)),
            "faults[0].first_block",
        ),
        (  # the second would never strike: the DP's executor has stopped
            dict(faults=(ExecutorHang(dp=1, iteration=2), ExecutorCrash(dp=1, iteration=2))),
            "faults[1]",
        ),
        (dict(kv_blocks_per_dp=8), "kv_blocks_per_dp"),
    ]
    for change, field in cases:
        with pytest.raises(ConfigError) as err:
            msgspec.structs.replace(SMALL, **change)
        assert err.value.field == field
    with pytest.raises(ConfigError, match="iteration"):
        SlowIteration(dp=0, iteration=-1, extra_ns=1)
    loaded = msgspec.json.decode(
        b'{"faults": [{"kind": "network_error", "dp": 1, "iteration": 2}]}', type=ReliabilityConfig
    )
    assert loaded.faults == (NetworkError(dp=1, iteration=2),)


def test_layer_times_come_from_the_cost_model():
    from xds.serve.reliability import layer_times

    assert layer_times() == LayerTimes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.builds(
                NetworkError,
                dp=st.integers(0, 3),
                iteration=st.integers(0, 8),
                layer=st.integers(0, 2),
                attempts=st.integers(1, 3),
                code=st.sampled_from(["LINK_FLAP", "ROUTE_CONVERGENCE"]),
            ),
            st.builds(
                MemoryFault,
                dp=st.integers(0, 3),
                iteration=st.integers(0, 8),
                first_block=st.integers(0, 60),
                blocks=st.integers(1, 4),
            ),
            st.builds(
                SlowIteration,
                dp=st.integers(0, 3),
                iteration=st.integers(0, 8),
                extra_ns=st.integers(0, 2 * MS),
            ),
        ),
        max_size=4,
    )
)
def test_any_plan_of_transient_faults_keeps_every_request_and_the_tokens(faults):
    """Whatever network errors, memory faults and slow iterations strike: every request ends
    once; a request that completes has exactly the fault-free tokens; KV is conserved (checked
    at the end of every run); the run stops early only by escalation."""
    cfg = _faults(*faults)
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    clean = _clean_tokens()
    for o in res.outcomes:
        assert o.tokens == clean[o.request][: len(o.tokens)]
        if o.state == "failed" and not res.stopped:
            assert "memory fault" in o.reason or "no KV block" in o.reason
    assert not res.stopped or "rolled back" in res.stopped


_CLEAN: dict[int, list[int]] = {}


def _clean_tokens() -> dict[int, list[int]]:
    if not _CLEAN:
        _CLEAN.update({o.request: o.tokens for o in _run(SMALL).outcomes})
    return _CLEAN


SCALE = msgspec.structs.replace(
    SMALL,
    output_tokens=30,
    heartbeat=HeartbeatConfig(
        dp_period_ns=40 * MS,
        control_period_ns=100 * MS,
        timeout_ns=60 * MS,
        on_unhealthy="scale_down",
    ),
)


@pytest.mark.parametrize("fault", [ExecutorHang, ExecutorCrash])
def test_scale_down_removes_the_dead_dp_and_the_others_go_on(fault):
    """Stage 2 (P119): the DP that stopped outside a barrier is removed with its EP rank; its
    requests fail with the reason; the survivors redo the interrupted iteration on fewer dies
    and finish with exactly the fault-free tokens."""
    clean = {o.request: o.tokens for o in _run(SCALE).outcomes}
    cfg = msgspec.structs.replace(SCALE, faults=(fault(dp=2, iteration=3),))
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    assert not res.stopped
    assert [o.request for o in res.failed()] == [6, 7, 8]  # DP 2's sequences
    assert all("DP 2 removed by decode scale-down" in o.reason for o in res.failed())
    assert all(o.tokens == clean[o.request] for o in res.outcomes if o.state == "completed")
    (sd,) = res.scale_downs
    assert sd.removed == [2] and sd.live_dps == 3 and sd.min_replicas >= 1
    assert sd.expert_scale > 1  # experts 0 and 1 lost a replica: die 0 carries them alone
    (abort,) = res.rollbacks
    assert abort.code == "SCALE_DOWN" and abort.iteration == 3 and abort.polling == [0, 1, 3]
    assert sorted(abort.observed_ns) == [0, 1, 3]
    # the survivors' masters were stalled behind DP 2, marked too, and answer again
    assert {v.dp for v in res.verdicts} == {0, 1, 2, 3}


def test_scale_down_that_would_orphan_an_expert_restarts_the_world():
    cfg = msgspec.structs.replace(
        SCALE, slots_per_die=1, faults=(ExecutorCrash(dp=2, iteration=3),)
    )
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    assert "would leave experts [2] without a replica" in res.stopped
    assert res.completed() == 0 and not res.scale_downs


def test_scale_down_is_the_same_run_on_both_backends():
    cfg = msgspec.structs.replace(SCALE, faults=(ExecutorHang(dp=1, iteration=5),))
    assert _run(cfg, seed=2) == _run(cfg, seed=2, backend="trio")


@settings(max_examples=60, deadline=None)
@given(
    experts=st.integers(1, 12),
    dies=st.integers(1, 8),
    slots=st.integers(1, 4),
    lost=st.sets(st.integers(0, 7)),
)
def test_scale_down_keeps_a_replica_of_every_expert_or_refuses(experts, dies, slots, lost):
    from xds.serve.reliability.experts import ExpertPlacement

    if dies * slots < experts:
        with pytest.raises(ConfigError):
            ExpertPlacement.round_robin(experts, dies, slots)
        return
    full = ExpertPlacement.round_robin(experts, dies, slots)
    assert sorted(full.replicas) == list(range(experts))
    assert sum(map(len, full.replicas.values())) == dies * slots
    lost = {d for d in lost if d < dies}
    orphans = full.orphans(lost)
    if orphans:
        with pytest.raises(ConfigError, match="no replica"):
            full.without(lost)
        assert all(set(full.replicas[e]) <= lost for e in orphans)
        return
    after = full.without(lost)
    assert after.min_replicas() >= 1
    assert not {d for ds in after.replicas.values() for d in ds} & lost
    assert after.busiest_share() >= full.busiest_share() - 1e-12  # load only concentrates


def test_scale_down_during_a_rollback_removes_only_the_dead_dp():
    """DPs waiting at the rollback's epoch barrier are stalled, not stopped: a hang during the
    rollback removes only the hung DP."""
    cfg = msgspec.structs.replace(
        SCALE, faults=(NetworkError(dp=0, iteration=3, layer=0), ExecutorHang(dp=1, iteration=3))
    )
    res = _run(cfg)
    _check_one_outcome_each(cfg, res)
    assert not res.stopped
    (sd,) = res.scale_downs
    assert sd.removed == [1]
    assert res.completed() == 9


def test_tokens_committed_at_the_instant_the_engine_stops_are_still_streamed():
    zero = LayerTimes(attention_ns=0, dispatch_ns=0, expert_ns=0, combine_ns=0, head_ns=0)
    cfg = msgspec.structs.replace(
        SMALL,
        times=zero,
        scheduler_gap_ns=0,
        host_jitter_mean_ns=0,
        faults=(NetworkError(dp=0, iteration=2, code="HBM_ECC"),),
    )
    for backend in ("asyncio", "trio"):
        res = _run(cfg, backend=backend)
        _check_one_outcome_each(cfg, res)  # streamed == committed for every request


def test_a_false_positive_before_a_hang_is_not_blamed_on_the_hang():
    hb = HeartbeatConfig(
        dp_period_ns=5 * MS, control_period_ns=10 * MS, timeout_ns=20 * MS, on_unhealthy="report"
    )
    cfg = msgspec.structs.replace(
        SMALL,
        heartbeat=hb,
        stall_limit_ns=1_000 * MS,
        faults=(
            SlowIteration(dp=1, iteration=1, extra_ns=50 * MS),
            ExecutorHang(dp=1, iteration=7),
        ),
    )
    res = _run(cfg)
    first = [v for v in res.verdicts if v.dp == 1]
    assert not first[0].fault_injected  # the slow iteration: a false positive
    assert first[-1].fault_injected  # the hang


def test_fault_specs_parse_strictly():
    from xds.serve.reliability import parse_fault

    assert parse_fault("network_error:dp=1,iteration=2,code=LINK_FLAP") == NetworkError(
        dp=1, iteration=2
    )
    assert parse_fault("network_error:dp=1,iteration=2,code=7").code == "7"  # any word
    for spec, expected in (
        ("network_error:dp=²,iteration=1", "dp must be a whole number, got '²'"),
        ("network_error:dp=2.5,iteration=1", "dp must be a whole number, got '2.5'"),
        ("network_error:dp=--3,iteration=1", "dp must be a whole number, got '--3'"),
        ("network_error:dp=1,dp=2,iteration=1", "dp is given twice"),
    ):
        with pytest.raises(ConfigError, match=expected):
            parse_fault(spec)
    with pytest.raises(ConfigError) as err:
        _faults(NetworkError(dp=0, iteration=9))  # output_tokens 10: iterations 0..8
    assert err.value.field == "faults[0].iteration"


def test_a_misspelt_fault_kind_in_a_file_lists_the_kinds(tmp_path):
    from xds.config import load_config
    from xds.serve.reliability import ReliabilityConfig

    path = tmp_path / "faults.toml"
    path.write_text('[[faults]]\nkind = "netwrk_error"\ndp = 1\niteration = 2\n')
    with pytest.raises(ConfigError, match=r"one of 'executor_hang', .*'network_error'") as err:
        load_config(path, ReliabilityConfig)
    assert err.value.field == "faults[0].kind"
    for body in ("dp = 1\n", "kind = 3\ndp = 1\n"):  # no kind; a kind that is no word
        path.write_text(f"[[faults]]\n{body}iteration = 2\n")
        with pytest.raises(ConfigError, match=r"one of 'executor_hang', .*'memory_fault'"):
            load_config(path, ReliabilityConfig)


def test_an_unrecoverable_code_escalates_even_during_a_rollback():
    """Two DPs fail in the same collective, one with a rollback code and one without: the run
    escalates whichever reports first (a redo would not cure the second)."""
    cfg = _faults(
        NetworkError(dp=1, iteration=4, layer=1),
        NetworkError(dp=2, iteration=4, layer=1, code="HBM_ECC"),
    )
    for backend in ("asyncio", "trio"):
        res = _run(cfg, backend=backend)
        assert res.stopped == "DP 2 failed with HBM_ECC in iteration 4"
        _check_one_outcome_each(cfg, res)


def test_a_run_closes_its_streams(streams_left_open):
    assert streams_left_open(lambda: _run(SMALL)) == []
