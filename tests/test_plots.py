"""Figures of a replay and of a capacity search (``xds.plots``, ``--plot``)."""

from __future__ import annotations

import numpy as np
import pytest

from xds.cli.main import main
from xds.errors import ConfigError
from xds.serve.capacity import CapacityPoint, CapacityResult
from xds.trace.metrics import SLA, RequestRecord
from xds.units import MS, S

pytest.importorskip("matplotlib")
from xds import plots

# arrival, first token, finish (ns); the third request failed in prefill at 2.5 s
RECORDS = [
    RequestRecord(0, 0, 100, 11, first_token_ns=1 * S, finish_ns=1 * S + 10 * 20 * MS),
    RequestRecord(1, 1 * S, 100, 6, first_token_ns=4 * S, finish_ns=4 * S + 5 * 50 * MS),
    RequestRecord(2, 2 * S, 100, 6, outcome="failed", reason="x", finish_ns=2 * S + S // 2),
    RequestRecord(3, 3 * S, 100, 1, first_token_ns=3 * S + S // 2, finish_ns=3 * S + S // 2),
]


def test_in_system_counts_prefill_and_decode_over_time():
    t, prefill, decode = plots.in_system(RECORDS)
    # 0: r0 arrives; 1: r0 decodes, r1 arrives; 1.2: r0 ends; 2: r2 arrives; 2.5: r2 fails;
    # 3: r3 arrives; 3.5: r3's only token (prefill to decode and out at once); 4: r1 decodes
    assert t.tolist() == [0.0, 1.0, 1.2, 2.0, 2.5, 3.0, 3.5, 4.0, 4.25]
    assert prefill.tolist() == [1, 1, 1, 2, 1, 2, 1, 0, 0]
    assert decode.tolist() == [0, 1, 0, 0, 0, 0, 0, 1, 0]


def test_replay_figure_draws_the_records_against_the_sla():
    fig = plots.replay_figure(RECORDS, sla=SLA(ttft_ms=2_000, tpot_ms=30), title="tiny")
    (ttft, tpot), (over, load) = np.asarray(fig.axes).reshape(2, 2)
    x, y = ttft.lines[0].get_data()
    assert x.tolist() == [0.5, 0.5, 1.0, 3.0]  # rising from 0 at the smallest
    assert y.tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1.0])
    # shares of all four requests, the failed one over the SLA (as goodput counts it)
    assert ttft.get_legend().get_texts()[0].get_text() == "SLA 2 s: 50.0% of the 4 requests under"
    x, _ = tpot.lines[0].get_data()
    assert x.tolist() == pytest.approx([20.0, 20.0, 50.0])  # the one-token request has no TPOT...
    label = tpot.get_legend().get_texts()[0].get_text()
    assert label == "SLA 30 ms: 50.0% of the 4 requests under"  # ...and none to miss
    labels = [t.get_text() for t in over.get_legend().get_texts()]
    assert "failed (1; drawn at the top)" in labels
    # at its arrival, above every TTFT (3 s) and the SLA (2 s)
    assert over.collections[1].get_offsets().tolist() == [[2.0, pytest.approx(3.3)]]
    assert max(load.lines[0].get_ydata()) == 2 and max(load.lines[1].get_ydata()) == 1
    assert fig.get_suptitle() == "tiny"


def _point(scale: float, tpot: float, ttft: float, misses: tuple[str, ...] = ()):
    return CapacityPoint(scale, scale, 100, 50, 0, tpot, ttft, 1.0, 1.0, 0.0, 0.5, misses)


def test_capacity_figure_marks_the_rates_that_missed_and_the_rate_found():
    points = (_point(2, 20, 300), _point(4, 25, 800), _point(8, 40, 9_000, ("mean TPOT",)))
    res = CapacityResult(points[1], points, False, "mean TPOT", "mean", SLA(), 0.9)
    fig = plots.capacity_figure({"a": res, "b": res}, knob="rate scale")
    tpot, ttft, goodput = fig.axes
    assert tpot.get_xlabel() == "rate scale" and ttft.get_yscale() == "log"
    met, missed, star = tpot.collections[:3]
    assert met.get_offsets().tolist() == [[2, 20], [4, 25]]
    assert missed.get_offsets().tolist() == [[8, 40]]
    assert star.get_offsets().tolist() == [[4, 25]]
    labels = [t.get_text() for t in tpot.get_legend().get_texts()]
    assert labels == ["a", "b", "SLA 35 ms"]  # one SLA line for searches sharing it
    assert [t.get_text() for t in goodput.get_legend().get_texts()] == ["a", "b"]  # no target


def test_a_goodput_search_draws_its_target_not_bounds_on_the_means():
    points = (_point(2, 20, 300), _point(4, 25, 800, ("goodput 80% < 90%",)))
    res = CapacityResult(points[0], points, False, "goodput", "goodput", SLA(), 0.9)
    tpot, ttft, goodput = plots.capacity_figure(res).axes
    assert tpot.get_legend() is None and ttft.get_legend() is None  # nothing judged there
    assert [t.get_text() for t in goodput.get_legend().get_texts()] == ["target 90%"]


def test_a_search_where_nothing_completed_still_draws():
    nothing = _point(1, float("nan"), float("nan"), ("no request completed",))
    res = CapacityResult(None, (nothing,), False, "", "mean", SLA(float("inf"), float("inf")), 0.9)
    fig = plots.capacity_figure(res)
    assert fig.axes[1].get_yscale() == "linear"  # no positive TTFT to put on a log axis
    fig = plots.replay_figure([RECORDS[2]])  # one request, failed
    assert "no completed request" in [t.get_text() for t in fig.axes[0].texts]


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_a_saved_figure_is_the_same_bytes_every_time(tmp_path, suffix):
    a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    plots.save(plots.replay_figure(RECORDS), a)
    plots.save(plots.replay_figure(RECORDS), b)
    assert a.read_bytes() == b.read_bytes()
    magic = {".png": b"\x89PNG", ".svg": b"<?xml", ".pdf": b"%PDF"}[suffix]
    assert a.read_bytes().startswith(magic)


def test_a_plot_path_is_checked_before_anything_runs(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"written as \.png, \.svg, \.pdf") as err:
        plots.check_path(tmp_path / "out.jpg")
    assert err.value.field == "plot"
    with pytest.raises(ConfigError, match="does not exist"):
        plots.check_path(tmp_path / "missing" / "out.png")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ConfigError, match="exists and is not a file"):
        plots.check_path(tmp_path / "dir.png")
    with pytest.raises(ConfigError, match="cannot write in /proc"):
        plots.check_path("/proc/xds.png")
    assert plots.check_path(tmp_path / "OUT.PNG").name == "OUT.PNG"
    assert [f.name for f in tmp_path.iterdir()] == ["dir.png"]  # the write probe is gone
    assert main(["replay", "--synthetic", "5", "--plot", str(tmp_path / "out.txt")]) == 2
    assert main(["capacity", "--plot", str(tmp_path / "no" / "c.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("xds: error: --plot ") for line in err)


def test_cli_replay_and_capacity_draw_their_results(tmp_path, capsys):
    toml = tmp_path / "small.toml"
    toml.write_text(
        "[prefill]\ntes = 2\nlong_pool_tes = 0\n"
        "[decode]\ndies = 32\nbatch_per_die = 4\nshared_expert_dies = 4\n"
    )
    png = tmp_path / "replay.png"
    argv = ["replay", "--deployment", str(toml), "--synthetic", "20", "--rate", "4"]
    assert main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "plotted to" in capsys.readouterr().out
    svg = tmp_path / "capacity.svg"
    argv = ["capacity", "--deployment", str(toml), "--window", "5", "--start", "8"]
    assert main([*argv, "--bisections", "0", "--json", "--plot", str(svg)]) == 0
    assert b"rate (req/s)" in svg.read_bytes()  # text stays text in an SVG


def test_decode_figure_shows_each_kernel_per_iteration_and_every_iteration():
    from xds.serve.decode import DecodeResult
    from xds.serve.decode_model import Breakdown

    bd = Breakdown(attention=6 * MS, combine=3 * MS, experts=3 * MS)  # over 3 iterations
    res = DecodeResult(3, 14 * MS, 100, 10, 4.7e6, 1.9, bd, 1.5, [4 * MS, 5 * MS, 5 * MS])
    kernels, over = plots.decode_figure(res, title="tiny").axes
    widths = {
        t.get_text(): b.get_width()
        for t, b in zip(kernels.get_yticklabels(), kernels.patches, strict=True)
    }
    assert widths["attention"] == 2.0 and widths["combine"] == widths["experts"] == 1.0
    assert widths["gating"] == 0.0 and len(widths) == len(Breakdown.__struct_fields__)
    assert " 2.00 ms (50%)" in [t.get_text() for t in kernels.texts]
    assert over.lines[0].get_ydata().tolist() == [4.0, 5.0, 5.0]


def test_cli_decode_draws_its_run(tmp_path, capsys):
    dep = tmp_path / "dep.toml"
    dep.write_text(
        "dies = 32\nbatch_per_die = 2\ninput_tokens = 256\noutput_tokens = 4\n"
        "shared_expert_dies = 0\n"
    )
    pdf = tmp_path / "decode.pdf"
    assert main(["decode", "--deployment", str(dep), "--plot", str(pdf)]) == 0
    assert pdf.read_bytes().startswith(b"%PDF") and "plotted to" in capsys.readouterr().out
    assert main(["decode", "--plot", str(tmp_path / "x.gif")]) == 2  # before the run


def test_a_failure_is_drawn_above_the_sla_and_a_lone_request_shows():
    fast = RequestRecord(0, 0, 100, 3, first_token_ns=30 * MS, finish_ns=70 * MS)
    failed = RequestRecord(1, S, 200_000, 3, outcome="failed", reason="too long")
    fig = plots.replay_figure([fast, failed], sla=SLA(ttft_ms=2_000, tpot_ms=35))
    (ttft, _), (over, _) = np.asarray(fig.axes).reshape(2, 2)
    ((_, y),) = over.collections[1].get_offsets().tolist()
    assert y > 2.0  # above the 2 s SLA line, not at the fast request's 0.03 s
    x, share = ttft.lines[0].get_data()  # one completed request: a visible rise to 1
    assert x.tolist() == [0.03, 0.03] and share.tolist() == [0.0, 1.0]
