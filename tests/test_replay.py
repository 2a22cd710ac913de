"""PD-disaggregated replay: prefill scheduler, DistFlow, decode TE, records and the CLI."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds.cli.main import main
from xds.errors import ConfigError
from xds.runtime import now_ns, run, sleep_ns
from xds.serve.decode import DecodeConfig
from xds.serve.decode_model import CommCosts
from xds.serve.decode_te import DecodeTE, comm_grid, interpolate
from xds.serve.distflow import TransferState
from xds.serve.jitter import JitterConfig
from xds.serve.prefill import PrefillConfig, PrefixCache
from xds.serve.prefill_cost import PrefillCost, prefill_hardware
from xds.serve.presets import pd_config
from xds.serve.replay import PDConfig, Replay, replay
from xds.trace import Request, Workload, load_mooncake
from xds.trace.production import NO_CONVERSATIONS, production_workload
from xds.units import MS, S

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"

SMALL = PDConfig(
    prefill=PrefillConfig(tes=2, long_pool_tes=0),
    decode=DecodeConfig(
        dies=32, batch_per_die=4, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
    ),
)


def _workload(*reqs: tuple[int, int, int]) -> Workload:
    return Workload(tuple(Request(i, a, x, y) for i, (a, x, y) in enumerate(reqs)))


def test_every_request_ends_exactly_once_with_consistent_times():
    wl = production_workload(30, rate_per_s=5.0, seed=3).limited(30)
    res = replay(wl, SMALL)
    assert [r.request_id for r in res.records] == list(range(30))
    assert res.summary.completed == 30 and res.summary.failed == 0
    for rec in res.records:
        assert rec.arrival_ns <= rec.first_token_ns < rec.finish_ns
        assert rec.kv_transfer_ns > 0 and rec.queue_ns >= 0
        assert rec.prefill_placement.startswith("P") and rec.decode_placement.startswith("D0/DP")
        assert len(rec.token_ns) == rec.output_tokens - 1  # every token after the first


def test_same_seed_same_records_bit_for_bit():
    wl = production_workload(12, rate_per_s=4.0, seed=1)
    a = msgspec.json.encode(replay(wl, SMALL).records)
    b = msgspec.json.encode(replay(wl, SMALL).records)
    assert a == b


def test_replay_is_identical_on_asyncio_and_trio():
    """Without same-instant contention between requests the backends agree bit for bit. (Where
    several requests contend at one instant - e.g. jobs leaving one prefill step together -
    each backend is reproducible on its own, but the order in which the tasks resume, and so
    the transfer order, is the backend's. The default multi-turn workload has such instants
    at this seed, so this test uses unique prompts.)"""
    wl = production_workload(10, rate_per_s=4.0, seed=2, conversations=NO_CONVERSATIONS)
    a = replay(wl, SMALL).records
    b = replay(wl, SMALL, backend="trio").records
    assert msgspec.json.encode(a) == msgspec.json.encode(b)


def test_unservable_requests_fail_with_a_reason_and_one_token_outputs_finish_at_prefill():
    wl = _workload((0, 1000, 200), (0, 130_000, 2000), (1_000, 500, 1))
    res = replay(wl, SMALL)
    ok, too_long, one = res.records
    assert ok.outcome == "completed"
    assert too_long.outcome == "failed" and "max_context_tokens" in too_long.reason
    assert one.outcome == "completed" and one.finish_ns == one.first_token_ns
    assert res.summary.failures == {"context <n> tokens exceeds max_context_tokens 131072": 1}


def test_backpressure_defers_recv_and_kv_is_freed_only_after_completion():
    """Decode DPs with room for one sequence at a time: RECVs wait for capacity, every
    transfer completes, prefill frees its blocks only after the completion."""
    cfg = msgspec.structs.replace(
        SMALL,
        decode=msgspec.structs.replace(SMALL.decode, batch_per_die=1, kv_blocks_per_die=20),
    )
    wl = _workload(*[(i * 1000, 2000, 50) for i in range(40)])
    released: list[tuple[int, int, int]] = []  # (time, request, transfer done time)
    grid = comm_grid(cfg.decode)

    async def main():
        from xds.runtime import now_ns

        r = Replay(wl, cfg, grid)
        for te in r.prefill:
            orig = te.release

            def spy(dp, req, orig=orig, te=te):
                flow = r.distflow[(te.index, 0)]
                done = [t for t in flow.transfers.values() if t.request_id == req]
                released.append((now_ns(), req, done[0].done_ns if done else -1))
                orig(dp, req)

            te.release = spy
        records = await r.run()
        return r, records

    r, records = run(main)
    assert all(rec.outcome == "completed" for rec in records)
    transfers = [t for f in r.distflow.values() for t in f.transfers.values()]
    assert len(transfers) == 40
    for t in transfers:
        assert t.state is TransferState.COMPLETED
        assert t.registered_ns <= t.recv_ns <= t.done_ns
    for when, _req, done in released:
        assert done >= 0 and when >= done
    # one sequence per DP: some RECV had to wait until a decode slot freed
    waits = sorted(t.recv_ns - t.registered_ns for t in transfers)
    assert waits[-1] > 0
    for dte in r.decode:
        dte.check()


def test_prefix_cache_hits_shorten_prefill_and_steer_the_job_executor():
    hashes = tuple(range(20))
    reqs = (
        Request(0, 0, 10_240, 20, hashes),
        Request(1, 5_000_000_000, 10_240, 20, hashes),
        Request(2, 10_000_000_000, 10_240, 20, tuple(range(100, 120))),
    )
    res = replay(Workload(reqs, hash_block_tokens=512), SMALL)
    first, again, cold = res.records
    # same TE and (leader) DP group: the one caching the prompt; a 1-token remainder stays
    # on that group, the cold prompt was spread over the idle groups
    assert again.prefill_placement == first.prefill_placement.split("x")[0]
    assert again.ttft_ns < cold.ttft_ns / 3


def test_prefix_cache_is_lru_and_counts_leading_blocks():
    c = PrefixCache(3)
    c.insert([1, 2, 3])
    assert c.hit_blocks([1, 2, 9]) == 2 and c.hit_blocks([9, 1]) == 0
    c.insert([1, 4])  # blocks are touched tail first: 3, the oldest tail, goes
    assert c.hit_blocks([1, 2, 3]) == 2 and c.hit_blocks([3]) == 0 and len(c) == 3
    c.insert([5, 6])  # 2 and 4 (the older tails) go; the heads 1 and 5 stay
    assert c.hit_blocks([1]) == 1 and c.hit_blocks([1, 2]) == 1 and c.hit_blocks([5, 6]) == 2


def test_the_prefix_cache_holds_its_share_of_kv_whatever_tokens_a_hash_covers():
    from xds.serve.prefill import PrefillTE

    for per_hash in (512, 256, 200, 64):  # 200 and 64 are not multiples of a 128-token block
        cfg = PrefillConfig(prefix_block_tokens=per_hash)
        te = PrefillTE(0, cfg, None, kv_blocks_per_dp=1000)  # type: ignore[arg-type]
        share = int(1000 * cfg.prefix_cache_fraction) * cfg.block_tokens
        assert share - per_hash < te.cache[0].capacity * per_hash <= share


def test_prefill_step_cost_grows_with_tokens_and_shrinks_with_cached_prefix():
    cfg = PrefillConfig()
    die, link = prefill_hardware(cfg)
    from xds.hw import PodConfig
    from xds.model import MODELS

    cost = PrefillCost(MODELS["deepseek-r1"], cfg, die, PodConfig().engines, link)
    short, long = cost.step_ns([[(1000, 0)]]), cost.step_ns([[(8000, 0)]])
    cached = cost.step_ns([[(1000, 7000)]])
    assert short < cached < long
    assert cost.step_ns([[(4000, 0)]] * 8) > cost.step_ns([[(4000, 0)]])  # MoE over all groups


def test_prefill_experts_wait_for_the_busiest_die():
    """Uniform gating still loads the TE's expert dies unevenly (binomially): the routed
    experts take as long as the busiest die's share, which shrinks towards the mean as the
    step grows; checked against sampled die loads."""
    from xds.hw import PodConfig
    from xds.model import MODELS

    cfg = PrefillConfig()
    die, link = prefill_hardware(cfg)
    cost = PrefillCost(MODELS["deepseek-r1"], cfg, die, PodConfig().engines, link)
    dies = cfg.dies_per_te
    gen = np.random.default_rng(7)
    over = []
    for copies in (2_048 * 8, 32_768 * 8):
        model = cost.busiest_die_copies(copies)
        sampled = gen.multinomial(copies, np.full(dies, 1 / dies), size=400).max(axis=1).mean()
        assert model == pytest.approx(sampled, rel=0.01)
        over.append(model / (copies / dies))
    assert over[0] > over[1] > 1.0
    one = PrefillCost(
        MODELS["deepseek-r1"],
        msgspec.structs.replace(cfg, dies_per_te=1, attention_tp=1),
        die,
        PodConfig().engines,
        link,
    )
    assert one.busiest_die_copies(1_000.0) == 1_000.0  # one die holds every copy
    # 256 experts on 24 dies: the fullest hold 11, and their load is what the experts wait on
    uneven = PrefillCost(
        MODELS["deepseek-r1"],
        msgspec.structs.replace(cfg, dies_per_te=24),
        die,
        PodConfig().engines,
        link,
    )
    copies = 32_768 * 8
    assert uneven.busiest_die_copies(copies) > copies * 11 / 256 > copies / 24


def test_the_mtp_layer_runs_in_prefill_and_its_kv_moves_only_when_the_decode_drafts():
    from xds.hw import CloudMatrix384, PodConfig
    from xds.model import MODELS
    from xds.serve.decode_model import CommCosts, decode_kv_capacity
    from xds.serve.mtp import MTPConfig

    cfg = PrefillConfig()
    die, link = prefill_hardware(cfg)
    pod = PodConfig()
    r1, kimi = MODELS["deepseek-r1"], MODELS["kimi-k2"]
    drafting = PrefillCost(r1, cfg, die, pod.engines, link)
    plain = PrefillCost(r1, cfg, die, pod.engines, link, mtp=False)
    assert drafting.mtp and not plain.mtp
    assert drafting.step_ns([[(4_096, 0)]]) > plain.step_ns([[(4_096, 0)]])
    assert not PrefillCost(kimi, cfg, die, pod.engines, link).mtp  # it has no MTP layer

    wl = _workload((0, 2_000, 4))
    no_mtp = msgspec.structs.replace(
        SMALL, decode=msgspec.structs.replace(SMALL.decode, mtp=MTPConfig(k=0))
    )
    grid = [CommCosts(1, 10_000, 10_000)]  # (not used: nothing runs)

    async def built(config: PDConfig) -> tuple[int, bool, int]:
        r = Replay(wl, config, grid)
        return r.kv_bytes_per_token, r.prefill_cost.mtp, r._kv_dp

    (bytes_on, mtp_on, blocks_on), (bytes_off, mtp_off, blocks_off) = (
        run(lambda: built(SMALL)),
        run(lambda: built(no_mtp)),
    )
    per_layer = r1.kv_bytes_per_token_layer(int8_nope=SMALL.decode.precision.kv_int8_nope)
    assert bytes_on - bytes_off == per_layer
    assert mtp_on and not mtp_off
    assert blocks_on < blocks_off  # prefill blocks hold the MTP layer's KV too
    assert decode_kv_capacity(SMALL.decode, CloudMatrix384()) < decode_kv_capacity(
        no_mtp.decode, CloudMatrix384()
    )


def test_cached_context_is_priced_in_the_cheaper_mla_form():
    """A cached prefix is latent KV: attending to it costs either the up-projection of the
    context's keys and values and their reads (the non-absorbed form) or ~3.4x attention FLOPs
    and the absorb kernels (the absorbed form), whichever is cheaper, never neither."""
    from xds.hw import PodConfig
    from xds.model import MODELS

    cfg = PrefillConfig()
    die, link = prefill_hardware(cfg)
    m = MODELS["deepseek-r1"]
    cost = PrefillCost(m, cfg, die, PodConfig().engines, link)
    ctx = 16_384
    assert cost._context_up_projection(ctx) > 0 and cost._context_up_projection(0) == 0
    heads = m.heads // cfg.attention_tp
    for new in (64, 512, 4_096):
        mha, absorbed = cost._forms((new, ctx), False)
        assert absorbed.flops > 3 * mha.flops
        # the non-absorbed form up-projects all it attends to and reads 16 KB/token/rank
        assert mha.up_tokens == ctx + new and mha.absorb_tokens == 0
        assert mha.kv_bytes == (ctx + new) * (heads * (128 + 128) * 2 + 64 * 2)
        assert absorbed.up_tokens == 0 and absorbed.absorb_tokens == new
        assert absorbed.kv_bytes < mha.kv_bytes / 20
        plan = cost._attention_plan([(new, ctx)], False)
        none = type(mha)(0.0, 0.0, 0.0, 0.0)
        if cost._form_ns(mha, False) <= cost._form_ns(absorbed, False):
            assert plan == (mha, none)
        else:
            assert plan == (none, absorbed)
    # a short turn on a long prefix attends in the absorbed form, a long prompt up-projects
    assert cost._attention_plan([(64, ctx)], False)[0].up_tokens == 0
    assert cost._attention_plan([(4_096, ctx)], False)[0].up_tokens == ctx + 4_096
    # a group mixing the forms runs both kernels, one after the other (not one roofline over
    # summed FLOPs and bytes, which could hide one form's K/V reads under the other's
    # compute), and the absorb kernels only on the absorbed piece's tokens
    mixed = [(1_024, ctx), (32, ctx)]
    mha, absorbed = cost._attention_plan(mixed, False)
    assert mha.up_tokens == ctx + 1_024 and absorbed.absorb_tokens == 32
    both = cost._attention_ns(mha.flops, mha.kv_bytes, False) + cost._attention_ns(
        absorbed.flops, absorbed.kv_bytes, False
    )
    up = cost._context_up_projection(ctx + 1_024)
    _, moe, _, _ = cost.layer_times([mixed])
    assert moe[len(cost.cost.mla_prolog(1.0)) + 1] == both + up  # the attention slot
    plain = cost.layer_times([[(1_024, ctx)]])[1]
    q_absorb = -(-cost.cost.mla_absorbs(32)[0].time_ns // cfg.attention_tp)
    assert moe[4] == q_absorb and plain[4] == 0  # the prolog's absorb slot
    # the K/V reads bind the non-absorbed attention of a short turn on a long prefix
    mha = cost._forms((128, ctx), False)[0]
    assert cost._attention_ns(mha.flops, mha.kv_bytes, False) > cost._attention_ns(
        mha.flops, 0.0, False
    )
    # the extra over the same turn without a prefix is the cheaper form's extra on every
    # layer (a 64-token step hides a fifth of it under its host-bound eager dispatches)
    for new, share in ((64, 0.75), (512, 0.95)):
        extra = min(cost._form_ns(f, False) for f in cost._forms((new, ctx), False)) - min(
            cost._form_ns(f, False) for f in cost._forms((new, 0), False)
        )
        layers = m.layers + m.mtp_layers
        assert (
            share * extra * layers
            <= cost.step_ns([[(new, ctx)]]) - cost.step_ns([[(new, 0)]])
            <= 1.01 * extra * layers
        )
    # an SP share up-projects the whole context (the other shares' tokens arrive as latents)
    # and absorbs only its own share of the new tokens
    mha, absorbed = cost._forms((8_000, 1_000, 4), False)
    assert mha.up_tokens == 1_000 + 8_000 and absorbed.absorb_tokens == 2_000


def test_910b_prefill_moves_kv_over_roce_more_slowly():
    wl = _workload((0, 8000, 20))
    ub = replay(wl, SMALL).records[0].kv_transfer_ns
    roce_cfg = msgspec.structs.replace(
        SMALL, prefill=msgspec.structs.replace(SMALL.prefill, hardware="910b")
    )
    roce = replay(wl, roce_cfg).records[0].kv_transfer_ns
    assert roce > 4 * ub


def test_a_910b_prefill_te_exchanges_over_hccs_and_its_scale_out_not_the_kv_link():
    """A 910B Prefill TE's dispatch/combine once ran over the 25 GB/s link the KV leaves by:
    a 4K prompt took 4x as long as on 910C, mostly in all-to-all. Its dies talk over HCCS in
    their server and over their own 50 GB/s scale-out across servers."""
    from xds.hw import PodConfig
    from xds.model import MODELS
    from xds.serve.prefill_cost import prefill_te_link, prefill_tp_link

    pod = PodConfig()
    c, b = PrefillConfig(), PrefillConfig(hardware="910b")
    assert prefill_te_link(c) == pod.ub and prefill_hardware(b)[1] == pod.roce
    assert prefill_tp_link(c) == pod.ub and prefill_tp_link(b) == pod.hccs
    link = prefill_te_link(b)  # 7 of 31 peers on HCCS, 24 over scale-out: that share binds
    assert link.bandwidth == pytest.approx(pod.b_scale_out.bandwidth * 31 / 24)
    assert prefill_te_link(msgspec.structs.replace(b, dies_per_te=8)) == pod.hccs

    def step(cfg: PrefillConfig) -> int:
        die, _ = prefill_hardware(cfg)
        cost = PrefillCost(
            MODELS["deepseek-r1"], cfg, die, pod.engines, prefill_te_link(cfg), prefill_tp_link(cfg)
        )
        return cost.step_ns([[(4096, 0)]])

    assert 1.0 < step(b) / step(c) < 2.5  # compute-bound on both (SPEC 10.2)


def test_tp_attention_gathers_latents_and_scatters_its_output_over_the_tp_link():
    """TP4 attention on sequence-split projections: per layer an all-gather of the compressed
    latents and a reduce-scatter of the output projection (once priced as free)."""
    from xds.hw import PodConfig
    from xds.model import MODELS

    pod, m = PodConfig(), MODELS["deepseek-r1"]
    cfg = PrefillConfig()
    die, _ = prefill_hardware(cfg)
    cost = PrefillCost(m, cfg, die, pod.engines, pod.ub, tp_link=pod.ub)
    gather, scatter = cost._tp_exchange(4096.0)
    share = 3 / 4 * 4096 * 2 / pod.ub.bandwidth * 1e9
    assert gather == [3 * pod.ub.latency_ns + round(share * (1536 + 512 + 64))]
    assert scatter == [3 * pod.ub.latency_ns + round(share * 7168)]
    tp1 = msgspec.structs.replace(cfg, attention_tp=1, dies_per_te=8)
    assert PrefillCost(m, tp1, die, pod.engines, pod.ub)._tp_exchange(4096.0) == ([], [])
    no_exchange = PrefillCost(m, cfg, die, pod.engines, pod.ub)
    no_exchange._tp_exchange = lambda tokens: ([], [])  # type: ignore[method-assign]
    step = cost.step_ns([[(4096, 0)]])
    assert 1.04 < step / no_exchange.step_ns([[(4096, 0)]]) < 1.12  # two per layer, 62 layers


def test_comm_interpolation_is_monotone_and_clamped():
    grid = comm_grid(SMALL.decode)
    assert grid[0].tokens_per_die == 1 and grid[-1].tokens_per_die == 8
    values = [interpolate(grid, t).dispatch_ns for t in (0, 1, 3, 5, 8, 50)]
    assert values == sorted(values) and values[0] == values[1] and values[-1] == values[-2]


def test_comm_grid_points_are_measured_when_first_read_inside_or_outside_a_run():
    """A grid measures a point the first time it is read, with the value an eager
    measurement gives; inside a running replay the measurement runs aside and virtual time
    does not move; a light load never measures the wide points."""
    from xds.serve.decode_model import measure_comm
    from xds.serve.decode_te import CommGrid

    cfg = msgspec.structs.replace(SMALL.decode, batch_per_die=12)  # points 1, 8, 16, 24
    grid = CommGrid(cfg, [1, 8, 16, 24], seed=5)
    assert grid.measured == [] and len(grid) == 4
    assert interpolate(grid, 3.0) == interpolate(
        [measure_comm(cfg, 1, seed=5), measure_comm(cfg, 8, seed=5)], 3.0
    )
    assert grid.measured == [1, 8]

    async def inside() -> tuple[int, CommCosts]:
        t0 = now_ns()
        costs = grid[-1]
        return now_ns() - t0, costs

    moved, last = run(inside)
    assert moved == 0 and last == measure_comm(cfg, 24, seed=5)
    assert grid.measured == [1, 8, 24] and grid[1:3][0] == grid[1]
    with pytest.raises(IndexError):
        grid[4]
    on_point = CommGrid(cfg, [1, 8, 16, 24], seed=5)
    assert interpolate(on_point, 8) == grid[1] and on_point.measured == [8]  # not 16 too
    for bad in ([], [8, 1], [1, 1, 8], [0, 8]):
        with pytest.raises(ConfigError, match="ascending, distinct and >= 1"):
            CommGrid(cfg, bad)

    wide = msgspec.structs.replace(SMALL, decode=cfg)
    light = replay(_workload((0, 500, 20), (MS, 400, 10)), wide, seed=11)  # 1 sequence per DP
    assert light.summary.completed == 2
    assert comm_grid(cfg, seed=11).measured == [1, 8]  # 2 tokens per die: not 16 or 24


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="attention_tp"):
        PrefillConfig(dies_per_te=30)
    with pytest.raises(ConfigError, match="long_pool_tes"):
        PrefillConfig(tes=2, long_pool_tes=2)
    with pytest.raises(ConfigError, match="production-4p1d"):
        pd_config("nope")
    bad = tmp_path / "d.toml"
    bad.write_text("[prefill]\ntes = 0\n")
    with pytest.raises(ConfigError, match="tes"):
        pd_config(str(bad))
    assert pd_config("production-4p1d", kv_transfer="xccl").kv_transfer == "xccl"
    with pytest.raises(ConfigError, match="did you mean 'kv_transfer'"):
        pd_config("production-4p1d", kv_transfr="xccl")
    for workload in (None, [], Workload(())):
        with pytest.raises(ConfigError) as err:
            replay(workload)  # type: ignore[arg-type]
        assert err.value.field == "workload"


def test_production_preset_is_the_paper_deployment():
    cfg = pd_config("production-4p1d")
    assert cfg.chips == 128  # 16 servers x 8 chips
    assert cfg.prefill.tes == 4 and cfg.prefill.dps_per_te == 8 and cfg.prefill.dies_per_te == 32
    assert cfg.decode.dies == 128


def test_production_workload_matches_the_published_means():
    w = production_workload(20_000, rate_per_s=1.0, seed=0)
    inputs = np.array([r.input_tokens for r in w.requests])
    outputs = np.array([r.output_tokens for r in w.requests])
    assert abs(inputs.mean() / 13_000 - 1) < 0.03 and inputs.max() <= 65_536
    assert abs(outputs.mean() / 2_100 - 1) < 0.05


def test_cli_replay_writes_one_line_per_request(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["replay", "--synthetic", "6", "--rate", "3", "--out", str(out), "--csv", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 6
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["request_id"] == 0
    assert json.loads((out / "summary.json").read_text())["completed"] == summary["completed"]
    assert (out / "requests.csv").read_text().count("\n") == 7


def test_cli_replay_bad_input_is_one_line(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["replay", "--synthetic", "3", "--rate-scale", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("xds: error:") == 2


@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")
def test_mooncake_prefix_hashes_reach_the_cache():
    wl = load_mooncake(DATA / "mooncake" / "conversation_trace.jsonl").limited(40)
    res = replay(wl, SMALL)
    assert res.summary.completed + res.summary.failed == 40
    assert res.summary.completed >= 38


def test_closed_form_kv_transfers_agree_with_xccl_point_to_point():
    """The long-replay tier's closed form against real XCCL send/receive on the UB fabric
    (four TP rank parts into one decode die). KV of a
    few thousand tokens (~100 MB); below ~10 MB per rank part XCCL's fixed protocol costs
    (~20 us) show and the tiers drift apart by ~10 %."""
    wl = _workload(*[(i * 50_000_000, 2500 + 500 * i, 12) for i in range(3)])
    closed = replay(wl, SMALL).records
    xccl = replay(wl, msgspec.structs.replace(SMALL, kv_transfer="xccl")).records
    for a, b in zip(closed, xccl, strict=True):
        assert a.decode_placement == b.decode_placement
        assert abs(b.kv_transfer_ns / a.kv_transfer_ns - 1) < 0.015  # README: within 1.5 %


def test_xccl_tier_needs_the_ub_fabric():
    with pytest.raises(ConfigError, match="kv_transfer"):
        PDConfig(kv_transfer="xccl", prefill=PrefillConfig(hardware="910b"))


def test_a_failed_distflow_instance_fails_only_its_own_pair():
    wl = _workload(*[(i * 100_000_000, 1500, 20) for i in range(12)])
    grid = comm_grid(SMALL.decode)

    async def main():
        r = Replay(wl, SMALL, grid)
        r.inject_distflow_failure(0, prefill_te=0)
        return r, await r.run()

    r, records = run(main)
    failed = [x for x in records if x.outcome == "failed"]
    done = [x for x in records if x.outcome == "completed"]
    assert failed and done
    assert all(x.prefill_placement.startswith("P0/") for x in failed)
    assert all(x.prefill_placement.startswith("P1/") for x in done)
    assert all("DistFlow P0-D0" in x.reason for x in failed)
    states = {t.state for t in r.distflow[(0, 0)].transfers.values()}
    assert states == {TransferState.FAILED}
    for dte in r.decode:
        dte.check()  # failed requests gave their reserved blocks back
    with pytest.raises(ConfigError, match="P5-D0"):
        r.inject_distflow_failure(0, prefill_te=5)


def test_decode_stats_say_how_full_and_how_even_the_decode_dies_were():
    # one sequence: one die of 32 holds it, so it is also the mean die with sequences
    one = replay(_workload((0, 3000, 40)), SMALL)
    d = one.summary.decode
    assert d is not None and d.iterations == one.decode_iterations > 0
    assert d.sequences_per_die == pytest.approx(1 / 32)
    assert d.context_max_over_mean == pytest.approx(1.0)
    assert d.context_max_over_ideal == pytest.approx(1.0)  # no spread beats one die for one
    assert 0.99 < d.busy <= 1.0  # it decoded from its first token to its finish
    rec = one.records[0]
    decoding = rec.finish_ns - rec.first_token_ns - rec.decode_wait_ns - rec.kv_transfer_ns
    assert d.mean_iteration_ms * d.iterations == pytest.approx(decoding / 1e6, abs=1e-3)
    # two sequences on two dies (lowest KV first), 8,000 and 2,000 tokens of context: while
    # both decode the busier holds 8,000+ of a 5,000+ mean; the short one finishes first
    two = replay(_workload((0, 8000, 40), (0, 2000, 40)), SMALL)
    d = two.summary.decode
    assert d is not None
    assert {r.decode_placement for r in two.records} == {"D0/DP0", "D0/DP1"}
    assert 1 / 32 < d.sequences_per_die < 2 / 32
    assert 1.0 < d.context_max_over_mean < 8_100 / 5_050
    assert d.context_max_over_ideal == pytest.approx(1.0)  # the long one is the least max
    assert (
        msgspec.json.decode(msgspec.json.encode(two.summary))["decode"]["iterations"]
        == d.iterations
    )


def test_an_overloaded_replay_stops_at_its_serving_limit_and_keeps_every_record(tmp_path):
    from xds.serve.replay import SERVING_LIMIT_FAILURE

    wl = _workload(*[(0, 30_000, 200)] * 60)  # far more prefill than 20 s can do
    heard = []
    res = replay(wl, SMALL, serve_grace_ns=20 * S, progress=lambda t, done, n: heard.append(done))
    assert heard[-1] == 60  # the requests failed at the limit are reported too
    assert [r.request_id for r in res.records] == list(range(60))
    late = [r for r in res.records if r.outcome == "failed"]
    assert late and res.summary.completed == 60 - len(late) > 0
    assert {r.reason for r in late} == {f"{SERVING_LIMIT_FAILURE} at 20.000 s"}
    assert all(r.finish_ns == 20 * S for r in late)
    assert all(r.finish_ns < 20 * S for r in res.records if r.outcome == "completed")
    on_trio = replay(wl, SMALL, serve_grace_ns=20 * S, backend="trio")  # (requests arriving
    # together may take each other's DP there: tied tasks run in another order)
    assert [r.outcome for r in on_trio.records] == [r.outcome for r in res.records]
    # the CLI takes the limit in seconds and writes every request
    trace = tmp_path / "burst.jsonl"
    trace.write_text(
        "".join(
            '{"timestamp": 0, "input_length": 30000, "output_length": 200}\n' for _ in range(40)
        )
    )
    assert main(["replay", str(trace), "--serve-limit", "5", "--out", str(tmp_path / "o")]) == 0
    lines = (tmp_path / "o" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 40 and any(SERVING_LIMIT_FAILURE in line for line in lines)


def test_a_serving_limit_past_the_end_of_virtual_time_is_the_end_of_virtual_time():
    from xds.runtime.loop import HORIZON_NS

    async def sixty_days(move):  # a KV move that would outlast virtual time itself
        await sleep_ns(60 * 86_400 * S)

    wl = _workload((0, 1000, 4), (1 * S, 1000, 1))
    res = replay(wl, SMALL, serve_grace_ns=100 * 86_400 * S, kv_mover=sixty_days)
    stuck, served = res.records
    assert served.outcome == "completed" and stuck.outcome == "failed"
    assert stuck.finish_ns == HORIZON_NS and res.end_ns == HORIZON_NS


def test_decode_stats_count_each_iteration_once_across_a_restart(monkeypatch):
    """A replay that ends while a restart-the-world is still under way: the torn-down Decode
    TE's iterations count once, not again as the TE still listed."""
    from xds.serve import decode_te
    from xds.serve.recovery import NodeFault

    ran = []
    counted = decode_te.committed_tokens
    monkeypatch.setattr(
        decode_te, "committed_tokens", lambda *a: ran.append(1) or counted(*a)
    )  # called once an iteration
    res = replay(
        production_workload(60, rate_per_s=6.0, seed=1),
        pd_config("production-4p1d"),
        faults=[NodeFault(at_ns=5 * S, server=9)],  # a Decode server
    )
    assert res.restarts and res.summary.failed
    assert res.decode_iterations == res.summary.decode.iterations == len(ran) > 0
    assert res.summary.decode.busy < 1


def test_a_one_token_request_never_needs_decode_kv():
    tiny_kv = msgspec.structs.replace(
        SMALL, decode=msgspec.structs.replace(SMALL.decode, kv_blocks_per_die=1)
    )
    res = replay(_workload((0, 500, 1), (100_000_000, 1000, 10)), tiny_kv)
    one, long = sorted(res.records, key=lambda r: r.request_id)
    assert one.outcome == "completed" and one.decode_placement == ""
    assert (
        long.outcome == "failed"
        and long.reason == "sequence of 1010 tokens exceeds a decode DP's KV"
    )
    assert res.summary.failures == {"sequence of <n> tokens exceeds a decode DP's KV": 1}
    everything_fails = replay(_workload((0, 1000, 10), (2_000_000_000, 1000, 10)), tiny_kv)
    assert everything_fails.summary.duration_s == 2.0  # first arrival to the last failure


def test_replay_takes_faults_and_keeps_the_event_log_on_request():
    from xds.serve.replay import DistFlowFault

    wl = _workload(*[(i * 100_000_000, 1500, 20) for i in range(12)])
    res = replay(wl, SMALL, faults=[DistFlowFault(at_ns=0, prefill_te=0)], event_log=True)
    failed = [x for x in res.records if x.outcome == "failed"]
    assert failed and all("DistFlow P0-D0" in x.reason for x in failed)
    assert res.summary.failed == len(failed) and res.summary.completed == 12 - len(failed)
    assert [e.fields for e in res.events.select("distflow", "instance-failed")] == [
        {"prefill_te": 0, "decode_te": 0}
    ]
    assert replay(wl, SMALL).events is None  # off by default: long replays stay lean
    with pytest.raises(ConfigError, match="faults"):
        replay(wl, SMALL, faults=[(0, 0, 0)])
    with pytest.raises(ConfigError, match="P3-D0"):
        replay(wl, SMALL, faults=[DistFlowFault(at_ns=0, prefill_te=3)])
    with pytest.raises(ConfigError, match="list of DistFlowFault"):
        replay(wl, SMALL, faults=DistFlowFault(at_ns=0, prefill_te=0))
    for bad in (dict(at_ns=1.5e8, prefill_te=0), dict(at_ns=-1, prefill_te=0)):
        with pytest.raises(ConfigError, match="at_ns"):
            DistFlowFault(**bad)


_GRID: list = []


@settings(max_examples=15, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(
            st.integers(0, 300_000_000),  # gap to the previous arrival
            st.integers(1, 9_000),  # input tokens
            st.integers(1, 40),  # output tokens
        ),
        min_size=1,
        max_size=12,
    ),
    batch=st.integers(1, 3),
    kv_blocks=st.integers(20, 120),
)
def test_pd_invariants_hold_for_any_small_workload(reqs, batch, kv_blocks):
    """Every request ends once; decode never admits beyond its KV (admission raises if it
    would); prefill frees blocks only after the transfer's completion; blocks are conserved
    and every transfer ends in a terminal state (checked by the replay itself)."""
    cfg = msgspec.structs.replace(
        SMALL,
        decode=msgspec.structs.replace(
            SMALL.decode, batch_per_die=batch, kv_blocks_per_die=kv_blocks
        ),
    )
    if not _GRID:
        _GRID.extend(comm_grid(msgspec.structs.replace(cfg.decode, batch_per_die=3)))
    t, rows = 0, []
    for gap, x, y in reqs:
        t += gap
        rows.append((t, x, y))
    wl = _workload(*rows)
    freed_early: list[int] = []

    async def main():
        r = Replay(wl, cfg, _GRID)
        for te in r.prefill:
            orig = te.release

            def spy(dp, req, orig=orig, te=te):
                for t_ in r.distflow[(te.index, 0)].transfers.values():
                    if t_.request_id == req and t_.state.value not in ("completed", "failed"):
                        freed_early.append(req)
                orig(dp, req)

            te.release = spy
        return await r.run()

    records = run(main)
    assert [x.request_id for x in records] == list(range(len(rows)))
    assert not freed_early
    too_big = kv_blocks * 128
    for rec in records:  # a 1-token output is prefill's alone: it needs no decode KV
        if rec.output_tokens > 1 and rec.input_tokens + rec.output_tokens > too_big:
            assert rec.outcome == "failed" and "decode DP's KV" in rec.reason
        else:
            assert rec.outcome == "completed" and rec.finish_ns >= rec.first_token_ns


def test_cli_replay_lengths_csv_with_an_arrival_process(tmp_path, capsys):
    trace = tmp_path / "lengths.csv"
    trace.write_text("prompt_tokens,completion_tokens\n120,30\n0,5\n800,12\n64,1\n")
    argv = ["replay", str(trace), "--format", "lengths", "--rate", "4", "--json"]
    assert main(argv) == 2  # the 0-length row is an error by default
    assert "lengths.csv:line 3 field 'prompt_tokens'" in capsys.readouterr().err
    assert main([*argv, "--drop-invalid"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["requests"] == 3 and summary["completed"] == 3  # the 0-length row dropped
    assert summary["dropped_rows"] == 1 and summary["trace_format"] == "lengths"
    assert "left out 1 row with" in captured.err and "line 3" in captured.err
    assert main(["replay", str(trace), "--format", "lengths", "--columns", "a"]) == 2
    assert "--columns" in capsys.readouterr().err


def test_requests_arriving_together_share_one_prefill_step():
    one_te = msgspec.structs.replace(SMALL, prefill=msgspec.structs.replace(SMALL.prefill, tes=1))
    res = replay(_workload(*[(5_000_000_000, 1000, 4)] * 8), one_te)
    assert res.prefill_steps == 1
    assert {r.queue_ns for r in res.records} == {one_te.prefill.all_gather_ns}
    assert len({r.prefill_placement for r in res.records}) == 8  # one per DP group


def test_a_lockstep_step_lasts_as_long_as_its_slowest_group():
    cfg = PrefillConfig()
    die, link = prefill_hardware(cfg)
    from xds.hw import PodConfig
    from xds.model import MODELS

    cost = PrefillCost(MODELS["deepseek-r1"], cfg, die, PodConfig().engines, link)
    cached_heavy, token_heavy = [(2_000, 100_000)], [(16_000, 0)]
    both = cost.step_ns([cached_heavy, token_heavy])
    assert both >= max(cost.step_ns([cached_heavy]), cost.step_ns([token_heavy]))


def test_transfers_from_one_prefill_die_to_two_decode_tes_share_its_egress():
    from xds.hw import PodConfig
    from xds.serve.distflow import DistFlow

    pod = PodConfig()
    egress: dict[int, list[tuple[int, int]]] = {}

    async def main():
        import anyio

        flows = [
            DistFlow(
                0,
                tp=1,
                link=pod.ub,
                engines=pod.engines,
                prefill_dps=1,
                decode_dps=1,
                ingress={},
                egress=egress,
            )
            for _ in range(2)
        ]
        transfers = [f.register(i, 0, 8, 1 << 30) for i, f in enumerate(flows)]
        async with anyio.create_task_group() as tg:
            for f, t in zip(flows, transfers, strict=True):
                tg.start_soon(f.recv, t, 0)
        return [t.done_ns for t in transfers]

    first, second = sorted(run(main))
    assert second - first >= (1 << 30) / pod.ub.bandwidth * 1e9 * 0.99  # queued, not parallel


def test_a_transfer_waiting_for_a_busy_decode_die_leaves_its_egress_to_others():
    """Ports are held only while they carry bytes: a prefill die's transfer to an idle decode
    die is not queued behind its own transfer waiting for a busy one."""
    import anyio

    from xds.hw import PodConfig
    from xds.serve.distflow import DistFlow

    pod = PodConfig()
    ingress: dict[int, list[tuple[int, int]]] = {}
    mb = 10**6

    def flow(te: int) -> DistFlow:
        return DistFlow(
            te, tp=4, link=pod.ub, engines=pod.engines, prefill_dps=8, decode_dps=4,
            ingress=ingress, egress={},
        )  # fmt: skip

    async def main():
        f, g = flow(0), flow(1)
        big = g.register(100, 0, 0, 400 * mb)  # another TE fills decode die 0
        a = f.register(1, 0, 0, 40 * mb)  # P0/DP0 to decode die 0: waits for it
        b = f.register(2, 0, 0, 40 * mb)  # P0/DP0 to idle decode die 1
        async with anyio.create_task_group() as tg:
            for fl, t, dp in ((g, big, 0), (f, a, 0), (f, b, 1)):
                tg.start_soon(fl.recv, t, dp)
                await anyio.sleep(0)
        return big, a, b

    big, a, b = run(main)
    alone = 40 * mb / pod.ub.bandwidth * 1e9
    assert b.done_ns - b.recv_ns < 1.2 * alone  # not behind a's wait (2 ms)
    assert a.done_ns >= big.done_ns  # a still queues for decode die 0's ingress
    assert a.done_ns - a.recv_ns >= 400 * mb / pod.ub.bandwidth * 1e9


def test_replay_rejects_malformed_workloads_with_the_request_named():
    bad_ids = Workload((Request(0, 0, 10, 5), Request(7, 1, 10, 5)), source="t.jsonl")
    with pytest.raises(ConfigError, match=r"t\.jsonl: request 1 has request_id 7"):
        replay(bad_ids, SMALL)
    with pytest.raises(ConfigError, match="output_tokens must be >= 1, got 0") as err:
        replay(_workload((0, 10, 0)), SMALL)
    assert err.value.field == "output_tokens"
    with pytest.raises(ConfigError, match="input_tokens must be >= 1, got 0") as err:
        replay(Workload((Request(0, 0, 0, 5),)), SMALL)
    assert err.value.field == "input_tokens"
    with pytest.raises(ConfigError, match="arrival_ns must be >= 0, got -5") as err:
        replay(Workload((Request(0, -5, 10, 5),)), SMALL)
    assert err.value.field == "arrival_ns"
    with pytest.raises(
        ConfigError, match=r"arrives at 1 ns, before the request ahead of it \(5 ns\)"
    ):
        replay(_workload((5, 10, 2), (1, 10, 2)), SMALL)
    for req, field, says in (
        (Request(0, 1.5e8, 10, 5), "arrival_ns", "must be an integer, got 150000000.0"),  # type: ignore[arg-type]
        (Request(0, 0, "100", 5), "input_tokens", "must be an integer, got '100'"),  # type: ignore[arg-type]
        (Request(0, 0, 10, 5, (1.0,)), "prefix_hashes", "a sequence of integers"),  # type: ignore[arg-type]
        (Request(0, 0, 1024, 5, (1, 2)), "hash_block_tokens", "hash_block_tokens is 0"),
    ):
        with pytest.raises(ConfigError, match=says) as err:
            replay(Workload((req,)), SMALL)
        assert err.value.field == field
    hashed = Workload((Request(0, 0, 1024, 5, tuple(range(8))),), hash_block_tokens=512)
    says = "8 block hashes for 1024 input tokens: a 512-token block each allows at most 2"
    with pytest.raises(ConfigError, match=says) as err:
        replay(hashed, SMALL)
    with pytest.raises(ConfigError, match="progress must be a function"):
        replay(_workload((0, 10, 2)), SMALL, progress=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"progress callback '<lambda>'\(a, b\) must take 3"):
        replay(_workload((0, 10, 2)), SMALL, progress=lambda a, b: None)


def test_numpy_integers_in_a_workload_replay_and_their_results_write(tmp_path):
    from xds.trace import write

    at = np.cumsum(np.full(3, 10**8, dtype=np.int64))  # the natural way to build arrivals
    wl = Workload(tuple(Request(np.int64(i), at[i], np.int64(100), np.int64(4)) for i in range(3)))
    res = replay(wl, SMALL)
    assert all(type(r.arrival_ns) is int for r in res.records)
    write(tmp_path, res.records, res.summary)
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 3


def _prefill_cost(cfg: PrefillConfig | None = None) -> PrefillCost:
    from xds.hw import PodConfig
    from xds.model import MODELS

    cfg = cfg or PrefillConfig()
    die, link = prefill_hardware(cfg)
    return PrefillCost(MODELS["deepseek-r1"], cfg, die, PodConfig().engines, link)


def test_tp_attention_is_the_per_die_share_of_the_heads_counted_once():
    from xds.model import MODELS

    m = MODELS["deepseek-r1"]
    n = 16_384
    for tp in (4, 8):
        cost = _prefill_cost(PrefillConfig(attention_tp=tp))
        flops = 2.0 * n * (n / 2) * (m.heads / tp) * (m.qk_nope_head_dim + 64 + m.v_head_dim)
        kv = n * ((m.heads / tp) * (m.qk_nope_head_dim + m.v_head_dim) * 2 + 64 * 2)
        expected = cost.cost.kernel("a", flops, kv, "cube_bf16", attention=True).time_ns
        expected += cost._context_up_projection(n)  # its keys and values, for its heads
        _, moe, _, _ = cost.layer_times([[(n, 0)]])
        # the attention slot (after the prolog's five kernels and the latents' all-gather):
        # 1/tp of the heads, not 1/tp^2
        assert moe[len(cost.cost.mla_prolog(1.0)) + 1] == expected
    # twice the TP ranks, half the attention time per die
    a4 = _prefill_cost(PrefillConfig(attention_tp=4)).layer_times([[(n, 0)]])[1]
    a8 = _prefill_cost(PrefillConfig(attention_tp=8)).layer_times([[(n, 0)]])[1]
    assert max(a8) == pytest.approx(max(a4) / 2, rel=0.01)


def test_sequence_parallel_step_splits_a_long_request_over_every_group():
    cost = _prefill_cost()
    n = 48_000
    alone, sp = cost.step_ns([[(n, 0)]]), cost.step_ns(cost.sp_step(n, 0))
    groups = cost.config.dps_per_te
    assert alone / groups < sp < alone / 5  # near-linear: the ring hides behind attention
    # a share does 1/groups of the causal work, more than a request of n/groups tokens alone
    assert sp > cost.step_ns([[(n // groups, 0)]])


def test_a_long_request_runs_sequence_parallel_alone_and_frees_every_share():
    balanced = msgspec.structs.replace(SMALL.prefill, tes=1, balance_split=True)
    one_te = msgspec.structs.replace(SMALL, prefill=balanced)
    wl = _workload((0, 40_000, 3), (0, 1_000, 3), (0, 1_000, 3))
    grid = comm_grid(one_te.decode)

    async def main():
        r = Replay(wl, one_te, grid)
        return r, await r.run()

    r, records = run(main)
    long, short = records[0], records[1]
    assert long.prefill_placement == "P0/SP8"
    assert all(x.prefill_placement.startswith("P0/DP") for x in records[1:])
    # the SP job has its step alone: the short ones start after its first token
    assert short.first_token_ns > long.first_token_ns
    assert short.queue_ns >= long.first_token_ns - long.arrival_ns
    assert all(rec.outcome == "completed" for rec in records)
    te = r.prefill[0]
    assert all(kv.free == kv.capacity and kv.check() is None for kv in te.kv)
    # step accounting: one SP step, then one batched step in which the leader spreads the two
    # short prompts over four groups each, so no group sits it out
    assert (te.steps, te.sp_steps) == (2, 1)
    assert te.sp_busy_ns == long.first_token_ns - long.queue_ns - long.arrival_ns
    assert te.group_busy_ns == 8 * (te.busy_ns - te.sp_busy_ns)
    assert sorted(x.prefill_placement[-2:] for x in records[1:]) == ["x4", "x4"]


def test_sequence_parallelism_off_keeps_a_long_request_in_one_group():
    def cfg(**kw):
        return msgspec.structs.replace(SMALL, prefill=msgspec.structs.replace(SMALL.prefill, **kw))

    off = cfg(tes=1, sp_threshold=0, balance_split=False)
    on = cfg(tes=1)
    wl = _workload((0, 40_000, 3))
    slow, fast = replay(wl, off).records[0], replay(wl, on).records[0]
    assert slow.prefill_placement == "P0/DP0" and fast.prefill_placement == "P0/SP8"
    assert slow.ttft_ns > 5 * fast.ttft_ns
    # without the SP threshold the leader's balancing (when on) still spreads a lone prompt
    # over every group: the same split, in a batched step
    spread = replay(wl, cfg(tes=1, sp_threshold=0, balance_split=True)).records[0]
    assert spread.prefill_placement == "P0/DP0x8"
    assert spread.ttft_ns == pytest.approx(fast.ttft_ns, rel=0.01)


@settings(max_examples=15, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(
            st.integers(0, 200_000_000),  # gap to the previous arrival
            st.one_of(st.integers(1, 4_000), st.integers(18_000, 40_000)),  # short or SP
            st.integers(1, 6),
            st.sampled_from([(), (1, 2), (1, 2, 3)]),  # shared prefixes (<= 1.5K tokens)
        ),
        min_size=1,
        max_size=10,
    ),
    microbatches=st.sampled_from([1, 2]),
)
def test_sequence_parallel_and_batched_jobs_mix_without_loss(reqs, microbatches):
    """Long (SP) and short prompts in one TE, with or without microbatched steps: every
    request completes, an SP step holds only its job, and every group's KV returns to empty."""
    cfg = msgspec.structs.replace(
        SMALL,
        prefill=msgspec.structs.replace(SMALL.prefill, tes=1, microbatches=microbatches),
        decode=msgspec.structs.replace(SMALL.decode, kv_blocks_per_die=400),
    )
    if not _SP_GRID:
        _SP_GRID.extend(comm_grid(cfg.decode))
    t, rows = 0, []
    for i, (gap, x, y, hashes) in enumerate(reqs):
        t += gap
        rows.append(Request(i, t, x, y, prefix_hashes=hashes[: -(-x // 512)]))  # a hash a block
    wl = Workload(tuple(rows), hash_block_tokens=512 if any(r.prefix_hashes for r in rows) else 0)

    async def main():
        r = Replay(wl, cfg, _SP_GRID)
        return r, await r.run()

    r, records = run(main)
    assert all(rec.outcome == "completed" for rec in records)
    assert all(0 <= rec.cached_tokens < rec.input_tokens for rec in records)
    sp = [rec for rec in records if rec.prefill_placement.endswith("/SP8")]
    assert {rec.request_id for rec in sp} == {
        row.request_id for row in rows if row.input_tokens > 16_384
    }
    for s in sp:  # nothing else started in an SP job's step
        for rec in records:
            if rec is not s:
                start = rec.arrival_ns + rec.queue_ns
                assert s.arrival_ns + s.queue_ns != start
    te = r.prefill[0]
    assert all(kv.free == kv.capacity and kv.check() is None for kv in te.kv)


_SP_GRID: list = []


def test_prefill_busy_share_is_the_steps_over_the_prefill_phase():
    res = replay(_workload((0, 3000, 4)), SMALL)
    rec = res.records[0]
    used = int(rec.prefill_placement.split("/")[0].removeprefix("P"))
    step = rec.first_token_ns - rec.queue_ns - rec.arrival_ns  # the one step after queueing
    assert res.prefill_busy[used] == pytest.approx(step / rec.ttft_ns)
    assert 0.99 < res.prefill_busy[used] <= 1.0
    assert all(b == 0.0 for i, b in enumerate(res.prefill_busy) if i != used)


def test_a_lightly_loaded_te_spreads_prompts_and_caches_over_its_groups():
    """One prompt at a time: ties go to the group given a job least recently, so 16 prompts
    on 2 TEs x 8 groups land on 16 different groups (and their hashes in 16 caches); a
    follow-up then goes back to the group that caches its prefix."""
    reqs = [Request(i, i * S, 2000, 2, (1000 * i,)) for i in range(16)]
    reqs.append(Request(16, 16 * S, 2600, 2, (1000 * 5, 77)))  # extends request 5's prompt
    res = replay(Workload(tuple(reqs), hash_block_tokens=512), SMALL)
    places = [r.prefill_placement for r in res.records]
    assert len(set(places[:16])) == 16
    assert places[16] == places[5] and res.records[16].cached_tokens == 512


def test_sequence_parallel_prompts_are_cached_by_rotating_leaders():
    one_te = msgspec.structs.replace(SMALL, prefill=msgspec.structs.replace(SMALL.prefill, tes=1))
    reqs = tuple(
        Request(i, i * 20 * S, 40_000, 2, tuple(range(100 * i, 100 * i + 79))) for i in range(3)
    )
    grid = comm_grid(one_te.decode)

    async def main():
        r = Replay(Workload(reqs, hash_block_tokens=512), one_te, grid)
        return r, await r.run()

    r, records = run(main)
    assert all(rec.prefill_placement == "P0/SP8" for rec in records)
    caches = r.prefill[0].cache
    holders = [[g for g, c in enumerate(caches) if c.hit_blocks(q.prefix_hashes)] for q in reqs]
    assert all(len(h) == 1 for h in holders)  # one leader group caches each prompt
    assert len({h[0] for h in holders}) == 3  # and the leaders differ


def test_microbatched_prefill_overlaps_the_all_to_all_only_where_it_pays():
    from xds.serve.prefill_cost import _half

    assert _half((1000, 200), True) == (500, 200) and _half((1000, 200), False) == (500, 700)
    assert _half((7, 0, 8), True) == (3, 0, 8) and _half((7, 0, 8), False) == (4, 3, 8)
    one, two = _prefill_cost(), _prefill_cost(PrefillConfig(microbatches=2))
    big = [[(16_384, 0)]] * 8
    single, overlapped = one.step_ns(big), two.step_ns(big)
    # the dispatch and combine of one half hide behind the other half's compute...
    _, moe, mtp, _ = one.layer_times(big)
    m = one.model
    comm = (moe[-4] + moe[-1]) * (m.layers - m.dense_layers) + mtp[-4] + mtp[-1]
    assert single - comm <= overlapped < 0.85 * single
    # ...but a tiny step keeps one batch: splitting would double its eager dispatches
    tiny = [[(100, 0)]]
    assert two.step_ns(tiny) == one.step_ns(tiny) < two._overlapped_step_ns(tiny)


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.lists(st.integers(0, 10**6), max_size=6), st.integers(0, 5)), max_size=5
    ),
    dispatch_ns=st.integers(0, 10**5),
)
def test_an_eager_step_by_runs_of_layers_is_the_operator_by_operator_bound(runs, dispatch_ns):
    from xds.serve.prefill_cost import _eager_step_ns

    ops = [t for block, repeats in runs for _ in range(repeats) for t in block]
    # operator i starts once the device is free and its host dispatch is done at (i + 1) d
    expected = max(((i + 1) * dispatch_ns + sum(ops[i:]) for i in range(len(ops))), default=0)
    assert _eager_step_ns(runs, dispatch_ns) == expected


def _one_step(
    lengths: list[int],
    *,
    balance: bool,
    kv_blocks: int = 20_000,
    microbatches: int = 1,
    cached: dict[int, int] | None = None,
    used: dict[int, int] | None = None,
):
    """The leader's plan for one step holding ``lengths`` on a default TE. ``cached`` maps a
    job to the DP group whose prefix cache holds its first half (in 512-token blocks);
    ``used`` maps a DP group to tokens of KV already held by earlier work."""
    from xds.serve.prefill import PrefillJob, PrefillTE

    cfg = PrefillConfig(balance_split=balance, microbatches=microbatches)
    te = PrefillTE(0, cfg, _prefill_cost(cfg), kv_blocks_per_dp=kv_blocks)
    for dp, tokens in (used or {}).items():
        te.kv[dp].admit(("earlier", dp), min(tokens, te.kv[dp].free * cfg.block_tokens))
    for i, n in enumerate(lengths):
        hashes = tuple(range(1000 * i, 1000 * i + n // 512))
        if cached and i in cached:
            te.cache[cached[i]].insert(hashes[: len(hashes) // 2])
        te.pool.append((PrefillJob(i, n, hashes, 0), None))
    groups, placed = te._assign()
    return te, groups, placed


def test_the_leader_spreads_a_step_over_groups_that_would_sit_it_out():
    (te0, g0, _), (te1, g1, placed) = (_one_step([12_000, 1_000], balance=b) for b in (False, True))
    assert sum(1 for g in g0 if g) == 2 and all(g for g in g1)  # every group works
    big, small = (job for job, _ in placed)
    assert big.sp > small.sp >= 1 and big.sp + small.sp == 8
    # the slowest group no longer carries the whole 12K prompt: the step is much shorter
    assert te1.cost.step_ns(te1._pieces(g1)) < 0.5 * te0.cost.step_ns(te0._pieces(g0))
    # each job holds an equal KV share on each of its groups
    for job in (big, small):
        holders = [kv for kv in te1.kv if kv.holds(job.request_id)]
        assert len(holders) == job.sp
        assert all(
            kv.held(job.request_id) == kv.blocks_for(-(-job.input_tokens // job.sp))
            for kv in holders
        )


def test_balancing_keeps_each_groups_token_budget_and_skips_tiny_shares():
    # a prompt mostly cached on group 0 leaves it light in work but not in new tokens: the
    # seven fresh 12K prompts must not push any group past max_tokens_per_dp
    te, groups, placed = _one_step([40_000] + [12_000] * 7, balance=True, cached={0: 0})
    assert placed[0][0].cached_tokens > 0
    limit = te.config.max_tokens_per_dp
    assert all(sum(p[0] / p[2] for p in g) <= limit for g in te._pieces(groups))
    # a share below one KV block is not worth a group: a lone 100-token prompt stays put
    _, _, (lone,) = _one_step([100], balance=True)
    assert lone[0].sp == 1


def test_a_spread_plan_the_cost_model_rejects_is_undone_exactly():
    """The loads are a proxy; if the step cost model disagrees, every job returns to its
    leader group with its whole KV, as if the leader had never balanced."""
    from xds.serve.prefill import PrefillTE

    lengths, used = [9_000, 5_000, 600, 16_000], {2: 50_000, 5: 9_000}
    te_off, g_off, _ = _one_step(lengths, balance=False, kv_blocks=600, used=used)
    calls = []
    real = PrefillTE._balance

    def pessimist(self, groups):  # the spread plan always prices higher than the original
        cost = self.cost

        class Wrapped:
            piece_work = cost.piece_work

            def step_ns(self, pieces):
                calls.append(pieces)
                return 2 if len(calls) % 2 else 1  # (the spread plan is priced first)

        self.cost = Wrapped()
        try:
            real(self, groups)
        finally:
            self.cost = cost

    PrefillTE._balance = pessimist
    try:
        te, groups, placed = _one_step(lengths, balance=True, kv_blocks=600, used=used)
    finally:
        PrefillTE._balance = real
    assert calls  # something was spread, then priced
    assert all(job.sp == 1 for job, _ in placed)
    assert [[j.request_id for j in g] for g in groups] == [[j.request_id for j in g] for g in g_off]
    assert [(kv.free, dict(kv._held)) for kv in te.kv] == [
        (kv.free, dict(kv._held)) for kv in te_off.kv
    ]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 16_000), min_size=1, max_size=12),
    kv_blocks=st.sampled_from([300, 20_000]),
    microbatches=st.sampled_from([1, 2]),
    cached=st.dictionaries(st.integers(0, 11), st.integers(0, 7), max_size=4),
    used=st.dictionaries(st.integers(0, 7), st.integers(1, 40_000), max_size=3),
)
def test_balancing_never_slows_a_step_and_conserves_kv(
    lengths, kv_blocks, microbatches, cached, used
):
    """Whatever the prompts, cached prefixes and KV already in use: the same jobs run, the
    balanced step is never slower, every job sits on ``sp`` distinct groups (its leader among
    them) holding an equal share on each, no group exceeds its token budget unless it holds a
    single job, and KV blocks are conserved."""
    kw = dict(kv_blocks=kv_blocks, microbatches=microbatches, cached=cached, used=used)
    te0, g0, p0 = _one_step(lengths, balance=False, **kw)
    te1, g1, p1 = _one_step(lengths, balance=True, **kw)
    assert [j.request_id for j, _ in p0] == [j.request_id for j, _ in p1]
    assert [j.cached_tokens for j, _ in p0] == [j.cached_tokens for j, _ in p1]
    assert te1.cost.step_ns(te1._pieces(g1)) <= te0.cost.step_ns(te0._pieces(g0))
    for job, _ in p1:
        on = [d for d, g in enumerate(g1) if job in g]
        assert len(on) == job.sp and job.dp in on
        assert [d for d, kv in enumerate(te1.kv) if kv.holds(job.request_id)] == on
        share = te1.kv[job.dp].blocks_for(-(-job.input_tokens // job.sp))
        assert {te1.kv[d].held(job.request_id) for d in on} == {share}
    limit = te1.config.max_tokens_per_dp
    for g in te1._pieces(g1):
        assert len(g) == 1 or sum(p[0] / p[2] for p in g) <= limit + 1e-6
    for kv in te1.kv:
        kv.check()


def test_the_job_executor_predicts_a_lone_prompts_balanced_step():
    """An idle TE predicts the first token of a lone prompt at the step it will run: spread
    over every group (within 5 %), not the much longer step of one group."""
    balanced = msgspec.structs.replace(SMALL.prefill, tes=1, balance_split=True)
    one_te = msgspec.structs.replace(SMALL, prefill=balanced)
    grid = comm_grid(one_te.decode)

    async def main():
        r = Replay(_workload((0, 12_000, 2)), one_te, grid)
        predicted = r.prefill[0].predicted_first_token_ns(12_000, 0)
        return predicted, (await r.run())[0]

    predicted, rec = run(main)
    assert rec.prefill_placement == "P0/DP0x8"
    step = rec.ttft_ns - rec.queue_ns
    assert predicted == pytest.approx(step, rel=0.05)
    alone = _prefill_cost().step_ns([[(12_000, 0)]])
    assert predicted < 0.5 * alone


@pytest.mark.parametrize("microbatches", [1, 2])
def test_prefill_honours_int8_attention_per_layer(microbatches):
    from xds.model import Precision

    def step(**precision):
        cfg = PrefillConfig(precision=Precision(**precision), microbatches=microbatches)
        return _prefill_cost(cfg).step_ns([[(30_000, 2_000)]] * 8)

    bf16, everywhere = step(), step(attention_int8=True)
    assert step(attention_int8_layers=tuple(range(62))) == everywhere
    half = step(attention_int8_layers=tuple(range(0, 62, 2)))
    assert bf16 > half > everywhere


def test_a_decorated_router_gets_the_arguments_the_function_it_wraps_takes():
    """functools.wraps with a ``*args`` wrapper: judged by the wrapped function (3 arguments,
    or 4 with the request), not by the wrapper that would accept anything."""
    seen = []

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            seen.append(len(args))
            return fn(*args)

        return wrapper

    @logged
    def first(eligible, dps, reserve_blocks):
        return eligible[0]

    @logged
    def by_length(eligible, dps, reserve_blocks, request):
        return eligible[request.output_tokens % len(eligible)]

    wl = _workload(*((i * MS, 500, 5) for i in range(6)))
    for router, n in ((first, 3), (by_length, 4)):
        seen.clear()
        assert replay(wl, SMALL, decode_routing=router).summary.completed == 6
        assert seen == [n] * 6


def test_packing_sequences_onto_few_dies_shows_in_the_spread_not_the_mean():
    """A router that packs every sequence onto the first DP offered leaves 31 of 32 dies empty:
    the dies holding sequences are even (context_max_over_mean near 1), but the busiest die
    holds far more than an even spread would (context_max_over_ideal)."""
    wl = _workload(*((i * 50 * MS, 2_000, 60) for i in range(4)))
    even = replay(wl, SMALL).summary.decode
    packed = replay(wl, SMALL, decode_routing=lambda e, d, r: e[0]).summary.decode
    assert even is not None and packed is not None
    assert even.context_max_over_ideal == pytest.approx(1.0, abs=0.05)
    assert packed.context_max_over_mean == pytest.approx(1.0)  # one die: it is the mean
    assert packed.context_max_over_ideal > 3.0  # 4 prompts on one die, each could have its own


def test_replay_takes_your_own_decode_routing_and_prefill_placement():
    """Both policies are plain functions. The router only ever offers DPs below their batch
    limit and keeps its own bookkeeping; the leader offers the groups that can take the job."""
    hashes = tuple(range(20))
    wl = Workload(
        (
            Request(0, 0, 10_240, 20, hashes),
            Request(1, 5 * S, 10_240, 20, hashes),  # the same prompt again: a cache hit
            *(Request(i, 6 * S + i * 1_000_000, 2_000, 30) for i in range(2, 40)),
        ),
        hash_block_tokens=512,
    )
    offers = []

    def last_free(eligible, dps, reserve_blocks):  # pack DPs from the top
        offers.append([(i, dps[i].active + dps[i].pending, dps[i].batch_limit) for i in eligible])
        return max(eligible)

    def cache_averse(job, groups):  # the group with the least of the job's prefix
        return min(groups, key=lambda g: (g.cached_tokens, g.dp)).dp

    base = replay(wl, SMALL)
    mine = replay(wl, SMALL, decode_routing=last_free, prefill_placement=cache_averse)
    assert all(r.outcome == "completed" for r in mine.records)
    assert all(load < limit for offer in offers for _, load, limit in offer)
    dps = [int(r.decode_placement.split("/DP")[1]) for r in mine.records]
    assert min(dps) >= SMALL.decode.dies - 40 // SMALL.decode.batch_per_die - 1
    assert base.records[1].cached_tokens > 0 and mine.records[1].cached_tokens == 0
    again = replay(wl, SMALL, decode_routing=last_free, prefill_placement=cache_averse)
    assert again.records == mine.records  # deterministic with policies too


def test_a_policy_that_answers_outside_its_offer_fails_with_a_clear_error():
    from xds.errors import ProtocolError

    wl = _workload((0, 1_000, 3))
    with pytest.raises(ProtocolError, match="policy 'nowhere' chose prefill DP group 99"):

        def nowhere(job, groups):
            return 99

        replay(wl, SMALL, prefill_placement=nowhere)
    with pytest.raises(
        ProtocolError,
        match=r"chose decode DP -1 .* one of the 32 offered \(the DPs below their batch limit\)",
    ):
        replay(wl, SMALL, decode_routing=lambda eligible, dps, reserve: -1)
    with pytest.raises(ProtocolError, match="chose prefill DP group True"):  # not DP 1
        replay(wl, SMALL, prefill_placement=lambda job, groups: True)
    with pytest.raises(ProtocolError, match="chose TE 7"):
        replay(wl, SMALL, decode_te_selection=lambda req, tes: 7)
    for keyword in ("decode_routing", "prefill_placement", "prefill_te_selection"):
        with pytest.raises(ConfigError, match=f"{keyword} must be a function"):
            replay(wl, SMALL, **{keyword: "lowest"})


def test_policies_see_copies_and_may_answer_with_numpy_integers():
    """A policy cannot corrupt the bookkeeping it is shown, and numpy indices are fine."""

    def vandal_router(eligible, dps, reserve_blocks):
        for d in dps:
            d.batch_limit = 10**6  # would let the next request onto a full DP
        return np.int64(eligible[-1])

    def vandal_placement(job, groups):
        job.input_tokens = 1  # would shrink the job's KV and step cost
        return np.int32(groups[0].dp)

    wl = _workload(*[(i * 1_000_000, 3_000, 4) for i in range(40)])
    res = replay(wl, SMALL, decode_routing=vandal_router, prefill_placement=vandal_placement)
    assert all(r.outcome == "completed" for r in res.records)
    base = replay(wl, SMALL, prefill_placement=lambda job, groups: groups[0].dp)
    assert [r.first_token_ns for r in res.records] == [r.first_token_ns for r in base.records]


def test_least_work_prefers_the_group_holding_more_of_the_prompt_when_caps_tie():
    """A 513-token prompt of two blocks: one group caches the first block, another both.
    Either way 512 tokens are reusable (one is always computed), but the group holding the
    whole prompt wins the tie, so its cache entry is the one refreshed."""
    from xds.serve.prefill import PrefillJob, PrefillTE

    cfg = PrefillConfig()
    te = PrefillTE(0, cfg, _prefill_cost(cfg), kv_blocks_per_dp=20_000)
    te.cache[0].insert((1,))
    te.cache[1].insert((1, 2))
    te.pool.append((PrefillJob(0, 513, (1, 2), 0), None))
    _, placed = te._assign()
    assert placed[0][0].dp == 1 and placed[0][0].cached_tokens == 512


def test_a_prompt_batched_only_where_its_cache_is_waits_when_that_group_is_full():
    """20K tokens, 16K of them cached on group 3: batched there it is 4K new tokens. Group 3
    has no KV for it, and on any other group all 20K would be new, over ``sp_threshold``: the
    job must not be batched elsewhere. Such a prompt runs sequence-parallel alone (its cache
    read over UB), which needs a share of every group's KV, group 3's too: first in line, it
    holds the step until group 3 frees (nothing behind it takes KV meanwhile), and then the
    cheaper batched placement on group 3 is open."""
    from xds.serve.prefill import PrefillJob, PrefillTE

    cfg = PrefillConfig()
    te = PrefillTE(0, cfg, _prefill_cost(cfg), kv_blocks_per_dp=2_000)
    hashes = tuple(range(40))  # 40 blocks of 512 tokens
    te.cache[3].insert(hashes[:32])
    te.kv[3].admit("earlier", te.kv[3].free * cfg.block_tokens)  # group 3 is full
    te.pool.append((PrefillJob(0, 20_480, hashes, 0), None))
    _, placed = te._assign()
    assert placed == [] and len(te.pool) == 1
    te.kv[3].release("earlier")
    _, placed = te._assign()
    ((job, _),) = placed
    assert job.dp == 3 and job.cached_tokens == 16_384 and not job.alone  # batched, cached


def test_colocated_decode_reports_a_routing_policys_error_as_itself():
    from xds.errors import ProtocolError
    from xds.serve.decode import DecodeInstance

    async def main():
        grid = comm_grid(SMALL.decode)  # ends at the main pass's tokens per die
        mtp = interpolate(grid, SMALL.decode.batch_per_die)
        inst = DecodeInstance(SMALL.decode, grid[-1], mtp, routing=lambda e, d, r: 10**9)
        await inst.serve(8)

    with pytest.raises(ProtocolError, match="chose decode DP"):
        run(main)


def test_the_job_executors_te_choices_are_policies_too():
    """Prefill and Decode TE selection are plain functions over what the Job Executor sees;
    the long-input pool limits the offer, and an answer outside it is a ProtocolError."""
    from xds.errors import ProtocolError

    cfg = msgspec.structs.replace(
        SMALL,
        prefill=msgspec.structs.replace(SMALL.prefill, tes=3, long_pool_tes=1),
        decode_tes=2,
    )
    wl = _workload(*[(i * 50_000_000, 1_000 + 100 * i, 5) for i in range(10)], (S, 40_000, 5))
    offers = {}

    def first_offered(req, tes):
        offers[req.request_id] = [v.te for v in tes]
        assert all(v.predicted_first_token_ns >= req.arrival_ns for v in tes)
        return tes[0].te

    def second_decode(req, tes):
        assert [v.te for v in tes] == [0, 1]
        return 1

    res = replay(wl, cfg, prefill_te_selection=first_offered, decode_te_selection=second_decode)
    assert all(r.outcome == "completed" for r in res.records)
    long = next(r for r in res.records if r.input_tokens == 40_000)
    assert offers[long.request_id] == [2]  # only the long-input pool
    assert all(offers[r.request_id] == [0, 1] for r in res.records if r is not long)
    assert all(r.prefill_placement.startswith("P0/") for r in res.records if r is not long)
    assert all(r.decode_placement.startswith("D1/") for r in res.records)
    with pytest.raises(ProtocolError, match="policy 'nowhere' chose TE 5"):

        def nowhere(req, tes):
            return 5

        replay(wl, cfg, prefill_te_selection=nowhere)


def test_int8_attention_layers_are_checked_against_the_deployments_model(tmp_path, capsys):
    from xds.model import Precision

    with pytest.raises(ConfigError, match=r"prefill\.precision\.attention_int8_layers: .* \[99\]"):
        PDConfig(prefill=PrefillConfig(precision=Precision(attention_int8_layers=(99,))))
    bad = tmp_path / "bad.toml"
    bad.write_text("[decode.precision]\nattention_int8_layers = [3, 70]\n")
    assert main(["replay", "--deployment", str(bad), "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.toml" in err[0] and "names [70]" in err[0]


def test_first_token_estimates_read_the_pool_as_it_stands(monkeypatch):
    """The Prefill TE keeps its pool summed up for the Job Executor's estimates; under a load
    that queues requests, every estimate sees the same sums as a fresh count of the pool."""
    from xds.serve.prefill import PrefillTE

    original = PrefillTE.predicted_first_token_ns
    seen = {"calls": 0, "queued": 0}

    def checked(self, new_tokens, now, input_tokens=None):
        assert self._backlog == self._pending(job for job, _ in self.pool)
        seen["calls"] += 1
        seen["queued"] = max(seen["queued"], len(self.pool))
        return original(self, new_tokens, now, input_tokens)

    monkeypatch.setattr(PrefillTE, "predicted_first_token_ns", checked)
    res = replay(production_workload(80, rate_per_s=40.0, seed=3), SMALL)
    assert res.summary.completed == 80
    assert seen["calls"] >= 80 and seen["queued"] >= 5  # the pools did fill up


def test_the_job_executor_stops_choosing_a_failed_pair():
    """Once a transfer on a DistFlow pair fails, later requests avoid it: only those already
    sent its way fail; when every pair has failed, requests fail with that reason."""
    from xds.serve.replay import DistFlowFault

    wl = _workload(*[(i * 100_000_000, 1500, 20) for i in range(24)])
    res = replay(wl, SMALL, faults=[DistFlowFault(at_ns=0, prefill_te=0)], event_log=True)
    failed = [x for x in res.records if x.outcome == "failed"]
    learned = min(x.finish_ns for x in failed)
    avoided = res.events.select("job-executor", "pair-avoided")
    assert [(e.t_ns, e.fields) for e in avoided] == [(learned, {"prefill_te": 0, "decode_te": 0})]
    assert failed and len(failed) < 6
    later = [x for x in res.records if x.arrival_ns > learned]
    assert later and all(
        x.outcome == "completed" and x.prefill_placement[:3] == "P1/" for x in later
    )
    both = replay(
        wl,
        SMALL,
        faults=[DistFlowFault(at_ns=0, prefill_te=0), DistFlowFault(at_ns=0, prefill_te=1)],
    )
    assert both.summary.completed == 0 and both.summary.failed == 24
    # once every pair has failed, later requests fail on arrival, not after a wasted prefill
    from xds.serve.replay import NO_PAIR_FAILURE

    on_arrival = [x for x in both.records if x.reason == NO_PAIR_FAILURE]
    assert on_arrival and all(
        x.finish_ns == x.arrival_ns and x.first_token_ns < 0 for x in on_arrival
    )
    one_token = _workload(*[(i * 100_000_000, 1500, 20 if i < 12 else 1) for i in range(24)])
    still = replay(
        one_token,
        SMALL,
        faults=[DistFlowFault(at_ns=0, prefill_te=0), DistFlowFault(at_ns=0, prefill_te=1)],
    )
    assert all(x.outcome == "completed" for x in still.records[12:])  # prefill alone serves


def test_requests_wait_for_a_restarting_decode_te_even_when_every_pair_has_failed():
    async def main():
        r = Replay(_workload((0, 100, 4)), SMALL, comm_grid(SMALL.decode))
        r._failed_pairs = {(p, 0): 0 for p in range(SMALL.prefill.tes)}
        gone = r._no_working_pair()
        r._decode_down.add(0)  # restarting: its return brings fresh pairs (_build_pair)
        waits = not r._no_working_pair()
        r._decode_lost[0] = "too few healthy servers"
        return gone, waits, r._no_working_pair()

    assert run(main) == (True, True, True)


def test_decode_jitter_lengthens_iterations_in_a_replay_and_mitigations_shrink_it():
    wl = production_workload(30, rate_per_s=6.0, seed=1)

    def tpot(jitter: JitterConfig) -> float:
        base = pd_config("production-4p1d")
        cfg = msgspec.structs.replace(
            base, decode=msgspec.structs.replace(base.decode, jitter=jitter)
        )
        return replay(wl, cfg).summary.tpot_ms.mean

    off = tpot(JitterConfig(enabled=False))
    mitigated = tpot(JitterConfig(enabled=True))
    raw = tpot(JitterConfig(enabled=True, manual_gc=False, core_pinning=False, graph_cache=False))
    assert off < mitigated < raw
    assert mitigated < off * 1.05  # pinned cores and manual GC: a small cost
    assert raw > off * 1.5  # 128 DPs: someone is nearly always preempted, GC'd or recompiling


def test_online_eplb_in_a_replay_is_refused_naming_the_field():
    from xds.serve.eplb.online import OnlineEPLBConfig

    base = pd_config("production-4p1d")
    decode = msgspec.structs.replace(base.decode, dies=272, eplb=OnlineEPLBConfig())  # valid
    with pytest.raises(ConfigError) as err:
        msgspec.structs.replace(base, decode=decode)
    assert err.value.field == "decode.eplb"


def test_a_prompt_longer_than_one_groups_kv_runs_sequence_parallel_instead_of_failing():
    prefill = PrefillConfig(tes=2, long_pool_tes=0, prefix_cache_fraction=0.9)
    cfg = msgspec.structs.replace(pd_config("production-4p1d"), prefill=prefill)
    long = Request(0, 0, 100_000, 20)  # a group keeps ~90K tokens of KV beside its cache
    (rec,) = replay(Workload((long,)), cfg).records
    assert rec.outcome == "completed", rec.reason
    assert rec.prefill_placement == "P0/SP8"  # spread over the TE's 8 groups
    no_sp = msgspec.structs.replace(prefill, sp_threshold=0)
    (rec,) = replay(Workload((long,)), msgspec.structs.replace(cfg, prefill=no_sp)).records
    assert rec.outcome == "failed" and "exceeds a prefill DP's KV (" in rec.reason
    # with sequence parallelism the limit is the whole TE's KV, and the reason says so
    huge = Request(0, 0, 2_000_000, 20)
    roomy = msgspec.structs.replace(cfg, max_context_tokens=4_000_000)
    (rec,) = replay(Workload((huge,)), roomy).records
    assert rec.outcome == "failed"
    assert "exceeds a prefill TE's KV (" in rec.reason and "over its 8 DP groups" in rec.reason


@pytest.mark.parametrize("when", ["waiting", "in its step"])
def test_a_prefill_cancelled_while_waiting_or_in_its_step_leaks_no_kv(when):
    from xds.serve.prefill import PrefillJob, PrefillTE

    cfg = PrefillConfig()

    async def main():
        te = PrefillTE(0, cfg, _prefill_cost(cfg), kv_blocks_per_dp=20_000)
        first, second = PrefillJob(0, 20_000, (), 0), PrefillJob(1, 4_000, (), 0)
        scopes = {0: anyio.CancelScope(), 1: anyio.CancelScope()}

        async def prefill(job):
            with scopes[job.request_id]:
                await te.prefill(job)

        async with anyio.create_task_group() as tg:
            tg.start_soon(te.run)
            tg.start_soon(prefill, first)  # sequence-parallel: a step of its own
            tg.start_soon(prefill, second)  # waits in the pool behind it
            await sleep_ns(1 * MS)
            assert first.start_ns >= 0 and te.step_end_ns > now_ns()  # its step is running
            victim = first if when == "in its step" else second
            scopes[victim.request_id].cancel()
            await sleep_ns(5 * S)  # both steps are over
            held = {
                j.request_id: sum(kv.held(j.request_id) for kv in te.kv if kv.holds(j.request_id))
                for j in (first, second)
            }
            tg.cancel_scope.cancel()
        return held, len(te.pool), te.queued_tokens, te._orphans

    held, pool, queued, orphans = run(main)
    assert pool == 0 and queued == 0 and not orphans
    # the cancelled job holds nothing; the other, prefilled, holds its KV until its transfer
    assert held == ({0: 0, 1: held[1]} if when == "in its step" else {0: held[0], 1: 0})
    assert held[1 if when == "in its step" else 0] > 0


def test_a_sequence_parallel_prompt_first_in_line_is_not_starved_by_later_short_ones():
    # group 0 is nearly full: the 40K prompt's share does not fit there yet
    te, groups, placed = _one_step(
        [40_000, 1_000, 2_000], balance=True, kv_blocks=1_000, used={0: 124_000}
    )
    assert not placed and not any(groups)  # nothing takes KV ahead of it
    assert [job.request_id for job, _ in te.pool] == [0, 1, 2]
    # with room everywhere it runs alone, and the short ones wait for the next step
    te, groups, placed = _one_step([40_000, 1_000, 2_000], balance=True, kv_blocks=1_000)
    assert [job.request_id for job, _ in placed] == [0] and placed[0][0].alone


def test_the_first_token_estimate_runs_a_too_long_cached_prompt_sequence_parallel():
    """A prompt with more KV than one group holds runs sequence-parallel however much of it is
    cached; the Job Executor's estimate prices it so (a step of its own), not as batched."""
    from xds.serve.prefill import PrefillTE

    cfg = PrefillConfig(balance_split=False)  # a batched prompt runs on one group
    te = PrefillTE(0, cfg, _prefill_cost(cfg), kv_blocks_per_dp=500)  # 64K tokens per group
    one_group = 500 * cfg.block_tokens
    new, total = 2_000, one_group + 10_000  # few uncached tokens: batched by that count alone
    assert te._is_sp(new, total) and not te._is_sp(new, new)
    alone = te.predicted_first_token_ns(new, 0, total)
    assert alone == te._predicted_step(new, total - new, sp=True)  # the cached part attended
    # a prompt that fits one group is batched; its cached context still costs attention
    half = one_group // 2
    batched = te.predicted_first_token_ns(new, 0, half)
    assert batched == te._predicted_step(new, half - new, sp=False)
    assert batched > te.predicted_first_token_ns(new, 0)


def test_chips_count_whole_chips_per_te_and_the_pod_bounds_910c_dies_only():
    base = pd_config("production-4p1d")
    odd = msgspec.structs.replace(
        base, decode=msgspec.structs.replace(base.decode, dies=33, shared_expert_dies=1)
    )
    assert odd.chips == 4 * 16 + 17  # 33 dies need 17 chips
    odd_prefill = msgspec.structs.replace(
        base, prefill=msgspec.structs.replace(base.prefill, dies_per_te=20)
    )
    assert odd_prefill.chips == 4 * 10 + 64
    # 910B prefill servers attach over RoCE: they do not count against the pod's 768 dies
    b = msgspec.structs.replace(
        base, prefill=msgspec.structs.replace(base.prefill, hardware="910b", tes=40)
    )
    assert b.chips == 40 * 32 + 64
    with pytest.raises(ConfigError, match="11,552 910B dies; a replay models up to 11,520") as err:
        msgspec.structs.replace(b, prefill=msgspec.structs.replace(b.prefill, tes=361))
    assert err.value.field == "prefill.tes"
    with pytest.raises(ConfigError, match="one CloudMatrix384 has 768") as err:
        msgspec.structs.replace(base, prefill=msgspec.structs.replace(base.prefill, tes=21))
    assert err.value.field == "prefill.tes"


def test_a_fault_whose_time_never_comes_is_reported_not_dropped():
    from xds.serve.recovery import MemoryFault, NodeFault
    from xds.serve.replay import DistFlowFault

    wl = production_workload(4, rate_per_s=4.0, seed=0)
    late = [
        NodeFault(at_ns=10**14, server=0),
        MemoryFault(at_ns=10**14, decode_te=0, dp=0),
        DistFlowFault(at_ns=10**14, prefill_te=0),
    ]
    early = DistFlowFault(at_ns=0, prefill_te=1)
    res = replay(wl, SMALL, faults=[early, *late])
    assert res.summary.completed + res.summary.failed == 4
    assert res.unfired_faults == late  # in the order given; the early one struck


def test_replay_records_carry_their_requests_trace_lines():
    wl = Workload(tuple(Request(i, i * MS, 1_000, 4, source_line=10 + 2 * i) for i in range(3)))
    res = replay(wl, SMALL)
    assert [r.source_line for r in res.records] == [10, 12, 14]


def test_the_prefix_cache_block_must_match_the_traces_hash_block():
    """Mooncake's hash_ids cover 512 tokens each: a deployment caching 128-token blocks used to
    credit a quarter of the hits (2048: four times as many)."""
    wl = production_workload(4, rate_per_s=4.0, seed=0)
    assert wl.hash_block_tokens == 512
    assert wl.scaled(2.0).limited(2).hash_block_tokens == 512
    small = msgspec.structs.replace(
        SMALL, prefill=msgspec.structs.replace(SMALL.prefill, prefix_block_tokens=128)
    )
    with pytest.raises(ConfigError, match="prefix hashes cover 512 tokens each") as err:
        replay(wl, small)
    assert err.value.field == "prefill.prefix_block_tokens"
    # a workload without hashes does not care
    plain = Workload((Request(0, 0, 1_000, 4),))
    assert replay(plain, small).records[0].outcome == "completed"


def test_a_max_output_reservation_holds_more_decode_kv_than_the_oracle(monkeypatch):
    """``reserve_output_tokens`` (SPEC 6.3's max_output_tokens): the DP master reserves the
    prompt plus the cap, not the request's own output, so a die holds fewer sequences; an
    output over the cap fails at arrival."""

    def cfg(reserve: int, blocks: int) -> PDConfig:
        decode = msgspec.structs.replace(
            SMALL.decode, reserve_output_tokens=reserve, kv_blocks_per_die=blocks
        )
        return msgspec.structs.replace(SMALL, decode=decode)

    wl = _workload((0, 1_000, 10), (0, 1_000, 300))
    # 1,010 tokens need 8 blocks of 128, 1,300 need 11; the prompt plus a 2,000-token cap, 24
    oracle = replay(wl, cfg(0, 16))
    assert [r.outcome for r in oracle.records] == ["completed", "completed"]
    capped = replay(wl, cfg(2_000, 16)).records
    assert {r.reason for r in capped} == {"sequence of 3000 tokens exceeds a decode DP's KV"}
    roomy = replay(wl, cfg(200, 64)).records
    assert roomy[0].outcome == "completed"
    assert roomy[1].reason == "output 300 tokens exceeds max_output_tokens 200"

    seen: dict[int, int] = {}
    original = DecodeTE.reserve

    async def watched(self, dp, record):
        await original(self, dp, record)
        seen[record.request_id] = self.kv[dp].held(record.request_id)

    monkeypatch.setattr(DecodeTE, "reserve", watched)
    replay(_workload((0, 1_000, 10)), cfg(2_000, 64))
    assert seen == {0: 24}  # ceil((1,000 + 2,000) / 128) blocks, not ceil(1,010 / 128) = 8


def test_the_job_executor_avoids_a_decode_te_whose_kv_faults_masked_away():
    """Every DP group of D0 lost its KV to memory faults: the Job Executor offers the policy
    only the Decode TEs that could still hold the sequence (D1), instead of failing every
    request D0 would have been given; with no such TE, requests fail saying why."""
    from xds.serve.recovery import MemoryFault

    base = pd_config("production-4p1d")
    cfg = msgspec.structs.replace(
        base,
        decode_tes=2,
        prefill=msgspec.structs.replace(base.prefill, tes=1, dies_per_te=4),
        decode=msgspec.structs.replace(
            base.decode, dies=8, shared_expert_dies=0, model="qwen3-235b", kv_blocks_per_die=60
        ),
    )
    wl = Workload([Request(i, int(0.1 * i * S), 100, 10) for i in range(10)], source="masked")

    def masked(*tes):
        return [
            MemoryFault(at_ns=0, dp=d, decode_te=te, first_block=0, blocks=60)
            for te in tes
            for d in range(8)
        ]

    res = replay(wl, cfg, faults=masked(0))
    assert res.summary.completed == 10
    assert {r.decode_placement.split("/")[0] for r in res.records} == {"D1"}
    res = replay(wl, cfg, faults=masked(0, 1))
    assert res.summary.failed == 10
    assert all("usable KV" in r.reason for r in res.records)


def test_a_long_replay_on_the_xccl_tier_warns_of_its_wall_time():
    from xds.serve.replay import XCCL_WARN_BYTES, _warn_xccl_volume

    cfg = pd_config("production-4p1d", kv_transfer="xccl")
    per_token = cfg.decode.spec.kv_bytes_per_token(int8_nope=True, mtp=True)
    assert cfg.decode.kv_bytes_per_token == per_token  # INT8 no-RoPE latent, MTP layer kept
    n = XCCL_WARN_BYTES // per_token + 1
    with pytest.warns(UserWarning, match="s of wall time; the closed-form tier"):
        _warn_xccl_volume(cfg, Workload([Request(0, 0, n, 3)], source="long"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_xccl_volume(cfg, Workload([Request(0, 0, n - 1, 3)], source="short"))
        _warn_xccl_volume(pd_config("production-4p1d"), Workload([Request(0, 0, n, 3)]))


def test_the_cli_gives_a_warning_as_one_line(tmp_path, monkeypatch, capsys):
    import xds.serve.replay as replay_module
    from xds.cli.main import main

    monkeypatch.setattr(replay_module, "XCCL_WARN_BYTES", 1)  # warn on a tiny replay
    trace = tmp_path / "one.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,64,2\n")
    assert main(["replay", str(trace), "--set", "kv_transfer=xccl", "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xds: warning: kv_transfer = 'xccl' moves")


def test_the_prefill_leader_takes_no_steps_while_its_pool_is_empty():
    """SPEC 6.6: the cooperative scheduler runs only while requests are pending: between two
    bursts a minute apart the leader neither all-gathers nor steps."""
    one_te = msgspec.structs.replace(SMALL, prefill=msgspec.structs.replace(SMALL.prefill, tes=1))
    wl = _workload((0, 2_000, 2), (0, 3_000, 2), (60 * S, 2_500, 2))
    grid = comm_grid(one_te.decode)
    assigned: list[tuple[int, int]] = []  # (time, pool size) at each of the leader's steps

    async def main():
        r = Replay(wl, one_te, grid)
        te = r.prefill[0]
        assign = te._assign

        def watched():
            assigned.append((now_ns(), len(te.pool)))
            return assign()

        te._assign = watched
        return r, await r.run()

    r, records = run(main)
    te = r.prefill[0]
    assert all(rec.outcome == "completed" for rec in records)
    assert all(size > 0 for _, size in assigned)  # never scheduled an empty pool
    # one step per burst (the first two prompts batched together): nothing in between
    assert te.steps == len(assigned) == 2
    assert assigned[1][0] == 60 * S + one_te.prefill.all_gather_ns
    assert te.busy_ns < records[0].first_token_ns + records[2].first_token_ns - 60 * S


def test_a_hash_over_a_partial_last_block_is_not_cached_as_a_whole_block():
    """A 600-token prompt's second hash covers 88 tokens: a later prompt whose second block
    (512 tokens) has that hash reuses only the first block, not 1,024 tokens."""
    one_te = msgspec.structs.replace(SMALL, prefill=msgspec.structs.replace(SMALL.prefill, tes=1))
    wl = Workload(
        (
            Request(0, 0, 600, 2, (1, 2)),
            Request(1, 2 * S, 2000, 2, (1, 2, 3, 4)),
            Request(2, 4 * S, 1100, 2, (1, 2, 5)),
        ),
        hash_block_tokens=512,
    )
    records = replay(wl, one_te).records
    assert [r.cached_tokens for r in records] == [0, 512, 1024]  # (1, 2) whole after request 1
