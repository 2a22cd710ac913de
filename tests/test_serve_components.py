"""FlowServe components: TE-shell routing, KV blocks, MTP commit, jitter sources."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds.errors import ConfigError
from xds.hw import ASCEND_910C_DIE
from xds.model import DEEPSEEK_V3
from xds.runtime import RngStreams
from xds.serve.jitter import JitterConfig, sample
from xds.serve.kv import KVBlockManager, kv_capacity_blocks
from xds.serve.mtp import MTPConfig, accepted_drafts, committed_tokens, mtp_step, tokens_per_step
from xds.serve.routing import BACKPRESSURE, DecodeRouter

# -- routing -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n_dp=st.integers(1, 6),
    limit=st.integers(1, 4),
    ops=st.lists(
        st.tuples(st.sampled_from(["route", "admit", "finish", "snap"]), st.integers(0, 10_000)),
        max_size=80,
    ),
)
def test_router_never_picks_a_full_dp_and_returns_to_baseline(n_dp, limit, ops):
    router = DecodeRouter(n_dp, limit)
    pending: list[int] = []
    active: list[int] = []
    next_id = 0
    for op, value in ops:
        if op == "route":
            before = [
                (d.active + d.pending, d.kv_used_blocks + d.kv_reserved_blocks) for d in router.dps
            ]
            reserve = router.reservation_blocks(value)
            got = router.route(next_id, value)
            if got is BACKPRESSURE:
                assert all(load >= limit for load, _ in before)
            else:
                assert before[got][0] < limit  # never a DP at its batch limit
                eligible = [s + reserve for load, s in before if load < limit]
                assert before[got][1] + reserve == min(eligible)
                pending.append(next_id)
            next_id += 1
        elif op == "admit" and pending:
            r = pending.pop(0)
            router.admitted(r)
            active.append(r)
        elif op == "finish" and active:
            router.finished(active.pop(value % len(active)))
        elif op == "snap":
            router.snapshot_kv([value % 50] * n_dp)
        for d in router.dps:
            assert d.active + d.pending <= limit
        assert router.sequences == sum(d.active + d.pending for d in router.dps)
        assert router.kv_used_blocks == sum(d.kv_used_blocks for d in router.dps)
    for r in active:
        router.finished(r)
    for r in pending:
        router.finished(r)
    assert all(d.active == d.pending == d.kv_reserved_blocks == 0 for d in router.dps)


def test_a_burst_between_snapshots_spreads_across_dps():
    router = DecodeRouter(4, 10)
    picks = [router.route(i, 2048) for i in range(4)]
    assert sorted(picks) == [0, 1, 2, 3]  # reservations update immediately
    router.snapshot_kv([0, 100, 100, 100])
    assert router.route("next", 2048) == 0


def test_a_request_whose_kv_the_dp_took_counts_once():
    router = DecodeRouter(2, 10, block_tokens=128)
    router.route("a", 1280)  # 10 output blocks reserved on DP 0
    assert router.dps[0].kv_reserved_blocks == 10
    router.kv_taken("a")  # DP 0 now holds input + output: 20 + 10 blocks
    router.snapshot_kv([30, 0])
    assert (router.dps[0].kv_used_blocks, router.dps[0].kv_reserved_blocks) == (30, 0)
    assert router.dps[0].pending == 1  # still pending until admitted
    router.admitted("a")
    router.finished("a")
    assert router.dps[0].kv_reserved_blocks == 0 and router.dps[0].active == 0
    # a DP with 25 blocks used beats one with 30 (not 30 + a stale 10 reserved)
    router.route("b", 1280)
    router.kv_taken("b")
    router.snapshot_kv([30, 25])
    assert router.route("c", 1280) == 1


def test_router_errors():
    router = DecodeRouter(2, 1)
    router.route("a", 10)
    with pytest.raises(ConfigError, match="already routed"):
        router.route("a", 10)
    with pytest.raises(ConfigError, match="not routed"):
        router.finished("zzz")
    router.admitted("a")
    with pytest.raises(ConfigError, match="already admitted"):
        router.admitted("a")
    router.finished("a")
    assert router.dps[0].active == router.dps[0].pending == 0


# -- KV blocks ---------------------------------------------------------------------------------


def test_capacity_comes_from_hbm_left_after_weights():
    blocks = kv_capacity_blocks(DEEPSEEK_V3, ASCEND_910C_DIE, weight_bytes=20 * 2**30)
    per_block = 39_040 * 128
    assert blocks == int((64 * 2**30 * 0.9 - 20 * 2**30) // per_block)
    with pytest.raises(ConfigError, match="no room"):
        kv_capacity_blocks(DEEPSEEK_V3, ASCEND_910C_DIE, weight_bytes=70 * 2**30)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "extend", "release"]), st.integers(1, 700)), max_size=60
    )
)
def test_kv_blocks_are_conserved(ops):
    kv = KVBlockManager(40, block_tokens=128)
    live: list[int] = []
    for i, (op, n) in enumerate(ops):
        if op == "admit" and kv.can_admit(n):
            kv.admit(i, n)
            live.append(i)
        elif op == "extend" and live:
            before = kv.free
            grew = kv.extend(live[n % len(live)], n)
            assert grew or kv.free == before
        elif op == "release" and live:
            kv.release(live.pop(n % len(live)))
        kv.check()
    for r in live:
        kv.release(r)
    assert kv.free == kv.capacity  # no leaks


# -- MTP ---------------------------------------------------------------------------------------


def test_expected_tokens_per_step():
    assert MTPConfig(k=1, acceptance=(0.9,)).expected_tokens_per_step == pytest.approx(1.9)
    # a second MTP layer: 2.26 (reused weights) and 2.35 (trained) are reachable (P083)
    assert MTPConfig(k=2, acceptance=(0.9, 0.4)).expected_tokens_per_step == pytest.approx(2.26)
    assert MTPConfig(k=2, acceptance=(0.9, 0.5)).expected_tokens_per_step == pytest.approx(2.35)
    # one per-depth profile serves every k; an empty one says what it lacks
    assert MTPConfig(k=1, acceptance=(0.9, 0.0)).expected_tokens_per_step == pytest.approx(1.9)
    with pytest.raises(ConfigError, match="at least one probability") as err:
        MTPConfig(k=1, acceptance=())
    assert err.value.field == "mtp.acceptance"


def test_sampled_acceptance_matches_its_expectation():
    cfg = MTPConfig(k=2, acceptance=(0.9, 0.4))
    rng = np.random.default_rng(0)
    steps = tokens_per_step(cfg, rng, 200_000)
    assert steps.min() >= 1 and steps.max() <= 3
    assert steps.mean() == pytest.approx(2.26, abs=0.01)
    rng = np.random.default_rng(1)
    one = [accepted_drafts(MTPConfig(k=1), rng) + 1 for _ in range(50_000)]
    assert np.mean(one) == pytest.approx(1.9, abs=0.01)


@settings(max_examples=100, deadline=None)
@given(
    k=st.integers(0, 3),
    acceptance=st.lists(st.floats(0, 1), min_size=1, max_size=3),
    steps=st.lists(st.integers(0, 200), max_size=40),  # both sides of _NUMPY_FROM
)
def test_committed_tokens_read_ahead_are_tokens_per_step(k, acceptance, steps):
    cfg = MTPConfig(k=k, acceptance=tuple(acceptance))
    streams = RngStreams(3)
    direct = np.random.default_rng(np.random.PCG64(streams.seed_sequence("mtp")))
    draws = streams.uniforms("mtp")
    for n in steps:  # the reader's blocks fall anywhere: the same draws, the same tokens
        assert committed_tokens(cfg, draws, n) == tokens_per_step(cfg, direct, n).tolist()
    assert streams.uniforms("mtp") is draws  # one reader per stream: a restart goes on
    taken = draws.take(3)  # a view of the read-ahead block, which later refills must not see
    assert not taken.flags.writeable


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(0, 3),
    accuracy=st.floats(0, 1),
    length=st.integers(1, 40),
)
def test_mtp_under_greedy_is_lossless(seed, k, accuracy, length):
    rng = np.random.default_rng(seed)

    def greedy_next(prefix):  # a deterministic toy "main model"
        return (sum(prefix) * 31 + len(prefix) * 7) % 101

    def draft(prefix, n):  # right with probability `accuracy`, else off by one
        out, p = [], list(prefix)
        for _ in range(n):
            truth = greedy_next(p)
            guess = truth if rng.random() < accuracy else (truth + 1) % 101
            out.append(guess)
            p.append(guess)
        return out

    stream = [5]
    while len(stream) < length + 1:
        step = mtp_step(stream, greedy_next, draft, k)
        assert 1 <= len(step) <= k + 1  # commits 1..k+1 tokens
        stream.extend(step)
    reference = [5]
    while len(reference) < len(stream):
        reference.append(greedy_next(reference))
    assert stream == reference  # identical to greedy decoding without MTP


# -- jitter ------------------------------------------------------------------------------------


def test_jitter_off_is_silent_and_manual_gc_never_pauses_inside_a_pass():
    rng = np.random.default_rng(0)
    assert sample(JitterConfig(), rng, 0).before_dispatch_ns == 0
    cfg = JitterConfig(enabled=True, manual_gc=True, gc_every_n=10)
    draws = [sample(cfg, rng, i) for i in range(100)]
    assert all(d.before_dispatch_ns < cfg.gc_pause_ns for d in draws)  # no GC inside
    assert sum(d.between_passes_ns == cfg.gc_pause_ns for d in draws) == 10


def test_without_mitigations_the_dispatch_barrier_sees_stalls_over_100ms():
    def worst(cfg: JitterConfig) -> int:
        rngs = [np.random.default_rng(i) for i in range(288)]
        return max(max(sample(cfg, r, it).before_dispatch_ns for r in rngs) for it in range(30))

    off = JitterConfig(enabled=True, manual_gc=False, core_pinning=False, graph_cache=False)
    on = JitterConfig(enabled=True)
    assert worst(off) > 100_000_000
    assert worst(on) < 1_000_000


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 4), "n_dp"), ((4, 0), "batch_limit"), ((2.5, 2), "n_dp"), ((2, True), "batch_limit")],
)
def test_decode_router_arguments_are_checked_one_by_one(args, field):
    with pytest.raises(ConfigError) as err:
        DecodeRouter(*args)
    assert err.value.field == field


def test_a_kv_snapshot_must_be_counts_of_blocks():
    router = DecodeRouter(2, 4)
    with pytest.raises(ConfigError) as err:
        router.snapshot_kv([-5, 10])
    assert err.value.field == "used_blocks[0]"
    with pytest.raises(ConfigError) as err:
        router.snapshot_kv([1.5, 10])
    assert err.value.field == "used_blocks[0]"
    with pytest.raises(ConfigError, match="one KV figure per DP group: 2, got 3"):
        router.snapshot_kv([1, 2, 3])
    router.snapshot_kv([np.int64(3), 7])
    assert [d.kv_used_blocks for d in router.dps] == [3, 7]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 5), st.integers(0, 5)),
        min_size=1,
        max_size=16,
    )
)
def test_the_built_in_routing_walk_picks_what_lowest_kv_picks(dps):
    """The router's one-walk lowest_kv: the DP lowest_kv picks among those below their
    batch limit (ties to the lowest index), or backpressure when none is."""
    from xds.serve.routing import lowest_kv

    router = DecodeRouter(len(dps), 3)
    for dp, (active, pending, used, reserved) in zip(router.dps, dps, strict=True):
        dp.active, dp.pending = active, pending
        dp.kv_used_blocks, dp.kv_reserved_blocks = used, reserved
    eligible = [i for i, dp in enumerate(router.dps) if dp.active + dp.pending < 3]
    expected = lowest_kv(eligible, router.dps, 1) if eligible else BACKPRESSURE
    assert router.route("r", 128) == expected
