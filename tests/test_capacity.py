"""Capacity search (xds.serve.capacity, ``xds capacity``): bracketing, criteria, errors."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest

from test_replay import SMALL
from xds.cli.main import main
from xds.errors import ConfigError
from xds.serve.capacity import (
    FAR_BEHIND,
    KEEP_UP,
    backlog_ratio,
    measure_point,
    search_capacity,
    steady_window,
)
from xds.trace.metrics import SLA, RequestRecord
from xds.trace.production import production_workload
from xds.trace.workload import Request, Workload

MS = 1_000_000


def built_in(window_s: float = 5.0):
    def at(rate: float) -> Workload:
        return production_workload(max(20, round(rate * window_s)), rate_per_s=rate, seed=0)

    return at


def with_sla(ttft_ms: float = 2000.0, tpot_ms: float = 35.0):
    return msgspec.structs.replace(SMALL, sla=SLA(ttft_ms=ttft_ms, tpot_ms=tpot_ms))


def test_search_brackets_the_knee_and_is_deterministic():
    res = search_capacity(built_in(), SMALL, start=4.0, bisections=2)
    scales = [p.scale for p in res.points]
    assert scales == sorted(scales) and len(set(scales)) == len(scales)
    assert res.found is not None and res.found.meets
    above = [p for p in res.points if p.scale > res.found.scale]
    assert above and not above[0].meets  # the rate just above the one found missed
    assert res.binding == "; ".join(above[0].misses)
    # doubling from 4 then two bisections: the bracket is a quarter of the last doubling step
    fails = [p.scale for p in res.points if not p.meets]
    assert min(fails) - res.found.scale <= res.found.scale / 2
    for p in res.points:  # the verdict is the mean criterion, recomputed
        sustained = not (
            (p.backlog_ratio > KEEP_UP and p.backlog_excess_ms > 2000.0 / 4)
            or (p.backlog_ratio > FAR_BEHIND and p.backlog_excess_ms > 2000.0 / 10)
        )
        assert p.meets == (p.tpot_ms <= 35.0 and p.ttft_ms <= 2000.0 and sustained)
        assert 0 < p.steady_requests <= p.requests and p.failed == 0
    again = search_capacity(built_in(), SMALL, start=4.0, bisections=2)
    assert msgspec.json.encode(again) == msgspec.json.encode(res)


def seen_by(scales: list[float]):
    return lambda point: scales.append(point.scale)


def test_worker_processes_change_the_wall_time_only():
    """jobs=2 replays guessed next rates in forked workers; the points tried, their numbers
    and the result are those of the one-process search, up and down, with user policies."""

    def first_fit(dps, loads, reserve):
        return dps[0]

    for start in (4.0, 64.0):
        kw = dict(start=start, bisections=1, decode_routing=first_fit)
        seen: list[float] = []
        one = search_capacity(built_in(), SMALL, **kw)
        two = search_capacity(built_in(), SMALL, jobs=2, on_point=seen_by(seen), **kw)
        assert msgspec.json.encode(two) == msgspec.json.encode(one)
        assert sorted(seen) == [p.scale for p in one.points]  # each tried point reported once
    with pytest.raises(ConfigError, match="at least two requests"):  # a worker's error, here
        search_capacity(lambda x: Workload(()), SMALL, jobs=2)


def test_search_halves_from_a_start_that_misses():
    seen = []
    res = search_capacity(built_in(), SMALL, start=64.0, bisections=1, on_point=seen.append)
    assert [p.scale for p in seen][:2] == [64.0, 32.0]  # measured in search order
    assert not seen[0].meets
    assert res.found is not None and res.found.scale < 64.0
    assert all(not p.meets for p in res.points if p.scale >= 2 * res.found.scale)


def test_no_rate_meets_an_impossible_sla():
    res = search_capacity(built_in(), with_sla(tpot_ms=1.0), start=2.0, min_scale=0.5)
    assert res.found is None
    assert [p.scale for p in res.points] == [0.5, 1.0, 2.0]
    assert res.binding.startswith("mean TPOT") and "> 1 ms" in res.binding


def test_every_rate_up_to_the_cap_met_the_sla():
    res = search_capacity(built_in(), SMALL, start=1.0, max_scale=3.0, bisections=3)
    assert res.capped and res.binding == ""
    assert res.found is not None and res.found.scale == 3.0  # the last step lands on the cap
    assert [p.scale for p in res.points] == [1.0, 2.0, 3.0]


def test_the_steps_land_on_the_bounds_and_no_rate_is_replayed_twice(monkeypatch):
    """A stub replay whose SLA holds up to x = 2.9."""
    import xds.serve.capacity as capacity

    asked: list[float] = []

    class Result(msgspec.Struct):
        records: list
        prefill_busy: list

    def fake_replay(workload, cfg, *, seed, grid, **policies):
        tpot = 10 if float(workload.source) <= 2.9 else 50
        return Result(
            [
                RequestRecord(
                    i,
                    i * MS,
                    100,
                    11,
                    first_token_ns=(i + 1) * MS,
                    finish_ns=(i + 1 + 10 * tpot) * MS,
                )
                for i in range(4)
            ],
            [0.5],
        )

    def stub(x):
        asked.append(x)
        return Workload(tuple(Request(i, i * MS, 100, 11) for i in range(4)), str(x))

    monkeypatch.setattr(capacity, "replay", fake_replay)
    res = search_capacity(stub, SMALL, start=1.0, max_scale=3.0, bisections=80)
    assert res.found is not None and not res.capped
    assert res.found.scale == pytest.approx(2.9) and res.found.scale <= 2.9
    # first the floor's workload (to check its arrivals stay within reach), then the search;
    # the last doubling lands on the cap (3, not 4)
    assert asked[:4] == [1 / 256, 1.0, 2.0, 3.0]
    assert len(asked) - 1 == len(set(asked)) - 1 == len(res.points) < 83  # resolution stops it
    assert res.binding == "mean TPOT 50.00 ms > 35 ms"
    asked.clear()
    down = search_capacity(stub, SMALL, start=100.0, min_scale=2.5, bisections=0)
    # lands on the floor, whose workload (built first) is not built again
    assert asked == [2.5, 100.0, 50.0, 25.0, 12.5, 6.25, 3.125]
    assert down.found is not None and down.found.scale == 2.5


def test_your_policies_run_in_every_replay_of_the_search():
    calls = {"n": 0}

    def first_fit(eligible, dps, reserve_blocks):  # pack: the lowest-numbered DP with room
        calls["n"] += 1
        return min(eligible)

    res = search_capacity(built_in(), SMALL, start=8.0, bisections=0, decode_routing=first_fit)
    default = search_capacity(built_in(), SMALL, start=8.0, bisections=0)
    assert calls["n"] >= sum(p.requests for p in res.points)  # every request was routed by it
    assert [p.scale for p in res.points] == [p.scale for p in default.points]
    # packing leaves most decode DPs idle at these rates: a different decode picture
    assert res.points[0].tpot_ms != default.points[0].tpot_ms


def test_goodput_criterion_judges_the_share_within_the_sla():
    loose = search_capacity(
        built_in(), SMALL, start=8.0, bisections=0, criterion="goodput", goodput_target=0.5
    )
    strict = search_capacity(
        built_in(), SMALL, start=8.0, bisections=0, criterion="goodput", goodput_target=0.99
    )
    for res, target in ((loose, 0.5), (strict, 0.99)):
        for p in res.points:  # a goodput miss is exactly a share below the target
            assert any(m.startswith("goodput") for m in p.misses) == (p.goodput < target)
            assert p.meets == (p.goodput >= target and not p.misses)
    assert loose.found is not None and strict.found is not None
    assert loose.found.scale >= strict.found.scale


def _record(i: int, arrival_ms: int, ttft_ms: int, tpot_ms: int, out: int = 11) -> RequestRecord:
    first = (arrival_ms + ttft_ms) * MS
    return RequestRecord(
        i,
        arrival_ms * MS,
        100,
        out,
        first_token_ns=first,
        finish_ns=first + tpot_ms * MS * (out - 1),
    )


def test_point_metrics_by_hand():
    """Eight arrivals 0..7 s: the steady window is the middle half (1.75 s .. 5.25 s)."""
    recs = [_record(i, 1000 * i, ttft_ms=500 * (i + 1), tpot_ms=10 * (i + 1)) for i in range(8)]
    recs[4] = RequestRecord(4, 4000 * MS, 100, 11, outcome="failed", reason="too long")
    assert [r.request_id for r in steady_window(recs)] == [2, 3, 4, 5]
    wl = Workload(tuple(Request(r.request_id, r.arrival_ns, 100, 11) for r in recs))
    p = measure_point(wl, 1.0, recs, SMALL, [0.5, 0.7])
    assert p.steady_requests == 4 and p.failed == 1 and p.requests == 8
    assert p.ttft_ms == pytest.approx((1500 + 2000 + 3000) / 3)  # completed: ids 2, 3, 5
    assert p.tpot_ms == pytest.approx((30 + 40 + 60) / 3)
    assert p.goodput == pytest.approx(1 / 4)  # only id 2 has TTFT < 2 s and TPOT < 35 ms
    assert p.rate_per_s == pytest.approx(7 / 7)
    assert p.prefill_busy == pytest.approx(0.6)
    assert p.misses == (
        "mean TPOT 43.33 ms > 35 ms",
        "mean TTFT 2,167 ms > 2,000 ms",
        "1 of 4 requests failed (too long)",  # the means cover completed requests only
    )
    g = measure_point(wl, 1.0, recs, SMALL, [], criterion="goodput", goodput_target=0.25)
    assert g.meets and g.misses == ()
    flat = [_record(i, 1000 * i, ttft_ms=500, tpot_ms=10) for i in range(8)]
    flat[4] = msgspec.structs.replace(
        flat[4],
        input_tokens=199_990,
        outcome="failed",
        reason="context 200000 tokens exceeds max_context_tokens 131072",
    )
    f = measure_point(wl, 1.0, flat, SMALL, [])
    assert f.meets and f.failed == 1  # too long for the model: not the deployment's failure
    # a deployment that lowers max_context_tokens below the model's refuses what others serve:
    # its failures count (it once came out with twice the capacity for failing half the work)
    flat[4] = msgspec.structs.replace(
        flat[4], input_tokens=4_990, reason="context 5000 tokens exceeds max_context_tokens 4000"
    )
    f = measure_point(wl, 1.0, flat, SMALL, [])
    assert not f.meets and f.misses == (
        "1 of 4 requests failed (context 5000 tokens exceeds max_context_tokens 4000)",
    )
    assert p.lead_in_s == pytest.approx(1.75)  # first arrival to the window's start
    assert p.mean_decode_s == pytest.approx((0.3 + 0.4 + 0.6) / 3)  # 10 gaps of their TPOT
    assert p.warm
    slow = [_record(i, 1000 * i, ttft_ms=100, tpot_ms=300) for i in range(8)]  # 3 s each
    assert not measure_point(wl, 1.0, slow, SMALL, []).warm  # decode had not filled up


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"start": 0.0}, "start"),
        ({"start": 4.0, "max_scale": 2.0}, "max_scale"),
        ({"min_scale": 2.0}, "min_scale"),
        ({"bisections": -1}, "bisections"),
        ({"criterion": "p99"}, "criterion"),
        ({"goodput_target": 1.5}, "goodput_target"),
        ({"jobs": 0}, "jobs"),
    ],
)
def test_bad_arguments_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        search_capacity(built_in(), SMALL, **kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("requests", [(), ((0, 0), (1, 0))])
def test_a_workload_the_rate_cannot_change_is_an_error(requests):
    fixed = Workload(tuple(Request(i, a, 100, 11) for i, a in requests))
    with pytest.raises(ConfigError, match="at least two requests") as err:
        search_capacity(lambda x: fixed, SMALL)
    assert err.value.field == "workload_at"


def test_what_the_search_calls_is_checked_before_it_replays_anything():
    trace = Workload(tuple(Request(i, i * 10**9, 100, 11) for i in range(4)))

    async def async_at(x):
        return trace

    for bad, kwargs, field, says in (
        (trace, {}, "workload_at", "got a Workload: pass its `scaled` method"),
        (lambda: trace, {}, "workload_at", r"must take 1 positional argument$"),
        (async_at, {}, "workload_at", "is async"),
        (trace.scaled, {"on_point": lambda: None}, "on_point", "on_point callback"),
    ):
        with pytest.raises(ConfigError, match=says) as err:
            search_capacity(bad, SMALL, **kwargs)
        assert err.value.field == field


def test_infinite_bounds_and_overflowing_rates_are_errors():
    with pytest.raises(ConfigError) as err:
        search_capacity(built_in(), SMALL, max_scale=float("inf"))
    assert err.value.field == "max_scale"
    with pytest.raises(ConfigError, match="beyond the clock's range") as err:
        production_workload(20, rate_per_s=1e-9)
    assert err.value.field == "rate_per_s"


def test_cli_criteria_are_the_library_criteria():
    from xds.cli.main import capacity
    from xds.serve.capacity import CRITERIA

    choice = next(p for p in capacity.params if p.name == "criterion").type
    assert tuple(choice.choices) == CRITERIA


def test_cli_capacity_json_and_bad_input(tmp_path, capsys):
    toml = tmp_path / "small.toml"
    toml.write_text(
        "[prefill]\ntes = 2\nlong_pool_tes = 0\n"
        "[decode]\ndies = 32\nbatch_per_die = 4\nshared_expert_dies = 4\n"
    )
    bigger = tmp_path / "bigger.toml"  # one more Prefill TE in front of the same decode
    bigger.write_text(toml.read_text().replace("tes = 2", "tes = 3"))
    argv = ["capacity", "--deployment", str(toml), "--window", "5", "--start", "16"]
    assert main([*argv, "--deployment", str(bigger), "--bisections", "0", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["deployment"], d["chips"]) for d in lines] == [(str(toml), 48), (str(bigger), 64)]
    out = lines[0]
    assert out["criterion"] == "mean" and out["found"]["scale"] == 8.0
    assert [p["scale"] for p in out["points"]] == [8.0, 16.0]  # 16 missed: halved once
    for p in out["points"]:  # the warm flag the README describes is in the JSON too
        assert p["warm"] == (p["lead_in_s"] >= p["mean_decode_s"])
    assert out["binding"] == "; ".join(out["points"][1]["misses"])
    # each line says what was searched: the workload, the seed and the deployment it ran
    assert (out["trace"], out["trace_format"], out["seed"]) == (None, None, 0)
    assert out["workload"].startswith("production(rate searched, 5 s of arrivals at each")
    assert out["scale_unit"] == "req/s"
    from xds.serve.replay import PDConfig

    assert msgspec.convert(out["config"], PDConfig).prefill.tes == 2
    more = lines[1]  # one more Prefill TE: never sustains less, and queues less at 16
    assert more["found"]["scale"] >= out["found"]["scale"]
    at_16 = {p["scale"]: p for p in more["points"]}[16.0]
    assert at_16["ttft_ms"] < out["points"][-1]["ttft_ms"]
    assert main([*argv, "--deployment", str(bigger), "--bisections", "0"]) == 0
    text = capsys.readouterr().out
    assert "capacity compared" in text and "req/s per chip" in text
    compared = text[text.index("capacity compared") :]
    names = "".join(ln.split("│")[1].strip() for ln in compared.splitlines() if ln[:1] == "│")
    assert f"{toml}{bigger}" in names  # long names fold, whole, rather than being cut off
    assert main([*argv, "--goodput", "0"]) == 2
    assert main([*argv, "--criterion", "p99"]) == 2
    assert main(["capacity", str(tmp_path / "t.jsonl"), "--unique-prompts"]) == 2
    assert "--unique-prompts applies" in capsys.readouterr().err
    assert main(["capacity", str(tmp_path / "t.jsonl"), "--window", "60"]) == 2
    assert main(["capacity", "--rate", "3"]) == 2
    assert main([*argv, "--max-scale", "4"]) == 2  # below --start
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("xds: error:") for line in err)
    assert main(["capacity", "--start", "2000"]) == 2  # beyond the conversations' history
    assert "--start 2000: the built-in workload's conversations reach at most 1,667 req/s" in (
        capsys.readouterr().err
    )


def test_the_search_floor_keeps_a_long_trace_within_a_replays_reach():
    """Halving the rate of a long trace stretches it; the search stops where its arrivals
    would pass 24 days instead of failing there."""
    import msgspec

    from xds.serve.replay import MAX_ARRIVAL_NS, PDConfig
    from xds.trace.workload import fixed

    base = fixed(256, 4, 4, rate_per_s=1 / 86_400)  # 3 days of arrivals at x = 1
    cfg = msgspec.structs.replace(PDConfig(), sla=SLA(ttft_ms=0.001, tpot_ms=0.001))
    res = search_capacity(base.scaled, cfg, bisections=0, min_scale=1 / 16)
    assert res.found is None
    lowest = min(p.scale for p in res.points)
    assert lowest > 1 / 16 and base.scaled(lowest).duration_ns <= MAX_ARRIVAL_NS


def test_decoding_counts_a_request_from_joining_a_batch_not_from_its_first_token():
    from xds.serve.capacity import decoding_per_die

    recs = [_record(i, 1000 * i, ttft_ms=100, tpot_ms=100, out=41) for i in range(8)]
    waited = [
        msgspec.structs.replace(r, decode_wait_ns=r.finish_ns - r.first_token_ns - 1_000 * MS)
        for r in recs
    ]  # each waits for a batch slot until 1 s before its last token
    # the window is 1.75 .. 5.25 s; request i decodes from i + 0.1 s to i + 4.1 s
    assert decoding_per_die(recs, 1) == pytest.approx(
        (2.35 + 3.35 + 3.15 + 2.15 + 1.15 + 0.15) / 3.5
    )
    # ... or, having waited, from i + 3.1 s: ids 0, 1 and 2 overlap the window
    assert decoding_per_die(waited, 1) == pytest.approx((1 + 1 + 0.15) / 3.5)


def test_a_burst_the_deployment_works_off_after_it_is_not_sustained():
    """Sixteen requests arriving within 150 ms whose first tokens come over 3 s: each meets the
    2 s TTFT on average, but prefill is not keeping up with the arrivals."""
    recs = [_record(i, 10 * i, ttft_ms=200 * i, tpot_ms=10) for i in range(16)]
    ratio, excess = backlog_ratio(recs)
    assert ratio > 10 and excess > 2_000
    wl = Workload(tuple(Request(r.request_id, r.arrival_ns, 100, 11) for r in recs))
    p = measure_point(wl, 1.0, recs, SMALL, [])
    assert p.ttft_ms < 2000 and p.tpot_ms < 35  # the means alone would pass
    assert not p.meets and "arrivals outpace the deployment" in p.misses[0]
    steady = [_record(i, 1000 * i, ttft_ms=300 + 100 * (i % 3), tpot_ms=10) for i in range(16)]
    q = measure_point(wl, 1.0, steady, SMALL, [])
    assert q.meets and q.backlog_ratio == pytest.approx(1.0, abs=0.05)
    # a burst so short that the backlog stays under a quarter of the TTFT SLA (here 315 ms):
    # first tokens at a quarter of the arrival rate are still not a sustained rate
    short = [_record(i, 7 * i, ttft_ms=45 * i, tpot_ms=10) for i in range(16)]
    r = measure_point(wl, 1.0, short, SMALL, [])
    assert r.backlog_ratio > FAR_BEHIND and 200 < r.backlog_excess_ms < 500
    assert not r.meets and "arrivals outpace the deployment" in r.misses[0]
    # ... but a handful of requests whose prompts (and so TTFTs) grow, lagging by a few tens
    # of ms in all, is not a backlog
    growing = [_record(i, 5 * i, ttft_ms=100 + i * i, tpot_ms=10) for i in range(16)]
    g = measure_point(wl, 1.0, growing, SMALL, [])
    assert g.backlog_ratio > FAR_BEHIND and g.backlog_excess_ms < 200 and g.meets


def test_a_search_per_seed_gives_the_capacity_an_interval(tmp_path, capsys):
    from xds.serve.capacity import SeededCapacity, search_capacity_over_seeds

    seen = []

    def at(rate: float, seed: int) -> Workload:
        return production_workload(max(20, round(rate * 5)), rate_per_s=rate, seed=seed)

    res = search_capacity_over_seeds(
        at, SMALL, seeds=[0, 2], start=8.0, bisections=1, on_result=lambda s, r: seen.append(s)
    )
    assert seen == [0, 2] and res.seeds == [0, 2]
    alone = search_capacity(lambda x: at(x, 2), SMALL, start=8.0, bisections=1, seed=2)
    assert res.results[1] == alone  # each is that seed's own search
    scales = [r.found.scale for r in res.results if r.found and not r.capped]
    assert res.capacity.n == len(scales) and res.capacity.mean == pytest.approx(
        sum(scales) / len(scales)
    )
    assert res == SeededCapacity.of(res.seeds, res.results)
    with pytest.raises(ConfigError, match="seeds="):
        search_capacity_over_seeds(at, SMALL, seeds=2, seed=3)
    with pytest.raises(ConfigError) as err:
        search_capacity_over_seeds(lambda x: at(x, 0), SMALL, seeds=2)  # type: ignore[arg-type]
    assert err.value.field == "workload_at"
    toml = tmp_path / "small.toml"
    toml.write_text(
        "[prefill]\ntes = 2\nlong_pool_tes = 0\n"
        "[decode]\ndies = 32\nbatch_per_die = 4\nshared_expert_dies = 4\n"
    )
    argv = ["capacity", "--deployment", str(toml), "--window", "5", "--start", "8"]
    more = ["--bisections", "1", "--seeds", "2", "--jobs", "1"]
    assert main([*argv, *more, "--json"]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["deployment"] == str(toml) and line["seeds"] == [0, 1]
    assert len(line["results"]) == 2 and line["capacity"]["n"] <= 2
    same = str(toml).replace("small", "./small")  # the same deployment: differs by nothing
    assert main([*argv, *more, "--deployment", same]) == 0
    out = capsys.readouterr().out
    assert "capacity of" in out and "over seeds" in out and "capacity compared over seeds" in out
    assert "+0.00 ± 0.00 ~" in out
    assert main([*argv, *more, "--deployment", same, "--json"]) == 0
    first, second = (json.loads(x) for x in capsys.readouterr().out.splitlines())
    assert "difference_from_first" not in first
    assert second["difference_from_first"]["mean"] in (0.0, None)  # itself: 0, or none found
    capped = ["--window", "10", "--start", "2", "--max-scale", "2"]  # every seed meets at 2
    assert main(["capacity", "--deployment", str(toml), *capped, *more]) == 0
    out = capsys.readouterr().out
    assert "capacity: none to average (2 seed(s) met the SLA up to the search cap, so their" in out
    assert main([*argv, *more, "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot draws one search per deployment: give --seeds 1" in capsys.readouterr().err


def test_stopping_running_guesses_kills_them_and_never_waits_on_them():
    """Guesses still computing when the search ends are killed, each on its own pipe: nothing
    they held (a result half written) can block the search's exit."""
    import time

    from xds.serve.speculative import Speculator

    def slow(x: float) -> float:
        time.sleep(60)  # (a worker's wall time: a guess the search will not need)
        return x

    spec = Speculator(slow, jobs=2)
    spec.ahead([1.0, 2.0, 3.0])
    assert spec.speculated == 2  # as many as there are workers
    guesses = list(spec._pending.values())
    spec.close()
    assert all(not g._process.is_alive() for g in guesses)
    done = Speculator(lambda x: 2 * x, jobs=2)
    done.ahead([4.0])
    assert done.get(4.0) == 8.0 and done.get(5.0) == 10.0  # a guess's value, then computed here
    done.close()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie waiting to be reaped is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_a_search_and_its_worker_processes():
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "xds", "capacity", "--jobs", "2", "--window", "120"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    for _ in range(600):  # wait for the search's guesses to fork (in wall time)
        time.sleep(0.05)
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            break
        if children:
            break
    assert children, "the search forked no worker"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().endswith("xds: terminated")
    assert "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(c) for c in children)


def test_a_sigterm_landing_where_python_ignores_the_interrupt_still_stops_the_command():
    """SIGTERM at a fork (the search forks its guesses) raised its KeyboardInterrupt inside
    logging's at-fork hook, where Python prints it and carries on: the search ran to its end
    and exited 0. The interrupt is now raised again until the command stops, quietly."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import os, signal, time
        from xds.cli.main import _terminate_as_interrupt
        terminated, fired = [], []
        def hook():  # the signal's handler runs inside this hook, which swallows its error
            if not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
        os.register_at_fork(after_in_parent=hook)
        try:
            with _terminate_as_interrupt(terminated):
                if os.fork() == 0:
                    os._exit(0)
                time.sleep(5)
                print("not stopped")
        except KeyboardInterrupt:
            print("stopped", terminated)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == f"stopped [{int(__import__('signal').SIGTERM)}]"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
