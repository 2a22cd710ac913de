"""ServeGen client pools (xds.trace.servegen): sampling, determinism, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds.cli.main import main
from xds.errors import TraceError
from xds.trace import load, load_servegen

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "servegen_deepseek_r1"


def pool(tmp_path: Path, rows: dict[int, list[str]], lengths: dict | None = None) -> Path:
    """A ServeGen directory: per client its trace rows and one length distribution."""
    lengths = lengths or {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{20: 1.0}"}
    for client, lines in rows.items():
        (tmp_path / f"chunk-{client}-trace.csv").write_text("\n".join(lines) + "\n")
        (tmp_path / f"chunk-{client}-dataset.json").write_text(
            json.dumps({"0": lengths, "21600": {"input_tokens": "{}", "output_tokens": "{}"}})
        )
    return tmp_path


IDLE = "600,0,0,,0,0"


def test_rates_families_and_lengths_come_out_as_described(tmp_path):
    d = pool(
        tmp_path,
        {
            0: ["0,2.0,1.0,Gamma,1.0,5.0", IDLE],  # Poisson-like: cv 1
            1: ["0,1.0,3.0,Weibull,0.5,2.0", "600,4.0,0.5,Gamma,4.0,0.1"],
        },
    )
    w = load_servegen(d, start_s=0, duration_s=1200, seed=3)
    a = np.array([r.arrival_ns for r in w.requests]) / 1e9
    assert np.all(np.diff(a) >= 0) and a.min() >= 0 and a.max() < 1200
    first, second = (a < 600).sum(), (a >= 600).sum()
    assert 3 * 600 * 0.8 < first < 3 * 600 * 1.2  # clients 0 and 1: 2 + 1 req/s
    assert 4 * 600 * 0.8 < second < 4 * 600 * 1.2  # client 1 alone: 4 req/s
    assert {r.input_tokens for r in w.requests} == {100, 300}
    assert {r.output_tokens for r in w.requests} == {20}
    again = load_servegen(d, start_s=0, duration_s=1200, seed=3)
    assert again == w  # deterministic
    assert load_servegen(d, start_s=0, duration_s=1200, seed=4) != w
    only = load_servegen(d, start_s=0, duration_s=1200, seed=3, clients=[1])
    assert 0 < len(only) < len(w)  # a client's requests do not depend on the others
    assert load(d, start_s=600, duration_s=600).requests[0].arrival_ns >= 0  # a directory


@pytest.mark.parametrize(
    ("rows", "lengths", "says"),
    [
        (["0,1,1,Gamma,1,1", "600,1,1"], None, r"chunk-0-trace\.csv:line 2: expected 6 fields"),
        (["0,1,1,Pareto,1,1"], None, "line 1 field 'family'"),
        (["0,x,1,Gamma,1,1"], None, "line 1 field 'rate': not a number"),
        (["0,1_0,1,Gamma,1,1"], None, "line 1 field 'rate': not a number: '1_0'"),
        (["0,1,1,Gamma,0,1"], None, "line 1: an active window needs"),
        (["0,1,1,Gamma,1,1"], {"input_tokens": "{1: }", "output_tokens": "{2: 1}"}, "0.input"),
    ],
)
def test_malformed_pools_name_file_line_and_field(tmp_path, rows, lengths, says):
    d = pool(tmp_path, {0: rows}, lengths)
    with pytest.raises(TraceError, match=says):
        load_servegen(d)


def test_spans_clients_and_missing_files_are_clear_errors(tmp_path):
    d = pool(tmp_path, {0: ["0,1,1,Gamma,1,1"]})
    with pytest.raises(TraceError, match="within the day"):
        load_servegen(d, start_s=86_000, duration_s=600)
    with pytest.raises(TraceError, match=r"no trace files for clients \[7\]"):
        load_servegen(d, clients=[7])
    with pytest.raises(TraceError, match="no requests"):
        load_servegen(d, start_s=600, duration_s=600)
    (d / "chunk-0-dataset.json").unlink()
    with pytest.raises(TraceError, match=r"chunk-0-dataset\.json: file not found"):
        load_servegen(d)
    (tmp_path / "latin1").mkdir()
    bad = pool(tmp_path / "latin1", {0: ["0,1,1,Gamma,1,1", "600,1,1,Gamma,1,1"]})
    trace = bad / "chunk-0-trace.csv"
    trace.write_bytes(trace.read_bytes().replace(b"600,", b"6\xe900,"))
    with pytest.raises(TraceError, match=r"chunk-0-trace\.csv:line 2: not UTF-8 text"):
        load_servegen(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=r"no chunk-<i>-trace\.csv"):
        load_servegen(empty)


def test_cli_replays_a_pool_over_a_span(tmp_path, capsys):
    d = pool(tmp_path, {0: ["0,0.5,1.0,Gamma,1.0,1.0", IDLE]})
    assert main(["replay", str(d), "--span", "0,60", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] > 5 and summary["failed"] == 0
    assert main(["replay", str(d), "--span", "zero"]) == 2
    assert "--span takes START,SECONDS" in capsys.readouterr().err
    trace = tmp_path / "r.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,2\n")
    assert main(["replay", str(trace), "--span", "0,60"]) == 2
    assert "--span applies to a ServeGen directory" in capsys.readouterr().err


@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")
def test_the_deepseek_r1_pool_gives_its_summed_rate():
    w = load_servegen(DATA, start_s=1200, duration_s=1200, seed=0)
    summed = sum(  # the clients' mean rates in the two windows, summed
        float(line.split(",")[1])
        for f in DATA.glob("chunk-*-trace.csv")
        for line in f.read_text().splitlines()
        if line.split(",")[0] in ("1200", "1800")
    )
    assert 0.85 * summed / 2 < len(w) / 1200 < 1.15 * summed / 2
    x = np.array([r.input_tokens for r in w.requests])
    assert 20 < np.median(x) < 1_000 and x.max() <= 65_536


def test_sampled_requests_have_no_trace_line_and_lengths_within_the_bound(tmp_path):
    d = pool(tmp_path, {0: ["0,1,1,Gamma,1,1"]})
    w = load_servegen(d, duration_s=60)
    assert w.requests and all(r.source_line == 0 for r in w.requests)
    (tmp_path / "h").mkdir()
    lengths = {"input_tokens": "{1e30: 1}", "output_tokens": "{2: 1}"}
    huge = pool(tmp_path / "h", {0: ["0,1,1,Gamma,1,1"]}, lengths)
    says = r"dataset\.json field '0\.input_tokens': lengths are whole token counts in 1\.\."
    with pytest.raises(TraceError, match=says):
        load_servegen(huge)


@pytest.mark.parametrize(
    ("lengths", "says"),
    [
        (
            {"input_tokens": "{1: 0.5}", "output_tokens": "{3: 1.0}"},
            "probabilities sum to 0.5, not 1",
        ),
        ({"input_tokens": "{1: 1}", "output_tokens": "{-3: 1.0}"}, "got -3"),
        ({"input_tokens": "{1.5: 1}", "output_tokens": "{3: 1.0}"}, "got 1.5"),
        ({"input_tokens": "{0: 1}", "output_tokens": "{3: 1.0}"}, "got 0"),
        ({"input_tokens": "{1e999: 0.5, 10: 0.5}", "output_tokens": "{3: 1.0}"}, "got inf"),
        ({"input_tokens": "{True: 1.0}", "output_tokens": "{3: 1.0}"}, "length: probability"),
        ({"input_tokens": "{4: True}", "output_tokens": "{3: 1.0}"}, "length: probability"),
        ({"input_tokens": "{1%s: 1.0}" % ("0" * 400), "output_tokens": "{3: 1}"}, "token counts"),
        ({"input_tokens": "{4: 1%s}" % ("0" * 400), "output_tokens": "{3: 1}"}, "in 0..1"),
    ],
)
def test_a_length_table_that_is_not_a_distribution_of_token_counts_is_refused(
    tmp_path, lengths, says
):
    bad = pool(tmp_path, {0: ["0,1,1,Gamma,1,1"]}, lengths)
    with pytest.raises(TraceError, match=says):
        load_servegen(bad)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ("0,0.5,1,Gamma,1e-9,1", "its gaps do not move time on"),
        ("0,0.5,1,Gamma,1e308,10", "has no finite, positive mean gap"),
        ("0,0.5,1,Weibull,0.001,1", "has no finite, positive mean gap"),
    ],
)
def test_a_fit_whose_gaps_do_not_move_time_on_is_refused_naming_its_row(tmp_path, row, says):
    bad = pool(tmp_path, {0: ["0,0,1,,0,0", row.replace("0,", "600,", 1)]})
    with pytest.raises(TraceError, match=rf"trace\.csv:line 2 field 'shape': .*{says}"):
        load_servegen(bad, start_s=0, duration_s=1200)


def test_trace_rows_are_one_per_window_in_order(tmp_path):
    twice = pool(tmp_path, {0: ["0,1,1,Gamma,1,1", "0,1,1,Gamma,1,1"]})
    with pytest.raises(TraceError, match=r"line 2 field 'start': window 0 s is not after"):
        load_servegen(twice)
    (tmp_path / "m").mkdir()
    off = pool(tmp_path / "m", {0: ["5,1,1,Gamma,1,1"]})
    with pytest.raises(TraceError, match=r"line 1 field 'start': .*multiple of 600 s, got 5"):
        load_servegen(off)


@settings(max_examples=50, deadline=None)
@given(
    probs=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40).filter(lambda p: sum(p) > 0),
    seed=st.integers(0, 2**32 - 1),
)
def test_length_draws_are_those_of_generator_choice(probs, seed):
    """The loader searches each window's CDF itself (it draws tens of thousands of lengths);
    the lengths are the ones ``Generator.choice(values, p=probs)`` would draw."""
    from xds.trace.servegen import _cdf

    p = np.array(probs) / sum(probs)
    values = np.arange(1, len(p) + 1) * 7
    mine, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
    cdf = _cdf(p)
    for _ in range(20):
        assert values[cdf.searchsorted(mine.random(), side="right")] == theirs.choice(values, p=p)
