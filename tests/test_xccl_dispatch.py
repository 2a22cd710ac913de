"""Dispatch/combine: numerics against the dense reference, DeepEP-style semantic checks,
capacity, barrier behaviour, and the agreement of the two fidelity tiers."""

from __future__ import annotations

import functools

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xds
from ep_harness import POD, run_moe
from xds.errors import ProtocolError
from xds.fabric import UBFabric
from xds.fabric.xccl.ep import EPConfig, EPGroup
from xds.fabric.xccl.moe import ExpertMap, layout, pull_lanes, route
from xds.hw import CloudMatrix384
from xds.model import TinyMoE


@pytest.mark.parametrize("tier", ["protocol", "collective"])
@pytest.mark.parametrize("dtypes", [("fp32", "fp32"), ("bf16", "bf16"), ("int8", "bf16")])
def test_combine_of_dispatch_equals_the_dense_reference(tier, dtypes):
    run = run_moe(tier=tier, dispatch_dtype=dtypes[0], combine_dtype=dtypes[1])
    for r in range(8):
        # exact against the reference with the same wire rounding
        assert np.array_equal(run.ys[r], run.reference(r, *dtypes))
        exact = run.reference(r, "fp32", "fp32")
        err = np.abs(run.ys[r] - exact).max()
        scale = np.abs(exact).max()
        if dtypes == ("fp32", "fp32"):
            assert err == 0
        elif dtypes[0] == "bf16":
            assert err <= 2e-2 * scale  # BF16: 8 mantissa bits on the wire, both ways
        else:
            assert err <= 5e-2 * scale  # stated INT8 bound: token-wise s/2 per element


@pytest.mark.parametrize("tier", ["protocol", "collective"])
@pytest.mark.parametrize("scale_dtype", ["bf16", "fp16"])
def test_a_two_byte_int8_scale_is_exact_against_its_reference_and_saves_two_bytes_a_row(
    tier, scale_dtype
):
    """SPEC 9.3: the scale dtype is a parameter. A BF16 or FP16 scale (rounded up, so nothing
    clips) gives exactly the reference with the same rounding, within the INT8 bound of the
    exact output, and rows two bytes shorter than with an FP32 scale."""
    from xds.fabric.xccl.moe import combine_row_bytes, dispatch_row_bytes

    run = run_moe(tier=tier, dispatch_dtype="int8", combine_dtype="int8", scale_dtype=scale_dtype)
    for r in range(8):
        assert np.array_equal(run.ys[r], run.reference(r, "int8", "int8"))
        exact = run.reference(r, "fp32", "fp32")
        assert np.abs(run.ys[r] - exact).max() <= 5e-2 * np.abs(exact).max()
    assert dispatch_row_bytes(7168, 8, "int8", scale_dtype) == 7168 + 2 + 4 + 32
    assert combine_row_bytes(7168, "int8", scale_dtype) + 2 == combine_row_bytes(7168, "int8")
    assert dispatch_row_bytes(7168, 8, "bf16", scale_dtype) == dispatch_row_bytes(7168, 8, "bf16")


def test_semantics_counts_order_and_dedup():
    run = run_moe(
        n_ranks=6, batch=[7, 0, 12, 3, 9, 5], shape=TinyMoE(n_experts=12, top_k=3), seed=3
    )
    emap = run.expert_map
    routed = [route(idx, emap) for idx, _ in run.routes]
    lays = [layout(r, 6) for r in routed]
    total_rows = 0
    for r, h in enumerate(run.handles):
        # rows grouped by source rank in rank order; source order within a rank
        assert np.all(np.diff(h.recv_src_rank) >= 0)
        for s in range(6):
            seg = h.recv_src_token[h.rank_prefix[s] : h.rank_prefix[s + 1]]
            assert np.all(np.diff(seg) > 0)
            # each token once per destination rank
            assert np.array_equal(seg, lays[s].tokens_for_rank[r])
        # per-local-expert counts equal the routing histogram
        expected = np.zeros(emap.slots_per_rank[r], np.int64)
        for s in range(6):
            on_r = routed[s].dest_rank == r
            np.add.at(expected, routed[s].local_slot[on_r], 1)
        assert np.array_equal(h.num_recv_per_local_slot, expected)
        # payload integrity: each received row is its source token's row
        for i in range(h.n_recv):
            s, t = h.recv_src_rank[i], h.recv_src_token[i]
            assert np.array_equal(h.recv_x[i], run.xs[s][t])
        total_rows += h.n_recv
    assert total_rows == sum(lay.total_rows for lay in lays)
    pairs = sum(int((h.recv_local_slots >= 0).sum()) for h in run.handles)
    assert pairs == sum(int((idx >= 0).sum()) for idx, _ in run.routes)


def test_tokens_routed_to_no_expert_are_never_sent():
    shape = TinyMoE(n_experts=8, top_k=2)
    rng = np.random.default_rng(5)
    routes = []
    for _ in range(4):
        idx = rng.integers(0, 8, (6, 2))
        idx[0] = -1  # token 0 goes nowhere
        idx[1, 1] = -1  # token 1 has one masked slot
        routes.append((idx, np.full((6, 2), 0.5, np.float32)))
    run = run_moe(n_ranks=4, batch=6, shape=shape, routes=routes)
    for r, h in enumerate(run.handles):
        assert 0 not in h.recv_src_token
        assert np.array_equal(run.ys[r], run.reference(r, "fp32", "fp32"))
        assert np.all(run.ys[r][0] == 0)


def test_padded_layout_agrees_with_the_variable_one():
    run = run_moe(n_ranks=4, batch=5, shape=TinyMoE(n_experts=8, top_k=2))
    for h in run.handles:
        x, slots = h.padded(32)
        n = h.n_recv
        assert x.shape == (32, 64) and np.array_equal(x[:n], h.recv_x)
        assert np.array_equal(slots[:n], h.recv_local_slots) and np.all(slots[n:] == -1)
        with pytest.raises(ProtocolError, match="capacity"):
            h.padded(n - 1)


def test_rows_above_block_capacity_are_rejected_before_writing():
    with pytest.raises(BaseExceptionGroup) as info:
        run_moe(n_ranks=4, batch=20, shape=TinyMoE(n_experts=4, top_k=2), capacity=4)
    assert info.group_contains(ProtocolError, match="capacity")


def test_expert_replicas_rotate_by_token_position():
    # expert 0 has replicas on ranks 0 and 1 (slots 0 and 4); token i uses replica i mod 2
    emap = ExpertMap(4, 4, replicas=[[0, 4], [1], [2], [3]], slots_rank=[0, 1, 2, 3, 1])
    idx = np.zeros((6, 1), np.int64)
    r = route(idx, emap)
    assert list(r.dest_rank[:, 0]) == [0, 1, 0, 1, 0, 1]
    shape = TinyMoE(n_experts=4, top_k=1)
    routes = [(idx.copy(), np.ones((6, 1), np.float32)) for _ in range(4)]
    run = run_moe(n_ranks=4, batch=6, shape=shape, routes=routes, expert_map=emap)
    for rank in range(4):
        assert np.array_equal(run.ys[rank], run.reference(rank, "fp32", "fp32"))


def test_barrier_spreads_the_slowest_ranks_delay_to_everyone():
    base = run_moe(mode="size", tier="protocol")
    late = run_moe(mode="size", tier="protocol", delays_ns=[0] * 7 + [20_000])
    for r in range(7):
        # a rank that arrived on time still finishes ~20 us later: it waited at the barrier
        grown = late.dispatch_ns[r] - base.dispatch_ns[r]
        assert 19_000 <= grown <= 21_000
        assert late.handles[r].barrier_ns >= 20_000


def test_consecutive_dispatches_use_their_own_metadata():

    async def main() -> list[np.ndarray]:
        fabric = UBFabric(POD)
        group = EPGroup(
            fabric,
            [0, 1, 16, 17],
            ExpertMap(8, 4),
            EPConfig(hidden=64, top_k=2, max_tokens_per_rank=16, n_aiv=4, dispatch_dtype="fp32"),
        )
        rng = np.random.default_rng(0)
        got: list[np.ndarray] = []

        async def rank(r: int) -> None:
            for layer in range(4):
                x = np.full((3, 64), 100 * layer + r, np.float32)
                idx = rng.integers(0, 8, (3, 2))
                if r == 3:
                    await xds.sleep_ns(7_000)  # a slow rank
                h = await group.dispatch(r, x, idx, event_id=100 + layer)
                got.append(h.recv_x[:, 0] - 100 * layer)

        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(rank, r)
        return got

    got = xds.run(main)
    assert len(got) == 16
    for values in got:  # every row came from this layer's dispatch: value = source rank
        assert np.all((values >= 0) & (values < 4))


def test_payload_modes_have_identical_timing():
    a = run_moe(mode="bytes", dispatch_dtype="int8", combine_dtype="bf16")
    b = run_moe(mode="size", dispatch_dtype="int8", combine_dtype="bf16")
    assert a.dispatch_ns == b.dispatch_ns and a.combine_ns == b.combine_ns


@pytest.mark.parametrize("n_ranks", [8, 16, 32])
@pytest.mark.parametrize("skew", [False, True])
def test_the_two_tiers_agree_within_10_percent(n_ranks, skew):
    shape = TinyMoE(hidden=7168, n_experts=256, top_k=8)
    rng = np.random.default_rng(n_ranks)
    weights = rng.zipf(1.5, 256).astype(float) if skew else np.ones(256)
    p = weights / weights.sum()
    routes = []
    for _ in range(n_ranks):
        idx = np.stack([rng.choice(256, 8, replace=False, p=p) for _ in range(32)])
        routes.append((idx, np.full((32, 8), 1 / 8, np.float32)))
    delays = [int(d) for d in rng.integers(0, 5_000, n_ranks)]
    kw = dict(
        n_ranks=n_ranks,
        batch=32,
        shape=shape,
        mode="size",
        routes=routes,
        dispatch_dtype="int8",
        combine_dtype="bf16",
        n_aiv=48,
        capacity=32,
        delays_ns=delays,
    )
    proto = run_moe(tier="protocol", **kw)
    coll = run_moe(tier="collective", **kw)
    for a, b in ((proto.dispatch_ns, coll.dispatch_ns), (proto.combine_ns, coll.combine_ns)):
        # the collective's latency (its last rank), and every rank's own latency
        assert abs(max(b) - max(a)) <= 0.10 * max(a), (max(a), max(b))
        for x, y in zip(a, b, strict=True):
            assert abs(y - x) <= 0.10 * x, (x, y)


@settings(max_examples=30, deadline=None)
@given(
    n_ranks=st.integers(2, 6),
    batches=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    top_k=st.integers(1, 3),
    mask=st.floats(0, 0.5),
    seed=st.integers(0, 1000),
)
def test_property_exact_round_trip_and_conservation(n_ranks, batches, top_k, mask, seed):
    shape = TinyMoE(hidden=16, intermediate=8, n_experts=2 * n_ranks, top_k=top_k)
    rng = np.random.default_rng(seed)
    routes = []
    for b in batches[:n_ranks]:
        idx = (
            np.stack([rng.choice(2 * n_ranks, top_k, replace=False) for _ in range(b)])
            if b
            else np.zeros((0, top_k), np.int64)
        )
        idx = np.where(rng.random(idx.shape) < mask, -1, idx)
        routes.append((idx.astype(np.int64), rng.random((b, top_k)).astype(np.float32)))
    run = run_moe(
        n_ranks=n_ranks, batch=batches[:n_ranks], shape=shape, routes=routes, seed=seed, n_aiv=3
    )
    for r in range(n_ranks):
        assert np.array_equal(run.ys[r], run.reference(r, "fp32", "fp32"))
    sent = sum(int((idx >= 0).sum()) for idx, _ in routes)
    assert sum(int((h.recv_local_slots >= 0).sum()) for h in run.handles) == sent


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_int8_dispatch_pays_the_fused_quantisations_fixed_part_on_the_sender(tier):
    """SPEC 9.3: a fixed part plus a per-token part, inside the sending kernel. Every rank
    starts together, so the fixed part delays every rank's metadata, hence the barrier and
    every completion, by exactly that much; a BF16 wire pays nothing."""
    import msgspec

    from xds.hw import CloudMatrix384, PodConfig

    def pod(fixed: int) -> CloudMatrix384:
        cfg = PodConfig()
        return CloudMatrix384(
            msgspec.structs.replace(
                cfg, engines=msgspec.structs.replace(cfg.engines, quant_fixed_ns=fixed)
            )
        )

    kw = dict(tier=tier, mode="size", combine_dtype="bf16")
    with_fixed = run_moe(dispatch_dtype="int8", pod=pod(2_000), **kw)
    without = run_moe(dispatch_dtype="int8", pod=pod(0), **kw)
    assert [a - b for a, b in zip(with_fixed.dispatch_ns, without.dispatch_ns, strict=True)] == [
        2_000
    ] * 8
    assert with_fixed.combine_ns == without.combine_ns  # BF16 combine: no quantisation
    bf16 = [run_moe(dispatch_dtype="bf16", pod=pod(f), **kw).dispatch_ns for f in (0, 2_000)]
    assert bf16[0] == bf16[1]


def test_pull_lanes_cover_every_peer_once_in_each_order():
    for order in ("static", "staggered"):
        for rank in (0, 5, 63):
            lanes = pull_lanes(rank, 64, 48, order)
            assert len(lanes) == 48
            assert sorted(p for lane in lanes for p in lane) == list(range(64))
            assert max(map(len, lanes)) - min(map(len, lanes)) <= 1
    assert pull_lanes(5, 64, 48, "static")[0] == [0, 48]  # rank order, the same on every rank
    assert pull_lanes(5, 64, 48, "staggered")[0] == [5, 53]  # its own block first
    # staggered, the ranks' first remote pulls land on every peer once: no incast
    assert sorted(pull_lanes(r, 64, 48, "staggered")[1][0] for r in range(64)) == list(range(64))
    assert {pull_lanes(r, 64, 48, "static")[1][0] for r in range(64)} == {1}


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_staggered_pulls_change_timing_only(tier):
    kw = dict(tier=tier, n_aiv=2, dispatch_dtype="int8", combine_dtype="bf16")
    static = run_moe(**kw)
    staggered = run_moe(pull_order="staggered", **kw)
    for r in range(8):
        assert np.array_equal(staggered.handles[r].recv_x, static.handles[r].recv_x)
        assert np.array_equal(staggered.ys[r], static.ys[r])
        assert np.array_equal(staggered.ys[r], staggered.reference(r, "int8", "bf16"))


@pytest.mark.parametrize("n_ranks, n_aiv", [(16, 4), (32, 8)])
def test_staggered_pulls_avoid_incast_when_peers_outnumber_aivs(n_ranks, n_aiv):
    shape = TinyMoE(hidden=7168, n_experts=256, top_k=8)
    rng = np.random.default_rng(n_ranks)
    routes = [
        (
            np.stack([rng.choice(256, 8, replace=False) for _ in range(64)]),
            np.full((64, 8), 1 / 8, np.float32),
        )
        for _ in range(n_ranks)
    ]
    runs = {
        (order, tier): run_moe(
            n_ranks=n_ranks,
            batch=64,
            shape=shape,
            mode="size",
            routes=routes,
            dispatch_dtype="int8",
            combine_dtype="bf16",
            n_aiv=n_aiv,
            capacity=64,
            tier=tier,
            pull_order=order,
        )
        for order in ("static", "staggered")
        for tier in ("protocol", "collective")
    }
    for order in ("static", "staggered"):  # the tiers agree on either order
        a, b = runs[(order, "protocol")], runs[(order, "collective")]
        for x, y in zip(a.combine_ns + a.dispatch_ns, b.combine_ns + b.dispatch_ns, strict=True):
            assert abs(y - x) <= 0.10 * x
    # every rank starting on the same n_aiv peers queues on their egress; staggering spreads it
    static, staggered = runs[("static", "collective")], runs[("staggered", "collective")]
    assert max(staggered.combine_ns) < 0.85 * max(static.combine_ns)
    assert max(staggered.dispatch_ns) < 0.85 * max(static.dispatch_ns)


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_per_destination_metadata_work_delays_each_rank_by_its_issue_slot(tier):
    """SPEC 5.6: each destination costs its source scalar work (``meta_issue_ns``). With two
    AIVs issuing in parallel, rank d's metadata goes out in slot d // 2 + 1 on every source, so
    its barrier (and its dispatch) moves by that many issue times, in both tiers."""
    import msgspec

    from xds.hw.specs import DEFAULT_ENGINES

    def dispatch_ns(meta_issue_ns: int) -> np.ndarray:
        engines = msgspec.structs.replace(DEFAULT_ENGINES, meta_issue_ns=meta_issue_ns)
        pod = CloudMatrix384(servers=4, engines=engines)
        return np.array(run_moe(n_ranks=8, batch=4, n_aiv=2, tier=tier, pod=pod).dispatch_ns)

    issue = 20_000
    slots = (np.arange(8) // 2 + 1) * issue
    moved = dispatch_ns(issue) - dispatch_ns(0)
    np.testing.assert_allclose(moved, slots, atol=50)  # the pulls' contention shifts a little


def _rank_tokens(r: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``r``'s 8 tokens (every value ``r + 1``) and their top-4 experts."""
    return np.random.default_rng(r).integers(0, 16, (8, 4)), np.full((8, 16), r + 1, np.float32)


def _four_ranks(tier: str) -> EPGroup:
    """Four ranks on one server, 16 experts, top-4, FP32 both ways, bytes mode."""
    import xds.hw

    fabric = UBFabric(xds.hw.CloudMatrix384(servers=1), payload_mode="bytes")
    cfg = EPConfig(
        hidden=16, top_k=4, max_tokens_per_rank=8, dispatch_dtype="fp32", combine_dtype="fp32"
    )
    return EPGroup(fabric, [0, 1, 2, 3], ExpertMap(16, 4), cfg, tier=tier)


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_a_dispatch_cancelled_at_the_barrier_can_be_retried_alike_on_both_tiers(tier):
    """Rank 0 gives up waiting at the barrier (a timeout) and dispatches the same eventID
    again; the others come later. The collective tier once kept the abandoned arrival
    ("joined twice"); both tiers now end alike, every rank receiving what it would have."""

    async def main():
        group = _four_ranks(tier)
        got = {}

        async def rank(r):
            idx, x = _rank_tokens(r)
            if r == 0:
                with anyio.move_on_after(0):
                    await group.dispatch(r, x, idx, event_id=1)
            else:
                await xds.sleep_ns(10_000)
            h = await group.dispatch(r, x, idx, event_id=1)
            got[r] = (xds.now_ns(), h.n_recv, sorted(set(h.recv_x[:, 0].tolist())))

        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(rank, r)
        return got

    got = xds.run(main)
    assert sorted(got) == [0, 1, 2, 3]
    assert {r: n for r, (_, n, _) in got.items()} == {0: 21, 1: 20, 2: 21, 3: 22}
    assert all(src == [1.0, 2.0, 3.0, 4.0] for _, _, src in got.values())
    assert all(16_000 < t < 17_000 for t, _, _ in got.values())


def _dispatch_with_rank0_cancelled(tier: str, cancel_s: float | None) -> dict:
    """Four ranks dispatch eventID 1 at t=0; rank 0's first try is cancelled after
    ``cancel_s`` (None: not tried) and it retries the same eventID (a ProtocolError it gets
    is recorded)."""
    from xds.errors import ProtocolError

    async def main():
        group = _four_ranks(tier)
        got = {}

        async def rank(r):
            idx, x = _rank_tokens(r)
            if r == 0 and cancel_s is not None:
                with anyio.move_on_after(cancel_s):
                    await group.dispatch(r, x, idx, event_id=1)
            try:
                h = await group.dispatch(r, x, idx, event_id=1)
            except ProtocolError as err:
                got[r] = str(err)
            else:
                got[r] = (xds.now_ns(), h.barrier_ns, h.n_recv, h.recv_x[:, 0].tolist())

        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(rank, r)
        return got

    return xds.run(main)


def test_a_dispatch_cancelled_after_its_barrier_cannot_be_retried_on_either_tier():
    """Rank 0 is cancelled mid-pull (5 us; its barrier was at 4.8 us) and retries eventID 1:
    its peers have consumed its metadata, so the retry is a ProtocolError saying so on both
    tiers, and the peers finish as if nothing happened. (The collective tier once failed the
    peers with an internal KeyError; the protocol tier deadlocked, rank 0 waiting on itself.)"""
    clean = _dispatch_with_rank0_cancelled("protocol", None)
    for tier in ("protocol", "collective"):
        got = _dispatch_with_rank0_cancelled(tier, 5e-6)
        assert clean[0][1] < 5_000 < clean[0][0]  # after the barrier, before the end
        assert got[0] == (
            "rank 0 retried dispatch eventID 1, which was cancelled at 5000 ns, after its "
            f"barrier (at {clean[0][1]} ns): its peers have read its metadata and gone on, so "
            "the exchange cannot be joined again (a dispatch or combine can be retried only if "
            "cancelled before its barrier)"
        )
        assert {r: got[r] for r in (1, 2, 3)} == {r: clean[r] for r in (1, 2, 3)}


def test_a_dispatch_cancelled_between_posting_and_its_barrier_is_retried_alike_on_both_tiers():
    """Rank 0 is cancelled at 4 us, after posting its blocks and metadata, before its barrier:
    the retry re-posts the same rows (not waiting for its own unpulled block, which once
    deadlocked the protocol tier) and receives what it would have; both tiers agree."""
    clean = _dispatch_with_rank0_cancelled("protocol", None)
    runs = {tier: _dispatch_with_rank0_cancelled(tier, 4e-6) for tier in ("protocol", "collective")}
    assert runs["protocol"] == runs["collective"]
    got = runs["protocol"]
    assert {r: got[r] for r in (1, 2, 3)} == {r: clean[r] for r in (1, 2, 3)}
    end, barrier, n_recv, rows = got[0]
    assert (n_recv, rows) == clean[0][2:]
    assert barrier > 4_000 + 2_000  # launched and packed again
    assert end - barrier == clean[0][0] - clean[0][1]  # the same pulls


def test_a_rank_cancelled_before_pulling_is_named_when_its_peers_next_exchange_waits():
    """Rank 0 gives up its dispatch (eventID 1) after posting, before pulling; the others'
    next dispatch of that parity (eventID 3) waits for rank 0 to pull: the deadlock report
    says which rank has not pulled."""
    import xds.hw
    from xds.errors import ModelDeadlock

    async def main():
        fabric = UBFabric(xds.hw.CloudMatrix384(servers=1), payload_mode="bytes")
        cfg = EPConfig(
            hidden=16, top_k=4, max_tokens_per_rank=8, dispatch_dtype="fp32", combine_dtype="fp32"
        )
        group = EPGroup(fabric, [0, 1, 2, 3], ExpertMap(16, 4), cfg)

        async def rank(r, event_id):
            idx = np.random.default_rng(r).integers(0, 16, (8, 4))
            x = np.ones((8, 16), np.float32)
            if r == 0 and event_id == 1:
                with anyio.move_on_after(6e-6):  # after posting, before pulling
                    await group.dispatch(r, x, idx, event_id=event_id)
            else:
                await group.dispatch(r, x, idx, event_id=event_id)

        for event_id in (1, 3):
            async with anyio.create_task_group() as tg:
                for r in range(4):
                    tg.start_soon(rank, r, event_id)

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main)
    assert "rank 1 waits until every peer has pulled its managed blocks of eventID parity 1; " in (
        str(info.value)
    )
    assert "not yet: rank 0 (it last joined eventID 3)" in str(info.value)


def _one_rank_retries(tier: str, offsets: list[int], cancel_ns: int, phase: str):
    """Ranks join at ``offsets``; rank 0's dispatch (or combine) is cancelled ``cancel_ns``
    after it starts and retried with the same eventID. Per rank: (end, rows) or the error."""
    import xds.hw
    from xds.errors import ProtocolError

    n = len(offsets)

    async def main():
        fabric = UBFabric(xds.hw.CloudMatrix384(servers=1), payload_mode="bytes")
        cfg = EPConfig(
            hidden=16, top_k=2, max_tokens_per_rank=8, dispatch_dtype="fp32", combine_dtype="fp32"
        )
        group = EPGroup(fabric, list(range(n)), ExpertMap(2 * n, n), cfg, tier=tier)
        got = {}

        async def rank(r):
            idx = np.random.default_rng(r).integers(0, 2 * n, (6, 2))
            x = np.full((6, 16), r + 1, np.float32)
            await xds.sleep_ns(offsets[r])
            if phase == "combine":
                h = await group.dispatch(r, x, idx, event_id=1)
                out = np.arange(h.n_recv * 32, dtype=np.float32).reshape(h.n_recv, 2, 16)
                w = np.ones((6, 2), np.float32)
                call = functools.partial(group.combine, r, h, out, w, event_id=2)
            else:
                call = functools.partial(group.dispatch, r, x, idx, event_id=1)
            if r == 0:
                with anyio.move_on_after(cancel_ns / 1e9):
                    await call()
            try:
                res = await call()
            except ProtocolError as err:
                got[r] = str(err)
            else:
                rows = res if phase == "combine" else res.recv_x
                got[r] = (xds.now_ns(), np.asarray(rows).tobytes())

        async with anyio.create_task_group() as tg:
            for r in range(n):
                tg.start_soon(rank, r)
        return got

    return xds.run(main)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    offsets=st.lists(st.integers(0, 10_000), min_size=1, max_size=3).map(lambda o: [0, *o]),
    cancel_ns=st.integers(0, 14_000),
    phase=st.sampled_from(["dispatch", "combine"]),
)
def test_a_timed_out_rank_retrying_ends_alike_on_both_tiers(offsets, cancel_ns, phase):
    """Whenever rank 0's timeout strikes (before it posts, before its barrier, after it, or
    after the exchange ended and the retry reuses the eventID), both tiers end the same way:
    the same rows and nearly the same times, or the same ProtocolError. (The collective tier
    once counted a rank cancelled during its launch and packing as posted when every rank had
    arrived: its peers went on without it.)"""
    a = _one_rank_retries("protocol", offsets, cancel_ns, phase)
    b = _one_rank_retries("collective", offsets, cancel_ns, phase)
    assert a.keys() == b.keys()
    for r in a:
        if isinstance(a[r], str) or isinstance(b[r], str):
            assert a[r] == b[r]
        else:
            assert a[r][1] == b[r][1]  # the same rows, bit for bit
            assert abs(a[r][0] - b[r][0]) <= 0.02 * a[r][0]
