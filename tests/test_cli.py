"""The xds command line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from xds import __version__
from xds.cli.main import main
from xds.errors import ConfigError
from xds.trace.workload import gamma_arrivals


def test_version(capsys):
    assert main(["version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_info_prints_the_pod(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "768 dies" in out and "36,864" in out and "UB link" in out


def test_info_sources_keeps_bracketed_grades(capsys):
    assert main(["info", "--sources", "--servers", "2"]) == 0
    out = capsys.readouterr().out
    assert "[emulator choice]" in out and "CANN" in out


def test_demo_runs_in_virtual_time(capsys):
    assert main(["demo", "--servers", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "32 die tasks x 3 steps" in out and "virtual time" in out


def test_bad_arguments_give_one_line_and_exit_2(capsys):
    for argv in (
        ["bogus"],
        ["info", "--servers", "0"],
        ["demo", "--backend", "uv"],
        ["info", "--nope"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("xds: error: ") and err.count("\n") == 1, err


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "xds.cli.main", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in out.stdout and "info" in out.stdout


def test_options_that_would_be_ignored_are_usage_errors(tmp_path, capsys):
    trace = tmp_path / "r.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,2\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, says in (
        (["replay", "--synthetic", "2", "--csv"], "--csv"),
        (["replay", "--synthetic", "2", "--out", str(afile)], "not a directory"),
        (["replay", "--synthetic", "2", "--out", str(afile / "sub")], "--out"),
        (["replay", str(trace), "--synthetic", "5"], "--synthetic applies"),
        (["replay", str(trace), "--rate", "3"], "--rate applies"),
        (["replay", "--format", "azure"], "--format applies to a TRACE"),
        (["replay", "--sort"], "--sort applies to a TRACE"),
        (["replay", str(trace), "--cv", "2"], "--cv applies to --format lengths"),
        (["replay", str(trace), "--columns", "a,b"], "--columns applies"),
        (["capacity", "--sort"], "--sort applies to a TRACE"),
        (["info", "--servers", "49"], "--servers"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("xds: error:") and says in err[0], (argv, err)


def test_sort_lets_a_trace_with_timestamps_out_of_order_replay(tmp_path, capsys):
    trace = tmp_path / "b.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n1,10,2\n0,10,2\n")
    assert main(["replay", str(trace), "--json"]) == 2
    assert "--sort" in capsys.readouterr().err
    assert main(["replay", str(trace), "--sort", "--json"]) == 0
    assert '"completed":2' in capsys.readouterr().out


def test_deployment_errors_name_the_file_and_the_field_written(tmp_path, capsys):
    for text, says in (
        ("[decode]\ndies = 4\nshared_expert_dies = 0\n", "decode.dies: with 4 dies"),
        ("[decode]\ndies = 2000\nshared_expert_dies = 0\n", "decode.dies: 2000 dies"),
        ("[decode.mtp]\nk = -1\n", "decode.mtp.k:"),
        ("[decode.mtp]\nk = 1000\n", "decode.mtp.k: k must be in 0..8, got 1000"),
        ("[sla]\nttft_ms = -1\n", "sla.ttft_ms:"),
    ):
        dep = tmp_path / "dep.toml"
        dep.write_text(text)
        assert main(["replay", "--synthetic", "2", "--deployment", str(dep)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "dep.toml: " + says in err[0], (text, err)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"[decode]\n\xff = 1\n")
    assert main(["replay", "--synthetic", "2", "--deployment", str(binary)]) == 2
    assert "bin.toml: line 2: not UTF-8" in capsys.readouterr().err


def test_import_registers_a_policy_a_deployment_file_names(tmp_path, monkeypatch, capsys):
    from xds.serve.eplb import policy_names, unregister_policy

    (tmp_path / "mypolicies.py").write_text(
        "from xds.serve.eplb import policy, register_policy\n"
        "register_policy('cli-greedy', lambda c, lay, b: policy('xds-greedy').plan(c, lay, b))\n"
    )
    (tmp_path / "dep.toml").write_text(
        "dies = 256\nbatch_per_die = 1\ninput_tokens = 256\noutput_tokens = 4\n"
        "shared_expert_dies = 0\n[eplb]\npolicy = 'cli-greedy'\n"
    )
    (tmp_path / "broken.py").write_text("x = 1\nraise ValueError('oops')\n")
    monkeypatch.chdir(tmp_path)
    try:
        args = ["--import", "mypolicies", "decode", "--deployment", "dep.toml", "--json"]
        capsys.readouterr()
        assert main(args) == 0
        assert "cli-greedy" in policy_names()
        res = json.loads(capsys.readouterr().out)
        assert res["tpot_ms"] == res["mean_iteration_ns"] / 1e6 / res["mean_tokens_per_step"]
        assert res["tokens_per_s_per_chip"] == res["tokens_per_s"] / 128  # 256 dies
    finally:
        unregister_policy("cli-greedy")
    capsys.readouterr()
    assert main(["--import", "broken.py", "version"]) == 2
    assert capsys.readouterr().err.strip() == (
        "xds: error: --import broken.py: ValueError: oops (broken.py, line 2)"
    )
    assert main(["--import", "missing.py", "version"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["version", "--import", "mypolicies"]) == 2
    assert capsys.readouterr().err == (
        "xds: error: --import goes before the command: xds --import MODULE replay ...\n"
    )
    # a file named like a standard module never replaces it, and the current directory
    # leaves the import path again
    import random
    import sys

    (tmp_path / "random.py").write_text("LOADED = True\n")
    assert main(["--import", "random.py", "version"]) == 0
    assert sys.modules["random"] is random and sys.modules["_xds_import_random"].LOADED
    assert str(tmp_path) not in sys.path


def test_a_module_named_by_path_and_by_name_is_imported_once(tmp_path, monkeypatch, capsys):
    """The README's pattern: one file registers an EPLB policy and holds a routing policy;
    --import and --policy may name it as a path or a module, in any order."""
    from xds.serve.eplb import policy_names, unregister_policy

    (tmp_path / "regonce.py").write_text(
        "from xds.serve.eplb import policy, register_policy\n"
        "register_policy('once-greedy', policy('xds-greedy'))\n"
        "def fewest(eligible, dps, reserve):\n    return eligible[0]\n"
    )
    monkeypatch.chdir(tmp_path)
    run = ["replay", "--synthetic", "2", "--json"]
    try:
        for first, second in (("regonce.py", "regonce.py"), ("regonce.py", "regonce")):
            args = ["--import", first, *run, "--policy", f"decode_routing={second}:fewest"]
            assert main(args) == 0, capsys.readouterr().err
            assert "once-greedy" in policy_names()
        capsys.readouterr()
    finally:
        unregister_policy("once-greedy")
    (tmp_path / "regtwice.py").write_text(
        "from xds.serve.eplb import policy, register_policy\n"
        "register_policy('twice-greedy', policy('xds-greedy'))\n"
    )
    try:
        assert main(["--import", "regtwice", "--import", "regtwice.py", "version"]) == 0
    finally:
        unregister_policy("twice-greedy")


def test_policy_plugs_your_function_into_replay_and_capacity(tmp_path, monkeypatch, capsys):
    import json

    (tmp_path / "mine.py").write_text(
        "def first(eligible, dps, reserve):\n    return eligible[0]\n"
        "def two(eligible, dps):\n    return eligible[0]\n"
    )
    (tmp_path / "small.toml").write_text(
        "[prefill]\ntes = 2\nlong_pool_tes = 0\n"
        "[decode]\ndies = 32\nbatch_per_die = 4\nshared_expert_dies = 4\n"
    )
    monkeypatch.chdir(tmp_path)
    replay = ["replay", "--deployment", "small.toml", "--synthetic", "30", "--rate", "4", "--json"]
    assert main(replay) == 0
    base = json.loads(capsys.readouterr().out)
    assert main([*replay, "--policy", "decode_routing=mine:first"]) == 0
    piled = json.loads(capsys.readouterr().out)  # every request on DP 0 until it is full
    assert piled["tpot_ms"]["mean"] > base["tpot_ms"]["mean"]
    assert (base["policies"], piled["policies"]) == ([], ["decode_routing=mine:first"])
    assert main([*replay, "--policy", "decode_routing=mine.py:first"]) == 0
    as_file = json.loads(capsys.readouterr().out)  # a file works like a module
    assert as_file.pop("policies") == ["decode_routing=mine.py:first"]
    assert as_file == {k: v for k, v in piled.items() if k != "policies"}
    cap = ["capacity", "--deployment", "small.toml", "--window", "5", "--start", "8"]
    assert main([*cap, "--bisections", "0", "--json", "--policy", "decode_routing=mine:first"]) == 0
    assert json.loads(capsys.readouterr().out)["found"] is not None
    for spec, says in (
        ("decode_routing=mine:nope", "--policy decode_routing=mine:nope: mine has no 'nope'"),
        ("routing=mine:first", "unknown slot 'routing'; one of decode_routing, "),
        ("decode_routing", "write SLOT=MODULE:FUNCTION"),
        (
            "decode_routing=gone:first",
            "--policy decode_routing=gone:first: no module named 'gone'",
        ),
        ("decode_routing=mine:two", "decode_routing policy 'two'(eligible, dps) must take 3"),
    ):
        assert main([*replay, "--policy", spec]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_policy_that_raises_is_reported_briefly_at_its_own_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "buggy.py").write_text(
        "def helper(n):\n    return 1 // n\n"
        "def route(eligible, dps, reserve):\n    return helper(0)\n"
    )
    monkeypatch.chdir(tmp_path)
    code = main(["replay", "--synthetic", "3", "--json", "--policy", "decode_routing=buggy:route"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "xds: error: ZeroDivisionError: integer division or modulo by zero"
    assert err[1] == "(raised by the decode_routing policy 'route' for request 0)"
    assert err[2:] == [  # the user's frames only: none of xds's, anyio's or click's
        f"  {tmp_path / 'buggy.py'}, line 4, in route: return helper(0)",
        f"  {tmp_path / 'buggy.py'}, line 2, in helper: return 1 // n",
    ]
    # a next() over nothing raises StopIteration, which a coroutine would turn into a bare
    # "coroutine raised StopIteration" without the note: it is reported the same way
    (tmp_path / "stop.py").write_text(
        "def route(eligible, dps, reserve):\n    return next(i for i in eligible if i < 0)\n"
    )
    code = main(["replay", "--synthetic", "3", "--json", "--policy", "decode_routing=stop:route"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("xds: error: RuntimeError: StopIteration escaped the policy")
    assert err[1] == "(raised by the decode_routing policy 'route' for request 0)"
    assert err[2:] == [
        f"  {tmp_path / 'stop.py'}, line 2, in route: return next(i for i in eligible if i < 0)"
    ]


def test_ma_decode_runs_a_deployment_file_to_the_end(tmp_path, capsys):
    import json

    dep = tmp_path / "ma.toml"
    dep.write_text(
        "domains = 2\nattention_dies_per_domain = 4\nexpert_dies = 16\nshared_expert_dies = 0\n"
        "batch_per_die = 4\ninput_tokens = 128\noutput_tokens = 5\ndomain_turns = 'relaxed'\n"
    )
    assert main(["ma-decode", "--deployment", str(dep), "--full", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert sum(sum(d["tokens"]) for d in res["domains"]) == 2 * 4 * 4 * (5 - 1)
    assert set(res["stream_busy"]) == {"a2e", "moe", "e2a"}
    # the headline figures the table prints are in the JSON too
    assert res["tpot_ns"] == res["mean_iteration_ns"] / res["mean_tokens_per_step"]
    assert res["tokens_per_s_per_chip"] > 0
    dep.write_text("microbatches = 0\n")
    assert main(["ma-decode", "--deployment", str(dep)]) == 2
    assert "microbatches" in capsys.readouterr().err


def test_faults_injects_and_reports_recovery(capsys, tmp_path):
    argv = ["faults", "--fault", "network_error:dp=2,iteration=4,layer=1"]
    argv += ["--fault", "memory_fault:dp=1,iteration=6,first_block=3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "31 of 32" in out and "LINK_FLAP" in out and "ran to completion" in out
    assert "failed x1: KV lost to an on-chip memory fault (blocks 3..3)" in out
    cfg = tmp_path / "group.toml"
    cfg.write_text(
        "dps = 4\nbatch_per_dp = 2\n[heartbeat]\ndp_period_ns = 40_000_000\n"
        "timeout_ns = 60_000_000\ncontrol_period_ns = 100_000_000\n"
        '[[faults]]\nkind = "executor_crash"\ndp = 3\niteration = 2\n'
    )
    assert main(["faults", "--config", str(cfg), "--on-unhealthy", "scale_down", "--json"]) == 0
    import json

    res = json.loads(capsys.readouterr().out)
    assert res["scale_downs"][0]["removed"] == [3] and not res["stopped"]
    assert sum(o["state"] == "completed" for o in res["outcomes"]) == 6
    assert res["unfired"] == []
    # a fault on a DP a scale-down removed never strikes: the table and the JSON say so
    late = "network_error:dp=3,iteration=5,layer=0"
    argv = ["faults", "--config", str(cfg), "--on-unhealthy", "scale_down", "--fault", late]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"faults that never struck │ {late}" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unfired"] == [1]


def test_faults_rejects_bad_fault_specs_in_one_line(capsys):
    for spec, expected in (
        ("bogus:dp=1", "unknown fault kind 'bogus'"),
        ("network_error:dp=x,iteration=1", "dp must be a whole number, got 'x'"),
        ("network_error:dp=9,iteration=1", "--fault network_error:dp=9,iteration=1: dp: DP 9 does"),
        ("network_error:dp", "expected KEY=VALUE"),
    ):
        assert main(["faults", "--fault", spec]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1


def test_replay_injects_node_and_link_faults(capsys):
    argv = ["replay", "--synthetic", "400", "--rate", "1", "--fault", "node:at=30,server=3"]
    assert main([*argv, "--probe"]) == 0
    out = capsys.readouterr().out
    assert "restart-the-world" in out and "in flight failed" in out and "with 3 TEs" in out
    assert "service unavailable: restart-the-world" in out
    assert "link probes" in out and "healthy" in out
    for spec, expected in (
        ("node:at=1", "needs server"),
        ("node:at=1,server=99", "--fault node:at=1,server=99: server: server 99 does not"),
        ("link_down:at=1,prefill_te=0", "--probe on the command line) or give the fault a dur"),
        ("link_down:at=1,prefill_te=0", "prefill_te=0: duration: a link_down fault"),  # its key
        ("bogus:at=1", "unknown fault kind 'bogus'"),
        ("node:at=1,at=2,server=1", "at is given twice"),
        ("node:at=-1,server=0", "at must be in 0..1e+06"),
        ("link_down:at=1,prefill_te=0,duration=0", "at least 1 ns, got '0' s (leave it out for a"),
        ("node:at=1,server=1,repair=4e-10", "least 1 ns, got '4e-10' s (leave it out for a server"),
    ):
        assert main(["replay", "--synthetic", "20", "--fault", spec]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1


def test_dataflow_compares_the_modes(capsys):
    assert main(["dataflow", "--slow", "attention:0:200", "--requests", "16"]) == 0
    out = capsys.readouterr().out
    assert "tokens equal the dense reference" in out and "NO" not in out
    assert main(["dataflow", "--slow", "gpu:0:1"]) == 2
    assert "--slow gpu:0:1: component must be" in capsys.readouterr().err
    # three requests on four workers: the idle ones show "-", not nan
    assert main(["dataflow", "--duplicates", "1", "--requests", "3", "--queue-depth", "1"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "on attention worker 3" in out
    assert "still on their way" in out.replace("\n", " ")


def test_out_of_range_fault_numbers_are_one_line_errors(capsys):
    for argv, expected in (
        (
            ["replay", "--synthetic", "10", "--fault", "node:at=1,server=2,repair=1e300"],
            "repair must be in",
        ),
        (["replay", "--synthetic", "10", "--fault", "node:at=1,server=2.7"], "whole number"),
        (["dataflow", "--slow", "attention:0:inf"], "the extra delay must be 0..1e9 us, got inf"),
        (["dataflow", "--slow", "attention:0:-5"], "the extra delay must be 0..1e9 us, got -5"),
        (["dataflow", "--slow", "attention:0:x"], "expected COMPONENT:EXTRA_US"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1


def test_reusing_out_leaves_only_this_runs_files(tmp_path, capsys):
    import json

    out = tmp_path / "d"
    argv = ["replay", "--synthetic", "10", "--fault", "node:at=1,server=3"]
    assert main([*argv, "--out", str(out), "--csv"]) == 0
    assert {"faults.json", "requests.csv"} <= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")
    assert main(["replay", "--synthetic", "5", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "requests.jsonl", "summary.json"]
    assert len((out / "requests.jsonl").read_text().splitlines()) == 5
    assert json.loads((out / "summary.json").read_text())["requests"] == 5
    capsys.readouterr()


def test_a_failing_replay_leaves_no_new_directory_and_old_results_alone(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -1, "output_length": 2}\n')
    fresh = tmp_path / "new" / "deeper"
    assert main(["replay", str(bad), "--out", str(fresh)]) == 2
    assert "bad.jsonl:line 1 field 'input_length'" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text("{}")
    assert main(["replay", str(bad), "--out", str(old)]) == 2
    assert (old / "summary.json").read_text() == "{}"
    capsys.readouterr()


LENGTHS = "prompt_tokens,completion_tokens\n34,244\n36,abc\n18,275\n-7,289\n12,307\n13,258\n"


def test_lengths_rows_that_cannot_be_read_are_an_error_unless_dropped_on_request(tmp_path, capsys):
    import json

    sg = tmp_path / "sg.csv"
    sg.write_text(LENGTHS)
    assert main(["replay", str(sg), "--format", "lengths", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sg.csv:line 3 field 'completion_tokens'" in err[0], err
    assert err[0].endswith("(to leave such rows out: --drop-invalid; in Python invalid='drop')")
    out = tmp_path / "o"
    drop = ["replay", str(sg), "--format", "lengths", "--drop-invalid", "--out", str(out)]
    assert main([*drop, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "summary.json").read_text())
    assert printed["dropped_rows"] == written["dropped_rows"] == 2
    assert printed["requests"] == 4
    assert main([*drop, "--limit", "1", "--json"]) == 0  # only line 2 was read
    assert json.loads(capsys.readouterr().out)["dropped_rows"] == 0
    assert main([*drop, "--limit", "2", "--json"]) == 0  # lines 2-4
    assert json.loads(capsys.readouterr().out)["dropped_rows"] == 1
    assert main(["replay", "--synthetic", "2", "--drop-invalid"]) == 2
    assert "--drop-invalid applies to --format lengths" in capsys.readouterr().err


def test_itl_note_says_why_it_is_missing(tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 1}\n'
        '{"timestamp": 10, "input_length": 200, "output_length": 1}\n'
    )
    assert main(["replay", str(one)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no completed request has a second output token" in out
    assert "5,000 requests" not in out
    # nothing decoded: the context spread is undefined, not a perfect 1.00x
    assert "decode context: busiest die / an even spread │ - (nothing decoded)" in out
    assert main(["replay", str(one), "--json"]) == 0
    decode = json.loads(capsys.readouterr().out)["decode"]
    assert decode["context_max_over_ideal"] is None and decode["context_max_over_mean"] is None


def test_summary_and_records_say_what_was_replayed(tmp_path, capsys):
    import json

    import msgspec

    from xds.serve.presets import pd_config
    from xds.serve.replay import PDConfig

    trace = tmp_path / "b.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n1,10,2\n\n0,11,2\n")
    out = tmp_path / "o"
    argv = ["replay", str(trace), "--sort", "--seed", "3", "--out", str(out), "--csv"]
    assert main(argv) == 0
    capsys.readouterr()
    s = json.loads((out / "summary.json").read_text())
    assert (s["chips"], s["deployment"], s["seed"]) == (128, "production-4p1d", 3)
    assert (s["trace"], s["trace_format"], s["dropped_rows"]) == (str(trace), "request-csv", 0)
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [(r["request_id"], r["input_tokens"], r["source_line"]) for r in recs] == [
        (0, 11, 4),
        (1, 10, 2),
    ]
    assert (out / "requests.csv").read_text().splitlines()[1].startswith("0,4,")
    assert main(["replay", "--synthetic", "3", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["trace"], s["trace_format"], s["seed"], s["chips"]) == (None, None, 0, 128)
    assert s["workload"].startswith("production") and s["faults"] == []
    assert msgspec.convert(s["config"], PDConfig) == pd_config("production-4p1d")
    # a recovery mode and the faults are part of what was replayed
    argv = ["replay", "--synthetic", "3", "--json", "--recovery", "scale_down"]
    assert main([*argv, "--fault", "node:at=5,server=3", "--set", "prefill.tes=5"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["deployment"] == "production-4p1d@prefill.tes=5@recovery.mode=scale_down"
    assert s["faults"] == ["node:at=5,server=3"] and s["policies"] == []
    config = msgspec.convert(s["config"], PDConfig)
    assert (config.recovery.mode, config.prefill.tes) == ("scale_down", 5)
    # --recovery and the deployment's own mode disagreeing is refused, however the mode was set
    for given in (["--set", "recovery.mode=independent"], []):
        name = "production-4p1d" + ("" if given else "@recovery.mode=independent")
        assert main([*argv, "--fault", "node:at=5,server=3", "--deployment", name, *given]) == 2
        assert "--recovery scale_down conflicts with recovery.mode=independent" in (
            capsys.readouterr().err
        )


def test_replay_says_which_fault_never_struck(tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["replay", "--synthetic", "4", "--rate", "4", "--json", "--out", str(out)]
    assert main([*argv, "--fault", "node:at=100000,server=0"]) == 0
    err = capsys.readouterr().err
    assert "xds: --fault node:at=100000,server=0 never struck: every request had finished" in err
    faults = json.loads((out / "faults.json").read_text())
    assert faults["unfired"] == [{"at_ns": 100_000 * 10**9, "server": 0, "repair_ns": 0}]


def test_an_empty_out_directory_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["replay", "--synthetic", "3", "--out", ""]) == 2
    assert "--out takes a directory name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written in the current directory
    assert main(["replay", "--synthetic", "3", "--out", "/proc/xds-out"]) == 2  # checked by
    assert "--out /proc/xds-out: cannot create it in /proc" in capsys.readouterr().err  # doing


def test_a_quick_reproduce_run_says_so_in_its_json():
    from xds.reproduce import Result, Row

    rows = [Row("iteration_ms", 93.0, 81.6, "ms", "approx", 0.1)]
    quick = Result("peak-decode", 1.0, rows, quick=True).to_json_object()
    assert quick["quick"] is True and quick["rows"][0]["ok"] is None  # not judged
    full = Result("peak-decode", 1.0, rows).to_json_object()
    assert "quick" not in full and full["rows"][0]["ok"] is False


def test_a_quick_reproduce_table_is_not_judged(monkeypatch, capsys):
    """A --quick run is a smaller configuration: its table says so and gives no verdict."""
    import xds.reproduce
    from xds.reproduce import Result, Row

    rows = [Row("iteration_ms", 93.0, 81.6, "ms", "approx", 0.1)]
    monkeypatch.setattr(
        xds.reproduce, "run_target", lambda name, quick: Result(name, 1.0, rows, quick=quick)
    )
    assert main(["reproduce", "peak-decode", "--quick"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the title wraps over the table)
    assert "--quick: a smaller run, not judged" in out and "NO" not in out
    assert main(["reproduce", "peak-decode"]) == 0
    out = capsys.readouterr().out
    assert "not judged" not in out and "NO" in out  # 81.6 is not within 10 % of 93
    # --strict: exit 1, naming the rows that missed
    assert main(["reproduce", "peak-decode", "--strict", "--json"]) == 1
    assert capsys.readouterr().err == ("xds: --strict: 1 row(s) missed: peak-decode iteration_ms\n")
    rows[0] = Row("iteration_ms", 93.0, 90.0, "ms", "approx", 0.1)
    assert main(["reproduce", "peak-decode", "--strict"]) == 0
    assert capsys.readouterr().err == ""


def test_a_single_valued_option_given_twice_is_an_error_not_last_wins(capsys):
    for argv, expected in (
        (["replay", "--synthetic", "3", "--deployment", "a", "--deployment=b"], "--deployment is"),
        (["replay", "--synthetic", "3", "--seed", "1", "--seed", "2"], "--seed is given twice"),
        (["capacity", "--window", "5", "--window", "6"], "--window is given twice"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and "it takes one value" in err and err.count("\n") == 1
    # a repeatable option given the same value twice would run the same search twice
    for command in ("capacity", "compare"):
        argv = [command, "--deployment", "production-4p1d", "--deployment", "production-4p1d"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == "xds: error: --deployment production-4p1d is given twice\n"
    # a repeatable option stays repeatable, and a value that looks like an option is a value
    argv = ["replay", "--synthetic", "20", "--fault", "node:at=1,server=1"]
    assert main([*argv, "--fault", "node:at=2,server=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 20


def test_extreme_arrival_numbers_are_one_line_errors(capsys):
    for argv, expected in (
        (["capacity", "--window", "1e-300"], "--window 1e-300: at --start 1 req/s it holds 0"),
        (["capacity", "--window", "1e300"], "'--window': 1e+300 is not in the range"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match=r"cv: must be in 0\.001\.\.1000"):
        gamma_arrivals(np.random.default_rng(0), 5, 1.0, 1e-300)


def test_spread_ties_names_itself_and_a_tied_trace_gets_a_note(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 3000 * (i // 4), "input_length": 100, "output_length": 4} for i in range(24)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", str(trace), "--json"]) == 0
    captured = capsys.readouterr()
    assert "18 of 24 requests arrive at the same time" in captured.err
    assert main(["replay", str(trace), "--json", "--spread-ties"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "spread over its step" in json.loads(captured.out)["workload"]
    assert main(["replay", "--spread-ties"]) == 2
    assert "--spread-ties applies to a TRACE with timestamps" in capsys.readouterr().err
    trace.write_text("".join(json.dumps({**r, "timestamp": 0}) + "\n" for r in rows[:3]))
    assert main(["replay", str(trace), "--json"]) == 0  # 2 ties of 3: too few for a note
    assert capsys.readouterr().err == ""
    assert main(["replay", str(trace), "--json", "--spread-ties"]) == 0
    captured = capsys.readouterr()
    assert "no step to spread them over" in captured.err
    assert json.loads(captured.out)["workload"] == str(trace)


def test_a_newcomers_slips_get_a_hint(capsys):
    assert main(["reproduce"]) == 2
    assert "name a TARGET: p2p, dispatch-combine" in capsys.readouterr().err
    assert main(["reproduce", "peak_decode"]) == 2
    assert "(did you mean 'peak-decode'?)" in capsys.readouterr().err
    assert main(["help"]) == 2
    assert "Every command has --help" in capsys.readouterr().err
    assert main(["--version"]) == 2
    assert "`xds version`" in capsys.readouterr().err
    # an option of another command says whose it is, rather than suggesting a lookalike
    assert main(["compare", "--out", "d"]) == 2
    assert "No such option for compare: --out (an option of xds replay)" in capsys.readouterr().err


def test_tables_take_columns_from_the_environment_when_not_a_terminal(capsys, monkeypatch):
    assert main(["info", "--sources"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) == 120
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["info", "--sources"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) == 80
