"""A replay's timeline in the Trace Event Format (``xds replay --timeline``)."""

from __future__ import annotations

import gzip
import json

import msgspec
import numpy as np
import pytest

from test_recovery import CFG, WL  # a small 8-server deployment and 80 requests
from xds.cli.main import main
from xds.errors import ConfigError
from xds.serve.recovery import NodeFault
from xds.serve.replay import replay
from xds.serve.timeline import replay_marks, replay_timeline
from xds.trace import timeline
from xds.trace.metrics import RequestRecord
from xds.trace.timeline import Mark, Series, chrome_trace
from xds.units import MS, S


def _done(rid, arrival, *, queue, first, wait, kv, finish, out=10, te="P0", dte="D0"):
    return RequestRecord(
        rid, arrival, 1000, out, first_token_ns=first, finish_ns=finish, queue_ns=queue,
        decode_wait_ns=wait, kv_transfer_ns=kv, prefill_placement=f"{te}/DP0",
        decode_placement=f"{dte}/DP1" if out > 1 else "",
    )  # fmt: skip


RECORDS = [
    # arrival 0: queued 1 us, prefill to 10 us, admission wait 2 us, KV 3 us, decode to 40 us
    _done(0, 0, queue=1_000, first=10_000, wait=2_000, kv=3_000, finish=40_000),
    # one output token: prefill's token is the whole output
    _done(1, 5_000, queue=0, first=8_000, wait=0, kv=0, finish=8_000, out=1, te="P1"),
    # failed in the queue after 4 us (a restart): no placement
    RequestRecord(
        2, 6_000, 1000, 10, outcome="failed", reason="restart", finish_ns=10_000, queue_ns=4_000
    ),
    # over the context limit: failed at arrival, nothing else known
    RequestRecord(3, 9_000, 200_000, 10, outcome="failed", reason="too long"),
    # failed after its first token, before a Decode DP took it (a transfer failure)
    RequestRecord(
        5,
        50_000,
        1000,
        10,
        outcome="failed",
        reason="transfer",
        first_token_ns=52_000,
        finish_ns=56_000,
        prefill_placement="P1/DP2",
    ),
    # arrives after request 1 ended: takes its lane back
    _done(4, 20_000, queue=0, first=25_000, wait=0, kv=1_000, finish=30_000),
]


def _events(trace, ph=None, **match):
    return [
        e
        for e in trace["traceEvents"]
        if (ph is None or e["ph"] == ph) and all(e.get(k) == v for k, v in match.items())
    ]


def test_each_request_is_one_slice_split_into_its_phases():
    trace = chrome_trace(list(reversed(RECORDS)), title="t")  # any order
    assert trace["otherData"] == {"generator": "xds", "title": "t", "requests": 6}
    slices = {e["args"]["request"]: e for e in _events(trace, "X", cat="request")}
    assert sorted(slices) == [0, 1, 2, 3, 4, 5]
    r0 = slices[0]
    assert (r0["ts"], r0["dur"], r0["name"]) == (0.0, 40.0, "request 0")
    assert r0["args"] == {
        "request": 0, "input_tokens": 1000, "output_tokens": 10, "cached_tokens": 0,
        "outcome": "completed", "prefill": "P0/DP0", "decode": "D0/DP1", "ttft_ms": 0.01,
        "tpot_ms": round(30_000 / 9 / 1e6, 3),
    }  # fmt: skip
    phases = [(e["name"], e["ts"], e["dur"]) for e in _events(trace, "X", cat="phase", tid=1)]
    assert phases[:5] == [
        ("queued", 0.0, 1.0),
        ("prefill", 1.0, 9.0),
        ("decode admission", 10.0, 2.0),
        ("KV transfer", 12.0, 3.0),
        ("decode", 15.0, 25.0),
    ]
    # the single-token request: no queue, prefill only, and no decode phases or tpot
    tid1 = slices[1]["tid"]
    assert [e["name"] for e in _events(trace, "X", cat="phase", tid=tid1)][:1] == ["prefill"]
    assert "tpot_ms" not in slices[1]["args"] and slices[1]["dur"] == 3.0
    # failed in the queue: the slice ends where it failed, marked with the reason
    assert (slices[2]["name"], slices[2]["dur"]) == ("request 2 (failed)", 4.0)
    assert slices[2]["args"]["reason"] == "restart" and "ttft_ms" not in slices[2]["args"]
    (instant,) = _events(trace, "i", tid=slices[2]["tid"], ts=10.0)
    assert instant["args"] == {"reason": "restart"}
    # failed at arrival: a zero-length slice and the failed instant
    assert (slices[3]["ts"], slices[3]["dur"]) == (9.0, 0.0)
    assert _events(trace, "i", tid=slices[3]["tid"], ts=9.0, name="failed")
    # failed between its first token and decode: it waited for admission until then
    tail = [(e["name"], e["ts"], e["dur"]) for e in _events(trace, "X", cat="phase", tid=1)][5:]
    assert tail == [("prefill", 50.0, 2.0), ("decode admission", 52.0, 4.0)]
    assert slices[5]["dur"] == 6.0 and slices[5]["args"]["reason"] == "transfer"


def test_requests_share_lanes_lowest_free_first():
    trace = chrome_trace(RECORDS)
    lane = {e["args"]["request"]: e["tid"] for e in _events(trace, "X", cat="request")}
    # 0 holds lane 1 to 40 us; 1 (5-8 us) lane 2; 2 (6-10) lane 3; 3 (9) takes lane 2, free
    # since 8; 4 (20) takes lane 2 again: the lowest free
    # 5 (50 us) finds every lane free: lane 0 again
    assert lane == {0: 1, 1: 2, 2: 3, 3: 2, 4: 2, 5: 1}
    names = [e["args"]["name"] for e in _events(trace, "M", name="thread_name")]
    assert names == ["lane 0", "lane 1", "lane 2"]


def test_counters_follow_the_phases():
    trace = chrome_trace(RECORDS)
    p0 = [(e["ts"], e["args"]) for e in _events(trace, "C", name="P0")]
    assert p0 == [
        (0.0, {"queued": 1, "prefilling": 0}),
        (1.0, {"queued": 0, "prefilling": 1}),
        (10.0, {"queued": 0, "prefilling": 0}),
        (20.0, {"queued": 0, "prefilling": 1}),
        (25.0, {"queued": 0, "prefilling": 0}),
    ]
    d0 = [(e["ts"], tuple(e["args"].values())) for e in _events(trace, "C", name="D0")]
    # (awaiting admission, KV transfer, decoding)
    assert d0 == [
        (10.0, (1, 0, 0)),
        (12.0, (0, 1, 0)),
        (15.0, (0, 0, 1)),
        (25.0, (0, 1, 1)),
        (26.0, (0, 0, 2)),
        (30.0, (0, 0, 1)),
        (40.0, (0, 0, 0)),
    ]
    in_system = {e["ts"]: e["args"]["requests"] for e in _events(trace, "C", pid=1)}
    assert in_system == {
        0.0: 1, 5.0: 2, 6.0: 3, 8.0: 2, 10.0: 1, 20.0: 2, 30.0: 1, 40.0: 0, 50.0: 1, 56.0: 0
    }  # fmt: skip


def test_marks_are_spans_or_instants():
    marks = [Mark("failover P1", 2_000, 7_000, {"te": "P1"}), Mark("memory fault", 3_000)]
    trace = chrome_trace(RECORDS, marks=marks)
    (span,) = _events(trace, "X", cat="event")
    assert (span["name"], span["ts"], span["dur"], span["args"]) == (
        "failover P1",
        2.0,
        5.0,
        {"te": "P1"},
    )
    (instant,) = _events(trace, "i", cat="event")
    assert (instant["name"], instant["s"]) == ("memory fault", "g")
    assert not _events(chrome_trace(RECORDS), pid=4)  # no events track without marks
    # overlapping spans take lanes of their own (X events must nest on a thread)
    spans = [Mark("a", 0, 10_000), Mark("b", 5_000, 20_000), Mark("c", 12_000, 15_000)]
    lanes = {e["name"]: e["tid"] for e in _events(chrome_trace(RECORDS, marks=spans), "X", pid=4)}
    assert lanes == {"a": 1, "b": 2, "c": 1}


def test_a_replays_faults_are_on_its_timeline():
    fault = NodeFault(at_ns=3 * S, server=2)
    res = replay(WL, CFG, faults=[fault])
    (restart,) = res.restarts
    (mark,) = replay_marks(res)
    assert (mark.name, mark.start_ns, mark.end_ns) == (
        "restart the world",
        restart.started_ns,
        restart.prefill_up_ns,
    )
    # given the faults, the track also shows each one when it struck (before its detection)
    struck, again = replay_marks(res, [fault])
    assert again == mark and (struck.name, struck.start_ns) == ("node fault: server 2", 3 * S)
    assert struck.start_ns < restart.started_ns
    trace = replay_timeline(res, title="fault")
    slices = _events(trace, "X", cat="request")
    assert len(slices) == len(WL) == len({e["args"]["request"] for e in slices})
    failed = [e for e in slices if e["args"]["outcome"] == "failed"]
    assert failed and all(e["name"].endswith("(failed)") for e in failed)
    assert len(_events(trace, "i", name="failed")) == len(failed)
    # the Decode TE's iterations, on both sides of its restart, one log
    (log,) = res.decode_iterations_log
    assert log.te == "D0" and msgspec.json.decode(msgspec.json.encode(log), type=type(log)) == log
    start, took, seqs = (np.array(v) for v in (log.start_ns, log.time_ns, log.sequences))
    assert len(start) == res.decode_iterations and took.min() > 0 and seqs.min() > 0
    assert (np.diff(start) > 0).all() and ((start + took)[:-1] <= start[1:]).all()  # in turn
    assert start.min() < 3 * S and start.max() > restart.decode_up_ns
    assert took.mean() / 1e6 == pytest.approx(res.summary.decode.mean_iteration_ms)
    counters = _events(trace, "C", name="D0 iteration")
    assert len(counters) == len(start)
    assert counters[0]["args"] == {"ms": took[0] / 1e6, "sequences": seqs[0]}
    assert counters[0]["ts"] == start[0] / 1000
    # every request a Prefill TE had, failed ones too (queued or mid-step when the world
    # restarted), has its time in phases that tile its slice
    held = [e for e in slices if "prefill" in e["args"]]
    assert any(e["args"]["outcome"] == "failed" for e in held)
    assert len(held) == len(slices) - len(
        [r for r in res.records if r.reason.startswith("service unavailable")]
    )
    for e in held:
        if e["dur"]:
            parts = _events(trace, "X", cat="phase", tid=e["tid"])
            inside = [p for p in parts if e["ts"] <= p["ts"] < e["ts"] + e["dur"]]
            assert sum(p["dur"] for p in inside) == pytest.approx(e["dur"], abs=1e-3)


def test_series_are_counter_tracks():
    series = Series("D0 iteration", "decode", [1_000, 3_000], {"ms": [0.5, 0.75]})
    trace = chrome_trace(RECORDS, series=[series])
    assert [(e["pid"], e["ts"], e["args"]) for e in _events(trace, "C", name="D0 iteration")] == [
        (3, 1.0, {"ms": 0.5}),
        (3, 3.0, {"ms": 0.75}),
    ]
    with pytest.raises(ConfigError, match="one value per time"):
        chrome_trace(RECORDS, series=[Series("x", "decode", [1], {"ms": [1.0, 2.0]})])
    with pytest.raises(ConfigError, match="process must be one of"):
        chrome_trace(RECORDS, series=[Series("x", "gpu", [1], {"ms": [1.0]})])  # type: ignore[arg-type]


def test_bad_records_and_paths_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"records\[1\] is a dict") as err:
        chrome_trace([RECORDS[0], {"request_id": 1}])
    assert err.value.field == "records"
    with pytest.raises(ConfigError, match=r"written as \.json, \.json\.gz"):
        timeline.check_path(tmp_path / "t.txt")
    with pytest.raises(ConfigError, match="does not exist"):
        timeline.check_path(tmp_path / "no" / "t.json")
    (tmp_path / "d.json").mkdir()
    with pytest.raises(ConfigError, match="not a file"):
        timeline.check_path(tmp_path / "d.json")
    assert timeline.check_path(tmp_path / "T.JSON.GZ").name == "T.JSON.GZ"


def test_cli_writes_the_same_timeline_every_time(tmp_path, capsys):
    args = ["replay", "--synthetic", "12", "--rate", "4", "--timeline"]
    assert main([*args, str(tmp_path / "a.json.gz")]) == 0
    assert "timeline written to" in capsys.readouterr().out
    assert main([*args, str(tmp_path / "b.json.gz"), "--json"]) == 0
    assert (tmp_path / "a.json.gz").read_bytes() == (tmp_path / "b.json.gz").read_bytes()
    trace = json.loads(gzip.decompress((tmp_path / "a.json.gz").read_bytes()))
    assert len(_events(trace, "X", cat="request")) == 12
    assert main([*args, str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_bytes()) == trace
    # a bad path is refused before the replay runs, in one line
    capsys.readouterr()
    assert main([*args, str(tmp_path / "t.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xds: error: --timeline") and "\n" not in err
    assert "written as .json, .json.gz" in err


def test_a_timeline_is_written_after_the_results(tmp_path, capsys, monkeypatch):
    def fail(trace, path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(timeline, "save", fail)
    assert main(["replay", "--synthetic", "6", "--timeline", str(tmp_path / "t.json")]) == 2
    out = capsys.readouterr()
    assert "TTFT" in out.out and "Permission denied" in out.err


def test_timestamps_are_microseconds_of_virtual_time():
    r = _done(0, 1_500 * MS, queue=0, first=1_600 * MS, wait=0, kv=0, finish=1_700 * MS)
    (s,) = _events(chrome_trace([r]), "X", cat="request")
    assert (s["ts"], s["dur"]) == (1_500_000.0, 200_000.0)


def test_a_timeline_may_go_into_the_out_directory_but_not_over_its_results(tmp_path, capsys):
    out = tmp_path / "res"  # created by the run
    args = ["replay", "--synthetic", "6", "--out", str(out), "--timeline"]
    assert main([*args, str(out / "t.json.gz")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["requests.jsonl", "summary.json", "t.json.gz"]
    capsys.readouterr()
    assert main([*args, str(out / "summary.json")]) == 2
    assert "--out writes summary.json there" in capsys.readouterr().err
    assert main([*args, str(tmp_path / "x" / ".." / "res" / "summary.json")]) == 2  # same dir
    assert main([*args, str(tmp_path / "new" / "t.json")]) == 2  # a folder nothing creates


def test_a_request_failing_with_its_kv_in_transfer_shows_the_transfer():
    from xds.serve.replay import DistFlowFault

    # P0's link stalls from 2 s, so its transfers are still on the wire when the world
    # restarts after a fault at 3 s
    stall = DistFlowFault(at_ns=2 * S, prefill_te=0, kind="link_down", duration_ns=3 * S)
    res = replay(WL, CFG, faults=[stall, NodeFault(at_ns=3 * S, server=2)])
    stuck = [
        r
        for r in res.records
        if r.outcome == "failed" and r.first_token_ns >= 0 and not r.decode_placement
    ]
    assert stuck and all(r.kv_transfer_ns > 0 for r in stuck)
    trace = chrome_trace(res.records)
    for r in stuck:
        (s,) = [
            e for e in _events(trace, "X", cat="request") if e["args"]["request"] == r.request_id
        ]
        phases = [
            (p["name"], p["ts"] + p["dur"])
            for p in _events(trace, "X", cat="phase", tid=s["tid"])
            if s["ts"] <= p["ts"] < s["ts"] + s["dur"]
        ]
        assert phases[-1] == ("KV transfer", pytest.approx(r.finish_ns / 1000))
