"""Comparing variants over seeds (xds.serve.compare, ``xds compare``): statistics, pairing,
determinism, errors."""

from __future__ import annotations

import json
import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_replay import SMALL
from xds.cli.main import main
from xds.errors import ConfigError
from xds.serve.compare import METRICS, Spread, Variant, compare, metric_values, t95
from xds.serve.replay import replay
from xds.trace.production import production_workload


def built_in(seed: int):
    return production_workload(16, rate_per_s=8.0, seed=seed)


BALANCED = msgspec.structs.replace(
    SMALL, prefill=msgspec.structs.replace(SMALL.prefill, balance_split=True)
)


def test_spread_by_hand():
    s = Spread.of([1.0, 2.0, 3.0])
    assert (s.mean, s.stdev, s.min, s.max) == (2.0, 1.0, 1.0, 3.0)
    assert s.ci95 == pytest.approx(4.303 / math.sqrt(3))
    one = Spread.of([5.0])
    assert (one.mean, one.min, one.max) == (5.0, 5.0, 5.0)
    assert math.isnan(one.ci95) and math.isnan(one.stdev)
    partial = Spread.of([1.0, math.nan, 3.0])  # a seed where it is undefined is left out
    assert (partial.mean, partial.n) == (2.0, 2)
    assert Spread.of([math.nan]).n == 0 and math.isnan(Spread.of([math.nan]).mean)
    assert Spread.of([4.0, 4.0]).ci95 == 0.0
    assert Spread.of([0.1] * 3).mean == 0.1  # never outside its values by rounding


def test_t_quantiles_are_tabulated_then_approximated_continuously():
    assert t95(1) == 12.706 and t95(4) == 2.776 and t95(30) == 2.042
    assert 1.96 < t95(31) < t95(30)
    for df, t in ((31, 2.0395134), (40, 2.0210754), (60, 2.0002978), (120, 1.9799304)):
        assert t95(df) == pytest.approx(t, abs=1e-4)
    assert t95(10_000) == pytest.approx(1.96, abs=0.001)
    with pytest.raises(ValueError):
        t95(0)


def test_each_seed_is_the_replay_of_that_seed_and_differences_are_paired():
    res = compare(built_in, {"small": SMALL, "balanced": BALANCED}, seeds=[0, 1, 2])
    assert res.seeds == [0, 1, 2] and [v.name for v in res.variants] == ["small", "balanced"]
    for v, cfg in zip(res.variants, (SMALL, BALANCED), strict=True):
        assert v.chips == cfg.chips
        for seed, got in zip(res.seeds, v.summaries, strict=True):
            alone = replay(built_in(seed), cfg, seed=seed).summary
            plain = msgspec.structs.replace(got, deployment="", seed=None, workload="")
            assert plain == msgspec.structs.replace(alone, chips=alone.chips)
            assert got.workload == built_in(seed).source == res.workload.replace("0", str(seed))
            assert (got.deployment, got.seed) == (v.name, seed)
    for m in METRICS:  # the mean difference is the difference of the means, seed by seed
        d = res.difference("balanced", m.key)
        values = [
            [metric_values(s)[m.key] for s in v.summaries] for v in res.variants
        ]  # per variant
        deltas = [b - a for a, b in zip(*values, strict=True)]
        assert d.mean == pytest.approx(sum(deltas) / 3, nan_ok=True)
        assert d.baseline == "small" and d.variant == "balanced"
        if d.significant:
            assert abs(d.mean) > d.ci95 and d.better == ((d.mean < 0) == m.lower_is_better)
        else:
            assert d.better is None
    # the leader's step balancing spreads long prompts: every seed's TTFT drops
    base, balanced = ([s.ttft_ms.mean for s in v.summaries] for v in res.variants)
    assert all(b < a for a, b in zip(base, balanced, strict=True))
    ttft = res.difference("balanced", "ttft_mean_ms")
    assert ttft.significant and ttft.better and ttft.relative < 0


def test_a_variant_against_itself_differs_by_nothing_and_workers_change_nothing():
    variants = {"a": SMALL, "b": Variant(SMALL)}
    alone = compare(built_in, variants, seeds=2, jobs=1)
    assert all(d.mean == 0 and not d.significant and d.better is None for d in alone.differences)
    assert msgspec.json.encode(compare(built_in, variants, seeds=2, jobs=2)) == (
        msgspec.json.encode(alone)
    )


def test_a_fixed_workload_and_plugged_policies():
    wl = built_in(0)
    seen = []

    def first_offered(eligible, dps, reserve_blocks):
        seen.append(len(eligible))
        return eligible[0]

    res = compare(
        wl,
        {"default": SMALL, "first": Variant(SMALL, {"decode_routing": first_offered})},
        seeds=2,
        on_replay=lambda name, seed, s: seen.append((name, seed, s.requests)),
    )
    assert ("default", 0, 16) in seen and ("first", 1, 16) in seen
    assert sum(isinstance(x, int) for x in seen) == 2 * 16  # the router ran in its variant only
    assert [s.requests for v in res.variants for s in v.summaries] == [16] * 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"variants": {}}, "variants"),
        ({"variants": {"": SMALL}}, "variants"),
        ({"variants": {"x": 3}}, "variants['x']"),
        ({"variants": {"x": Variant(SMALL, {"routing": len})}}, "variants['x'].policies"),
        ({"variants": {"x": Variant(SMALL, {"decode_routing": 3})}}, "variants['x'].policies"),
        ({"seeds": 0}, "seeds"),
        ({"seeds": True}, "seeds"),
        ({"seeds": [1, 1]}, "seeds"),
        ({"seeds": [-1]}, "seeds"),
        ({"seeds": []}, "seeds"),
        ({"seeds": 2.5}, "seeds"),
        ({"seeds": "12"}, "seeds"),
        ({"jobs": 0}, "jobs"),
        ({"workload": 5}, "workload"),
        ({"workload": lambda seed: None}, "workload"),
        ({"on_replay": lambda name: None}, "on_replay"),
    ],
)
def test_bad_arguments_name_their_field(kwargs, field):
    args = {"workload": built_in, "variants": {"small": SMALL}, "seeds": 1, **kwargs}
    with pytest.raises(ConfigError) as err:
        compare(args.pop("workload"), args.pop("variants"), **args)
    assert (err.value.field or "").startswith(field)


def test_cli_compare_json_table_and_bad_input(tmp_path, capsys):
    toml = tmp_path / "small.toml"
    toml.write_text(
        "[prefill]\ntes = 2\nlong_pool_tes = 0\n"
        "[decode]\ndies = 32\nbatch_per_die = 4\nshared_expert_dies = 4\n"
    )
    policy = tmp_path / "mypolicies.py"
    policy.write_text("def first(eligible, dps, reserve_blocks):\n    return eligible[0]\n")
    argv = ["compare", "--deployment", str(toml), "--synthetic", "12", "--rate", "6"]
    more = ["--seeds", "2", "--seed", "4", "--jobs", "1"]
    assert main([*argv, *more, "--policy", f"decode_routing={policy}:first", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seeds"] == [4, 5]
    spec = f"decode_routing={policy}:first"  # named as written
    assert [v["name"] for v in out["variants"]] == [str(toml), f"{toml} + {spec}"]
    assert [m["key"] for m in out["metrics"]] == [m.key for m in METRICS]
    assert len(out["differences"]) == len(METRICS)
    assert main([*argv, *more, "--policy", f"decode_routing={policy}:first"]) == 0
    text = capsys.readouterr().out
    assert "mean ± 95 % interval" in text and "Δ" in text and "TPOT mean (ms)" in text
    assert main([*argv, "--seeds", "1", "--jobs", "1"]) == 0
    assert "one seed: no intervals" in capsys.readouterr().out
    assert main([*argv, "--deployment", str(toml)]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main([*argv, "--seeds", "0"]) == 2
    assert main(["compare", str(tmp_path / "t.jsonl"), "--synthetic", "5"]) == 2
    assert "--synthetic applies" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 1}\n')
    assert main(["compare", str(bad), "--deployment", str(toml)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_a_deployment_the_workload_does_not_fit_is_named_before_any_replay(tmp_path, capsys):
    hashed = msgspec.structs.replace(built_in(0), hash_block_tokens=256)
    with pytest.raises(ConfigError) as err:
        compare(hashed, {"a": SMALL}, seeds=1)
    assert err.value.field == "variants['a'].config.prefill.prefix_block_tokens"
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i * 500}, "input_length": 600, "output_length": 3, '
            f'"hash_ids": [{i}, {i + 1}]}}\n'
            for i in range(4)
        )
    )
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("[prefill]\ntes = 2\n")
    bad.write_text("[prefill]\ntes = 2\nprefix_block_tokens = 256\n")
    for argv in (
        ["--deployment", str(good), "--deployment", str(bad)],
        ["--deployment", str(bad), "--policy", f"decode_routing={tmp_path / 'p.py'}:f"],
    ):
        (tmp_path / "p.py").write_text("def f(eligible, dps, reserve_blocks):\n    return 0\n")
        assert main(["compare", str(trace), *argv, "--seeds", "2", "--jobs", "1"]) == 2
        err = capsys.readouterr().err
        assert f"xds: error: {bad}: prefill.prefix_block_tokens:" in err and "(line 3)" in err
    # each replay's summary in --json names its trace, as a replay's summary.json does
    argv = ["compare", str(trace), "--deployment", str(good), "--seeds", "2", "--jobs", "1"]
    assert main([*argv, "--json"]) == 0
    (variant,) = json.loads(capsys.readouterr().out)["variants"]
    assert [(s["trace"], s["trace_format"]) for s in variant["summaries"]] == [
        (str(trace), "mooncake")
    ] * 2


def test_faults_strike_every_replay_alike(tmp_path, capsys):
    from xds.serve.replay import DistFlowFault

    fault = DistFlowFault(at_ns=0, prefill_te=0, kind="transport")
    res = compare(built_in, {"a": SMALL, "b": SMALL}, seeds=1, faults=[fault])
    for v in res.variants:  # the pair P0-D0 fails its transfers: its requests fail
        (s,) = v.summaries
        assert s.failed and any("DistFlow P0-D0" in k for k in s.failures)
    assert res.variants[0].summaries[0] == msgspec.structs.replace(
        res.variants[1].summaries[0], deployment="a"
    )
    with pytest.raises(ConfigError) as err:  # checked against every variant first
        compare(built_in, {"a": SMALL}, seeds=1, faults=[fault, "not a fault"])
    assert err.value.field == "faults[1]"
    toml = tmp_path / "small.toml"
    toml.write_text("[prefill]\ntes = 2\nlong_pool_tes = 0\n")
    argv = ["compare", "--deployment", str(toml), "--synthetic", "8", "--seeds", "1"]
    assert main([*argv, "--fault", "transport:at=0,prefill_te=5"]) == 2
    assert "--fault transport:at=0,prefill_te=5: prefill_te: no DistFlow instance P5-D0" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--fault", "transport:at=0,prefill_te=0", "--json", "--jobs", "1"]) == 0
    (variant,) = json.loads(capsys.readouterr().out)["variants"]
    assert variant["summaries"][0]["failed"] > 0 and variant["unfired_faults"] == [0]
    assert main([*argv, "--fault", "node:at=100000,server=1", "--jobs", "1"]) == 0
    assert f"never struck (every request had ended first) in: {toml} seed 0" in (
        capsys.readouterr().err
    )
    # a fault one preset variant has no place for names that variant
    xccl = "production-4p1d@kv_transfer=xccl"
    argv = ["compare", "--synthetic", "8", "--deployment", "production-4p1d", "--deployment", xccl]
    assert main([*argv, "--fault", "node:at=10,server=3"]) == 2
    assert capsys.readouterr().err.startswith(
        f"xds: error: --deployment {xccl}: kv_transfer: node faults need"
    )


def test_every_variant_is_checked_before_anything_is_replayed():
    from xds.serve.recovery import NodeFault

    ran = []
    big = msgspec.structs.replace(SMALL, decode=msgspec.structs.replace(SMALL.decode, dies=64))
    with pytest.raises(ConfigError) as err:  # SMALL has fewer servers than big
        compare(
            built_in,
            {"big": big, "small": SMALL},
            seeds=2,
            faults=[NodeFault(at_ns=10**9, server=big.servers - 1)],
            on_replay=lambda *a: ran.append(a),
        )
    assert ran == [] and "(variant 'small')" in str(err.value)
    assert err.value.field == "faults[0].server"
    with pytest.raises(ConfigError) as err:
        compare(built_in, {"a": Variant(SMALL, {"decode_routing": lambda one: 0})}, seeds=2)
    assert "decode_routing" in (err.value.field or "")


def test_goodput_is_judged_by_one_sla():
    from xds.trace.metrics import SLA

    strict = msgspec.structs.replace(SMALL, sla=SLA(ttft_ms=100, tpot_ms=50))
    with pytest.raises(ConfigError, match="different SLAs") as err:
        compare(built_in, {"a": SMALL, "strict": strict}, seeds=1)
    assert err.value.field == "sla"
    one = SLA(ttft_ms=100, tpot_ms=50)
    res = compare(built_in, {"a": SMALL, "strict": strict}, seeds=2, sla=one, jobs=np.int64(1))
    assert all(s.sla == one for v in res.variants for s in v.summaries)
    assert res.difference("strict", "goodput").mean == 0.0  # the same replays, judged alike


def test_cli_one_sla_and_the_built_in_limit(tmp_path, capsys):
    small = tmp_path / "small.toml"
    small.write_text("[prefill]\ntes = 2\nlong_pool_tes = 0\n")
    strict = tmp_path / "strict.toml"
    strict.write_text(small.read_text() + "[sla]\nttft_ms = 100\ntpot_ms = 50\n")
    argv = ["compare", "--deployment", str(small), "--deployment", str(strict)]
    more = ["--synthetic", "12", "--seeds", "1", "--jobs", "1", "--json"]
    assert main([*argv, *more]) == 2
    assert "different SLAs" in capsys.readouterr().err
    assert main([*argv, *more, "--ttft-ms", "100", "--limit", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    summaries = [s for v in out["variants"] for s in v["summaries"]]
    assert {s["requests"] for s in summaries} == {5}  # --limit applies to the built-in too
    assert {(s["sla"]["ttft_ms"], s["sla"]["tpot_ms"]) for s in summaries} == {(100, 35)}
    assert out["workload"].startswith("production(n=12")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False) | st.just(math.nan), min_size=1, max_size=40))
def test_spread_invariants(values):
    """Whatever the values: the mean lies within them, the interval is never negative and a
    constant shift leaves it unchanged, and NaN seeds are left out."""
    s = Spread.of(values)
    finite = [v for v in values if not math.isnan(v)]
    assert s.n == len(finite)
    if not finite:
        assert math.isnan(s.mean)
        return
    assert s.min <= s.mean <= s.max and (s.min, s.max) == (min(finite), max(finite))
    if s.n >= 2:
        assert s.ci95 >= 0 and s.stdev >= 0
        shifted = Spread.of([v + 1000.0 for v in finite])
        assert shifted.ci95 == pytest.approx(s.ci95, rel=1e-6, abs=1e-6)
    else:
        assert math.isnan(s.ci95)


def test_a_node_fault_striking_different_roles_in_two_deployments_is_a_warning():
    from xds.serve.presets import pd_config
    from xds.serve.recovery import NodeFault

    four, five = pd_config("production-4p1d"), pd_config("production-4p1d", ["prefill.tes=5"])
    assert [four.server_role(s) for s in (0, 7, 8, 15, 16)] == [
        "Prefill TE 0",
        "Prefill TE 3",
        "Decode TE 0",
        "Decode TE 0",
        "no server",
    ]
    assert five.server_role(9) == "Prefill TE 4"
    fault = NodeFault(at_ns=10**12, server=9)  # after every request: the warning is the point
    wl = production_workload(4, rate_per_s=4.0, seed=0)
    with pytest.warns(UserWarning, match="server 9 strikes Decode TE 0 in 4p, Prefill TE 4 in 5p"):
        compare(wl, {"4p": four, "5p": five}, seeds=1, faults=[fault], jobs=1)
    same = NodeFault(at_ns=10**12, server=1)  # Prefill TE 0 in both: no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compare(wl, {"4p": four, "5p": five}, seeds=1, faults=[same], jobs=1)
