"""Colocated decode: DP groups, TE-shell, MTP steps, tiers, KV accounting, jitter switches."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xds
from xds.errors import ConfigError
from xds.serve.decode import CommCosts, DecodeConfig, DecodeInstance, measure_comm
from xds.serve.jitter import JitterConfig
from xds.serve.mtp import MTPConfig

SMALL = DecodeConfig(
    dies=32, batch_per_die=6, input_tokens=256, output_tokens=48, shared_expert_dies=0
)
COMM = CommCosts(12, 60_000, 110_000)
COMM_MTP = CommCosts(6, 35_000, 60_000)


def run(config=SMALL, *, tier="iteration", iterations=None, seed=0):
    async def main():
        k = config.mtp_config.k  # the main pass carries 1 + k tokens a sequence
        comm = msgspec.structs.replace(COMM, tokens_per_die=config.batch_per_die * (1 + k))
        inst = DecodeInstance(config, comm, COMM_MTP, tier=tier)
        res = await inst.serve(config.dies * config.batch_per_die, max_iterations=iterations)
        return inst, res

    return xds.run(main, seed=seed, event_log=False)


def test_every_request_streams_exactly_its_output_and_frees_its_kv():
    inst, res = run()
    assert res.requests == 32 * 6
    assert (inst.streamed == SMALL.output_tokens).all()  # in order, no gaps, no duplicates
    for kv in inst.kv:
        kv.check()
        assert kv.free == kv.capacity  # no block leaks
    assert all(d.active == d.pending == d.kv_reserved_blocks == 0 for d in inst.router.dps)
    assert res.tokens == 32 * 6 * (SMALL.output_tokens - 1)  # the first came from prefill


def test_mtp_commits_about_1_9_tokens_per_step():
    _, early = run(iterations=10)  # before any sequence hits its length cap
    assert early.mean_tokens_per_step == pytest.approx(1.9, abs=0.05)
    _, res = run()
    no_mtp = DecodeConfig(
        **{**{f: getattr(SMALL, f) for f in SMALL.__struct_fields__}, "mtp": MTPConfig(k=0)}
    )
    _, res0 = run(no_mtp)
    assert res0.mean_tokens_per_step == 1.0
    assert res0.iterations > 1.5 * res.iterations  # the slowest sequence sets the tail


def test_layer_tier_matches_iteration_tier():
    _, a = run(tier="iteration", iterations=10)
    _, b = run(tier="layer", iterations=10)
    assert abs(a.mean_iteration_ns - b.mean_iteration_ns) <= 0.02 * a.mean_iteration_ns
    assert a.iteration_ns == b.iteration_ns
    assert a.breakdown == b.breakdown


def test_same_seed_same_run_and_another_seed_differs():
    _, a = run(iterations=8, seed=3)
    _, b = run(iterations=8, seed=3)
    _, c = run(iterations=8, seed=4)
    assert a.iteration_ns == b.iteration_ns and a.tokens == b.tokens
    assert a.tokens != c.tokens or a.iteration_ns != c.iteration_ns


def test_unmitigated_jitter_stalls_the_first_dispatch():
    base = {f: getattr(SMALL, f) for f in SMALL.__struct_fields__}
    calm = DecodeConfig(**{**base, "jitter": JitterConfig(enabled=True)})
    wild = DecodeConfig(
        **{
            **base,
            "jitter": JitterConfig(
                enabled=True,
                manual_gc=False,
                core_pinning=False,
                graph_cache=False,
                recompile_probability=0.05,
            ),
        }
    )
    _, a = run(calm, iterations=30)
    _, b = run(wild, iterations=30)
    assert max(b.iteration_ns) - min(b.iteration_ns) > 100_000_000  # >100 ms stalls
    assert b.first_dispatch_max_over_min > 3 * a.first_dispatch_max_over_min
    assert b.mean_iteration_ns > a.mean_iteration_ns


def test_attention_grows_as_sequences_get_longer():
    _, res = run()
    early = np.mean(res.iteration_ns[:3])
    late = np.mean(res.iteration_ns[-6:-3])
    assert late > early


def test_comm_costs_come_from_the_collective_tier():
    cfg = DecodeConfig(dies=32, batch_per_die=4, shared_expert_dies=0)
    small = measure_comm(cfg, 4)
    large = measure_comm(cfg, 32)
    assert 0 < small.dispatch_ns < large.dispatch_ns
    assert large.combine_ns > large.dispatch_ns  # BF16 combine moves twice the bytes


def test_the_deployments_pull_order_reaches_its_dispatch_and_combine():
    cfg = DecodeConfig(dies=64, batch_per_die=32, shared_expert_dies=0)
    static = measure_comm(cfg, 32)
    staggered = measure_comm(msgspec.structs.replace(cfg, pull_order="staggered"), 32)
    # 64 peers, 48 AIVs: the static order's shared first peers queue; staggered spreads them
    assert staggered.combine_ns < static.combine_ns
    assert staggered.dispatch_ns < static.dispatch_ns
    with pytest.raises(ConfigError, match="pull_order"):
        DecodeConfig(pull_order="zigzag")


def test_too_many_requests_is_a_clear_error():
    from xds.errors import ConfigError

    async def main():
        inst = DecodeInstance(SMALL, COMM, COMM_MTP)
        with pytest.raises(ConfigError, match="exceed"):
            await inst.serve(SMALL.dies * SMALL.batch_per_die + 1)

    xds.run(main)


def test_bad_decode_configs_are_clear_errors():
    from xds.errors import ConfigError

    with pytest.raises(ConfigError, match="input_tokens"):
        DecodeConfig(input_tokens=-5)
    with pytest.raises(ConfigError, match="shared_expert_dies"):
        DecodeConfig(dies=16, shared_expert_dies=32)
    with pytest.raises(ConfigError, match="lightning"):
        DecodeConfig(model="minimax-m1", dies=32, shared_expert_dies=0)

    async def main():
        tight = DecodeConfig(
            dies=4,
            batch_per_die=6,
            input_tokens=256,
            output_tokens=48,
            shared_expert_dies=0,
            kv_blocks_per_die=5,
        )
        with pytest.raises(ConfigError, match="KV blocks"):
            await DecodeInstance(tight, COMM, COMM_MTP).serve(24)

    xds.run(main)


def test_mtp_passes_scale_with_draft_depth():
    base = {f: getattr(SMALL, f) for f in SMALL.__struct_fields__}
    one = DecodeConfig(**{**base, "mtp": MTPConfig(k=1)})
    two = DecodeConfig(**{**base, "mtp": MTPConfig(k=2, acceptance=(0.9, 0.4))})
    _, a = run(one, iterations=5)
    _, b = run(two, iterations=5)
    assert b.breakdown.launch == 3 * a.breakdown.launch // 2  # one graph per MTP forward


def test_online_eplb_rebalances_a_skewed_decode_without_stalling_it():
    from xds.serve.eplb.online import OnlineEPLBConfig
    from xds.units import MS

    def run_with(policy_name):
        cfg = DecodeConfig(
            batch_per_die=4,
            input_tokens=512,
            output_tokens=4096,
            eplb=OnlineEPLBConfig(
                policy=policy_name, window_ns=300 * MS, prefetch_ns=10 * MS, load_ns=20 * MS
            ),
        )
        comm = CommCosts(8, 80_000, 150_000)  # main pass: 4 sequences x (1 + 1 draft)
        comm_mtp = CommCosts(4, 45_000, 80_000)

        async def main():
            inst = DecodeInstance(cfg, comm, comm_mtp)
            checked = []

            async def watchdog():  # forward passes only ever see enabled replicas
                while inst.eplb.table.current.version < 6:
                    inst.eplb.table.check_pass(inst.eplb.table.current)
                    checked.append(inst.eplb.table.current.version)
                    await xds.sleep_ns(5 * MS)

            async with anyio.create_task_group() as tg:
                if policy_name != "none":
                    tg.start_soon(watchdog)
                res = await inst.serve(cfg.dies * cfg.batch_per_die, max_iterations=40)
                tg.cancel_scope.cancel()
            return res, inst.eplb, checked

        return xds.run(main, event_log=False)

    base, _, _ = run_with("none")
    tuned, eplb, checked = run_with("xds-greedy")
    assert eplb.reconfigurations >= 2 and len(set(checked)) > 2
    assert np.mean(tuned.iteration_ns[-10:]) < 0.7 * np.mean(base.iteration_ns[-10:])
    assert np.mean(tuned.iteration_ns[:3]) == pytest.approx(np.mean(base.iteration_ns[:3]))


def test_int8_attention_per_layer_speeds_those_layers_in_both_tiers():
    """P090: precision-insensitive layers run their whole attention in INT8. Naming layers
    shortens the iteration by exactly those layers' attention savings, the same in both
    tiers; naming every layer equals the all-layer switch."""
    from xds.model import Precision
    from xds.serve.decode import DecodeModel

    base = {f: getattr(SMALL, f) for f in SMALL.__struct_fields__}
    long_ctx = {**base, "input_tokens": 8_000, "output_tokens": 24}

    def cfg(**precision):
        return DecodeConfig(**{**long_ctx, "precision": Precision(**precision)})

    some = cfg(attention_int8_layers=(0, 5, 30, 61))  # a dense, two MoE and the MTP layer
    every = cfg(attention_int8_layers=tuple(range(62)))
    _, bf16 = run(cfg(), iterations=6)
    _, part = run(some, iterations=6)
    _, part_layer = run(some, tier="layer", iterations=6)
    _, full = run(every, iterations=6)
    _, switch = run(cfg(attention_int8=True), iterations=6)
    assert full.iteration_ns == switch.iteration_ns
    assert bf16.mean_iteration_ns > part.mean_iteration_ns > full.mean_iteration_ns
    assert part.iteration_ns == part_layer.iteration_ns
    assert bf16.breakdown.attention > part.breakdown.attention > full.breakdown.attention
    assert part.breakdown.total() == sum(part.iteration_ns) - 2_000_000 * part.iterations
    # the saving is the per-layer attention difference times the layers named
    dm = DecodeModel(some, COMM, COMM_MTP)
    seqs, ctx = SMALL.batch_per_die, 8_000
    main = dm.attention_part(seqs, 2.0, ctx, None)[0] - dm.attention_part(seqs, 2.0, ctx, 5)[0]
    mtp = dm.attention_part(seqs, 1.0, ctx, None)[0] - dm.attention_part(seqs, 1.0, ctx, 61)[0]
    saved = bf16.iteration_ns[0] - part.iteration_ns[0]
    assert main > 0 and mtp > 0
    assert saved == pytest.approx(3 * main + mtp, rel=1e-3)  # contexts differ by a few tokens


def test_int8_attention_layers_must_exist():
    from xds.errors import ConfigError
    from xds.model import Precision

    base = {f: getattr(SMALL, f) for f in SMALL.__struct_fields__}
    with pytest.raises(ConfigError, match="attention_int8_layers"):
        Precision(attention_int8_layers=(-1,))
    with pytest.raises(ConfigError, match=r"layers 0\.\.60 .* names \[70\]"):
        DecodeInstance(
            DecodeConfig(**{**base, "precision": Precision(attention_int8_layers=(3, 70))}),
            COMM,
            COMM_MTP,
        )


def test_costs_measured_on_another_ep_size_are_refused():
    from xds.errors import ConfigError
    from xds.serve.decode_model import measure_comm

    tokens = SMALL.batch_per_die * (1 + SMALL.mtp_config.k)
    bigger = msgspec.structs.replace(SMALL, dies=2 * SMALL.dies)
    foreign = measure_comm(bigger, tokens)
    assert foreign.dies == bigger.dies
    with pytest.raises(ConfigError, match=f"measured on {bigger.dies} dies") as err:
        DecodeInstance(SMALL, foreign, COMM_MTP)
    assert err.value.field == "comm"
    DecodeInstance(SMALL, measure_comm(SMALL, tokens), COMM_MTP)  # its own: fine


def test_colocated_decode_refuses_a_setting_it_would_ignore():
    from xds.errors import ConfigError

    config = msgspec.structs.replace(SMALL, reserve_output_tokens=32_768)
    with pytest.raises(ConfigError, match="applies to a PD replay's Decode TE") as err:
        DecodeInstance(config, COMM, COMM_MTP)
    assert err.value.field == "reserve_output_tokens"


def test_colocated_decode_takes_a_routing_policy():
    seen = []

    def first_free(eligible, dps, reserve_blocks):  # fill DP 0, then DP 1, ...
        seen.append(list(eligible))
        return eligible[0]

    async def main():
        inst = DecodeInstance(SMALL, COMM, COMM_MTP, routing=first_free)
        return inst, await inst.serve(SMALL.dies * SMALL.batch_per_die)

    inst, res = xds.run(main, seed=0, event_log=False)
    assert res.requests == SMALL.dies * SMALL.batch_per_die
    assert (inst.streamed == SMALL.output_tokens).all()
    # DP d is offered until it holds batch_per_die requests, then drops out of the offer
    firsts = [offer[0] for offer in seen]
    assert firsts == sorted(firsts)
    assert firsts.count(0) == SMALL.batch_per_die


def test_a_die_holds_the_weights_of_every_redundant_slot():
    from xds.serve.decode import decode_weight_bytes
    from xds.serve.eplb.online import OnlineEPLBConfig

    base = DecodeConfig()
    one = decode_weight_bytes(msgspec.structs.replace(base, eplb=OnlineEPLBConfig(spare_slots=1)))
    two = decode_weight_bytes(msgspec.structs.replace(base, eplb=OnlineEPLBConfig(spare_slots=2)))
    m = base.spec
    assert decode_weight_bytes(base) == one  # without EPLB: one redundant slot per layer
    assert base.drafts  # the MTP layer is a MoE layer with its own slots
    assert two - one == (m.moe_layers + m.mtp_layers) * m.expert_params


def test_a_drafting_die_holds_the_mtp_layer_and_every_die_holds_kv_b_proj():
    """The MTP layer's weights (attention, expert slots, BF16 eh_proj) take HBM only where
    the deployment drafts; MLA's kv_b_proj (W_UK, W_UV) is part of every layer's attention."""
    from xds.serve.decode import decode_weight_bytes
    from xds.serve.decode_model import expert_slots_per_die

    base = DecodeConfig()
    plain = msgspec.structs.replace(base, mtp=MTPConfig(k=0))
    m = base.spec
    slots = expert_slots_per_die(base)
    # INT8 but kv_b_proj and eh_proj (SPEC 9.2 quantises only Wq_a, Wkv_a, Wq_b, Wo)
    mtp_layer = (
        m.attention_layer_params + m.kv_b_params + slots * m.expert_params + 2 * 2 * m.hidden**2
    )
    assert decode_weight_bytes(base) - decode_weight_bytes(plain) == mtp_layer
    assert m.kv_b_params == m.kv_lora_rank * m.heads * (m.qk_nope_head_dim + m.v_head_dim)
    assert m.kv_b_params == 16_777_216
    assert m.attention_layer_params == 187_105_280  # Wq_a, Wq_b, Wkv_a, kv_b_proj, Wo
    assert m.attention_params == m.layers * m.attention_layer_params


def test_tp_ranks_hold_the_down_projections_whole_and_split_the_heads():
    """A prefill TP rank projects its own tokens down (Wq_a, Wkv_a whole), then works on its
    heads (Wq_b, kv_b_proj, Wo split), as PrefillCost prices it."""
    from xds.model import MODELS
    from xds.model.costs import Precision

    m, p = MODELS["deepseek-r1"], Precision()
    one, four = p.weight_bytes(m), p.weight_bytes(m, tp=4)
    down = m.layers * m.mla_down_params  # INT8, on every rank
    assert four - down == pytest.approx((one - down) / 4, abs=1)  # the rest split four ways


def test_prefill_and_ma_blocks_shrink_by_the_mtp_layer_weights_when_drafting():
    from xds.hw import PodConfig
    from xds.serve.ma_config import MADecodeConfig
    from xds.serve.prefill import PrefillConfig
    from xds.serve.replay import _prefill_kv_blocks

    base, plain = DecodeConfig(), DecodeConfig(mtp=MTPConfig(k=0))
    die = PodConfig().die
    assert _prefill_kv_blocks(PrefillConfig(), base, die) < _prefill_kv_blocks(
        PrefillConfig(), plain, die
    )
    drafting, not_drafting = MADecodeConfig(), MADecodeConfig(mtp=MTPConfig(k=0))
    assert drafting.drafts and not not_drafting.drafts
    assert drafting.kv_blocks_per_die < not_drafting.kv_blocks_per_die


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 10**6), st.lists(st.integers(1, 300))),
        max_size=60,
    )
)
def test_a_live_batch_kept_by_joins_and_commits_is_the_batch_taken_afresh(ops):
    from xds.serve.decode_te import _LiveBatch

    dps, limit = 4, 3
    slot_req = np.full((dps, limit), -1, dtype=np.int64)
    remaining = np.zeros((dps, limit), dtype=np.int64)
    context = np.zeros((dps, limit), dtype=np.int64)
    live = _LiveBatch(slot_req, remaining, context, None)
    for request, (join, x, drawn) in enumerate(ops):
        if join:  # a sequence joins a free slot
            free = np.flatnonzero(slot_req < 0)
            if not free.size:
                continue
            slot = int(free[x % free.size])
            left, ctx = 1 + x % 700, x % 5_000
            slot_req.flat[slot], remaining.flat[slot], context.flat[slot] = request, left, ctx
            live.add(slot, request, left, ctx, None)
        else:  # an iteration: the sequences that end leave
            drawn = (drawn * len(live.slots))[: len(live.slots)] or [1] * len(live.slots)
            slot_req.reshape(-1)[live.commit(drawn, None, 0, remaining)] = -1
        arrays = remaining.copy(), context.copy()
        live.flush(slot_req, *arrays)
        fresh = _LiveBatch(slot_req, *arrays, None)
        for name in ("slots", "req", "remaining", "length", "dps", "group", "seqs", "sums"):
            assert getattr(live, name) == getattr(fresh, name), name
        assert live.steps == fresh.steps and live._next == fresh._next
        assert live.seqs_all.tolist() == fresh.seqs_all.tolist()


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 10**6), st.lists(st.integers(1, 4), min_size=1)),
        max_size=60,
    )
)
def test_a_live_batch_commits_all_as_its_per_sequence_loop(ops):
    """:meth:`_LiveBatch.commit` of every sequence (its whole-list path) leaves the batch, the
    token times and the slot arrays as the per-sequence loop does (the path of ``kept``)."""
    from xds.serve.decode_te import _LiveBatch

    class WholeList(_LiveBatch):
        WHOLE_LIST_FROM = 1  # the whole-list path at any size

    dps, limit = 4, 3
    batches = []
    for kind in (WholeList, _LiveBatch):
        slot_req = np.full((dps, limit), -1, dtype=np.int64)
        remaining = np.zeros((dps, limit), dtype=np.int64)
        context = np.zeros((dps, limit), dtype=np.int64)
        live = kind(slot_req, remaining, context, {})
        batches.append((live, slot_req, remaining, {}))
    for request, (join, x, draws) in enumerate(ops):
        ended = []
        for live, slot_req, remaining, tokens in batches:
            if join:
                free = np.flatnonzero(slot_req < 0)
                if not free.size:
                    continue
                slot = int(free[x % free.size])
                left, ctx = 1 + x % 9, x % 5_000
                slot_req.flat[slot], remaining.flat[slot] = request, left
                tokens[request] = [x]
                live.add(slot, request, left, ctx, tokens[request])
            else:
                n = len(live.slots)
                drawn = (draws * n)[:n]
                kept = None if live is batches[0][0] else list(range(n))
                ended.append(live.commit(drawn, kept, 1_000 + request, remaining))
                slot_req.reshape(-1)[ended[-1]] = -1
        (a, _, rem_a, tok_a), (b, _, rem_b, tok_b) = batches
        assert ended[:1] == ended[1:]
        for name in ("slots", "req", "remaining", "length", "dps", "group", "seqs", "sums"):
            assert getattr(a, name) == getattr(b, name), name
        assert a.steps == b.steps and a._next == b._next and a.moved == b.moved
        assert a.tokens == b.tokens and tok_a == tok_b
        assert rem_a.tolist() == rem_b.tolist()


def _per_die_account(dm, seqs, ctx, jitter, mtp_experts, main_experts):
    """DecodeModel.account as a [len(_ROW), dies] table of every die's times: the reference
    the pricing by distinct DP shape must match to the nanosecond."""
    from xds.serve.decode_model import (
        _ARRIVE,
        _ATTENTION,
        _DENSE_MLP,
        _GATE,
        _OTHER,
        Breakdown,
    )

    m, k = dm.model, dm.config.mtp_config.k
    launch = dm.config.efficiency.graph_launch_ns
    shapes = (seqs.astype(np.int64) << 32 | ctx.astype(np.int64)).tolist()
    widest = float(seqs.max())
    bd = Breakdown()

    def one_pass(tps, first_layer, dense, experts, comm, jitter):
        d, c, n_moe = comm.dispatch_ns, comm.combine_ns, len(experts)
        key = (tps, first_layer, dense, n_moe)
        table = np.array([dm._pass_row(s, key) for s in shapes], dtype=np.int64).T
        arrive = table[_ARRIVE] if jitter is None else table[_ARRIVE] + jitter
        slowest = int(arrive.argmax())
        barrier = int(arrive[slowest])
        row = table[:, slowest].tolist()
        if jitter is not None:
            bd.jitter_wait += int(jitter[slowest])
        bd.attention += row[_ATTENTION]
        bd.mla_other += (dense + 1) * row[_OTHER]
        bd.gating += row[_GATE]
        bd.dense_mlp += dense * row[_DENSE_MLP]
        t = barrier + n_moe * (d + c) + sum(experts)
        bd.dispatch += n_moe * d
        bd.experts += sum(experts)
        bd.combine += n_moe * c
        n8 = dm._int8_layout(first_layer, dense, n_moe)[2]
        for layer, attn, count in ((5, 6, max(0, n_moe - 1) - n8), (7, 8, n8)):
            if count:
                worst = table[:, int(table[layer].argmax())].tolist()
                t += count * worst[layer]
                bd.attention += count * worst[attn]
                bd.mla_other += count * worst[_OTHER]
                bd.gating += count * worst[_GATE]
        head, samp = dm.head_ns(widest * tps)
        bd.lm_head += head
        bd.sampling += samp
        return t + head + samp, (barrier + d) - arrive

    t = 0
    proj = dm._mtp_projection_ns(widest)
    for draft in range(k):
        t += one_pass(1.0, m.layers, 0, [mtp_experts[draft]], dm.comm_mtp, None)[0]
        t += launch + proj
        bd.mla_other += proj
    main, first = one_pass(
        1.0 + k, 0, m.dense_layers, main_experts, dm.comm, jitter if jitter.any() else None
    )
    bd.launch += (k + 1) * launch
    return t + main + launch, bd, first


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 40_000)),
        min_size=1,
        max_size=12,
    ),
    jittered=st.booleans(),
)
def test_pricing_by_distinct_dp_shape_matches_every_die(groups, jittered):
    """Few distinct shapes (ties in every row), with and without jitter: the iteration's
    time, breakdown and each die's first dispatch are those of the per-die table, and the
    sparse shapes (empty dies but a few) are those of the arrays."""
    from xds.model import Precision
    from xds.serve.decode_model import DecodeModel, DPShapes

    config = DecodeConfig(
        **{f: getattr(SMALL, f) for f in SMALL.__struct_fields__ if f != "precision"},
        precision=Precision(attention_int8_layers=(0, 5, 30, 61)),
    )
    dm = DecodeModel(config, COMM, COMM_MTP)
    seqs = np.array([s for s, _, _ in groups], dtype=np.int64)
    ctx = np.array([256 * c for _, c, _ in groups], dtype=np.int64) * (seqs > 0)
    jitter = np.array([j if jittered else 0 for _, _, j in groups], dtype=np.int64)
    if not seqs.any():
        seqs[0] = 1
    mtp_experts, main_experts = [70_000], [50_000 + 10 * i for i in range(58)]
    out = dm.account(seqs, ctx, jitter, mtp_experts, main_experts)
    t, bd, first = _per_die_account(dm, seqs, ctx, jitter, mtp_experts, main_experts)
    assert out.time_ns == t and out.breakdown == bd
    assert out.first_dispatch_ns.dtype == first.dtype
    assert out.first_dispatch_ns.tolist() == first.tolist()
    held = np.flatnonzero(seqs).tolist()
    sparse = DPShapes.sparse(len(seqs), held, seqs[held].tolist(), ctx[held].tolist())
    dense = DPShapes.of(seqs, ctx)
    assert sparse.distinct == dense.distinct
    assert sparse.of_die.tolist() == dense.of_die.tolist()
    assert (sparse.widest, sparse.total) == (dense.widest, dense.total)
    if not jittered:  # without the per-die first dispatches: the same iteration
        bare = dm.account_shapes(sparse, None, mtp_experts, main_experts, per_die=False)
        assert (bare.time_ns, bare.breakdown) == (t, bd) and not bare.first_dispatch_ns.size
