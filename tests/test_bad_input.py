"""Bad input a user journey turned up: each is one clear error, at once, naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

import xds
from xds.cli.main import main
from xds.errors import ConfigError
from xds.serve.decode import DecodeConfig
from xds.serve.replay import replay
from xds.trace.production import production_workload

pytest_plugins = ["pytester"]


def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("xds: error: ") and err.count("\n") == 1, err
    return err


def test_deployments_beyond_what_a_replay_models_are_refused_up_front(tmp_path, capsys):
    for line in ("decode_tes = 9999999999999999999999", "decode_tes = 100"):
        (tmp_path / "d.toml").write_text(line + "\n")
        err = _one_line(
            capsys, ["replay", "--synthetic", "3", "--deployment", str(tmp_path / "d.toml")]
        )
        assert "d.toml: decode_tes:" in err and "one CloudMatrix384 has 768" in err
    (tmp_path / "d.toml").write_text("[prefill]\ntes = 30\n")  # 30 x 32 + 128 dies
    err = _one_line(
        capsys, ["replay", "--synthetic", "3", "--deployment", str(tmp_path / "d.toml")]
    )
    assert "d.toml: prefill.tes: prefill.tes x prefill.dies_per_te + decode_tes x" in err
    assert "= 1,088 910C dies" in err
    # weights that leave no KV room are named with the deployment, before anything runs
    (tmp_path / "d.toml").write_text("[prefill]\ndies_per_te = 4\n")
    err = _one_line(
        capsys, ["replay", "--synthetic", "3", "--deployment", str(tmp_path / "d.toml")]
    )
    assert "d.toml: prefill.dies_per_te:" in err and "leave no room for KV" in err
    with pytest.raises(ConfigError, match=r"batch_per_die: must be in 1\.\.2048"):
        DecodeConfig(batch_per_die=100_000)


def test_a_decode_file_whose_batch_or_policy_cannot_run_names_the_file(tmp_path, capsys):
    (tmp_path / "kv.toml").write_text("output_tokens = 100000\n")
    err = _one_line(capsys, ["decode", "--deployment", str(tmp_path / "kv.toml")])
    assert "kv.toml: batch_per_die: a DP's 60 sequences of 102048 tokens need" in err
    (tmp_path / "kv.toml").write_text("output_tokens = 100000000\n")  # beyond the model
    err = _one_line(capsys, ["decode", "--deployment", str(tmp_path / "kv.toml")])
    assert "kv.toml: output_tokens: input_tokens + output_tokens = 100,002,048 exceed" in err
    assert err.endswith("context of 163,840 tokens (line 1)\n")
    (tmp_path / "p.toml").write_text('[eplb]\npolicy = "water-fil"\n')
    err = _one_line(capsys, ["decode", "--deployment", str(tmp_path / "p.toml")])
    assert "p.toml: eplb.policy: unknown EPLB policy 'water-fil'" in err


def test_literal_fields_list_their_choices(tmp_path, capsys):
    (tmp_path / "e.toml").write_text('[recovery]\nmode = "bogus"\n')
    err = _one_line(capsys, ["replay", "--deployment", str(tmp_path / "e.toml")])
    assert "recovery.mode: Invalid enum value 'bogus'; one of 'independent', 'restart_world'" in err


def test_capacity_options_that_would_be_ignored_are_errors(capsys):
    err = _one_line(capsys, ["capacity", "--goodput", "0.5"])
    assert "--goodput applies to --criterion goodput" in err
    err = _one_line(capsys, ["capacity", "--limit", "50"])
    assert "--limit applies to a TRACE" in err


def test_a_capacity_search_refuses_a_trace_too_short_to_judge(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{i:02d}.0,100,10\n" for i in range(5))
    )
    err = _one_line(capsys, ["capacity", str(trace), "--format", "azure"])
    assert "5 request(s); a capacity search judges the middle half" in err


def test_trace_paths_that_are_not_files_say_what_they_are(tmp_path, capsys):
    err = _one_line(capsys, ["replay", str(tmp_path), "--format", "azure"])
    assert "is a directory, not a file" in err
    (tmp_path / "d.toml").mkdir()
    err = _one_line(capsys, ["replay", "--deployment", str(tmp_path / "d.toml")])
    assert "d.toml: is a directory" in err


def test_replay_faults_and_recovery_speak_the_command_lines_language(capsys):
    err = _one_line(capsys, ["replay", "--recovery", "independent"])
    assert "--recovery applies to node faults" in err
    err = _one_line(capsys, ["faults", "--fault", "network_error:dp=2,iteraton=4"])
    assert "'iteraton' is not one of layer, code, attempts, dp, iteration" in err
    err = _one_line(capsys, ["faults", "--fault", "memory_fault:dp=1,iteration=6"])
    assert "needs first_block" in err
    err = _one_line(capsys, ["faults", "--fault", "network_error:dp=-2,iteration=4,layer=1"])
    assert "dp: Expected `int` >= 0" in err


def test_a_bad_log_level_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("XDS_LOG_LEVEL", "bogus")
    from xds.runtime import logs

    monkeypatch.setattr(logs, "_configured", False, raising=False)
    with pytest.raises(ConfigError, match="XDS_LOG_LEVEL: unknown log level 'bogus'; one of"):
        logs.configure_logging()


def test_deployment_file_suffixes_are_case_blind(tmp_path, capsys):
    from xds.cli.main import main

    upper = tmp_path / "Small.TOML"
    upper.write_text("[prefill]\ntes = 2\n")
    assert main(["replay", "--synthetic", "3", "--deployment", str(upper), "--json"]) == 0
    assert '"completed":3' in capsys.readouterr().out


def test_replay_takes_a_config_not_a_preset_name():
    with pytest.raises(ConfigError, match=r"pd_config\('production-4p1d'\)"):
        replay(production_workload(3, rate_per_s=4.0), "production-4p1d")  # type: ignore[arg-type]


def test_xds_run_inside_a_running_loop_says_it_is_synchronous():
    async def inner():
        return 1

    async def outer():
        return xds.run(inner)

    import asyncio

    with pytest.raises(ConfigError, match="is synchronous"):
        asyncio.run(outer())


def test_the_replay_header_names_the_workload_that_ran(capsys):
    assert main(["replay", "--synthetic", "40", "--limit", "10", "--rate-scale", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "production(n=40, rate=2/s, conversations) at 4x its rate, first 10" in out


# -- the embedded API (a second user journey) ---------------------------------------------------


def test_eplb_inputs_are_checked():
    import numpy as np

    from xds.serve.eplb import Layout, policy

    layout = Layout(np.arange(8), 8, 1)
    counts = np.ones((8, 3))
    for bad in (-counts, counts * np.nan):
        for name in ("xds-greedy", "deepseek-eplb", "none"):
            with pytest.raises(ConfigError, match="finite and >= 0"):
                policy(name).plan(bad, layout, 2)
    with pytest.raises(ConfigError, match="budget must be an integer"):
        policy("xds-greedy").plan(counts, layout, 2.5)  # type: ignore[arg-type]
    for args, field in (
        ((np.arange(4), 4.5, 1), "n_dies"),
        ((np.array([0.5, 1, 2, 3]), 4, 1), "primary_die"),
        ((np.arange(4), 4, 1, np.ones(7)), "base_load"),
    ):
        with pytest.raises(ConfigError) as err:
            Layout(*args)
        assert err.value.field == field


def test_comm_costs_and_decode_requests_are_checked():
    from xds.serve.decode_model import CommCosts

    for kwargs, field in (
        ({"tokens_per_die": 0, "dispatch_ns": 1, "combine_ns": 1}, "tokens_per_die"),
        ({"tokens_per_die": 8, "dispatch_ns": -10, "combine_ns": 1}, "dispatch_ns"),
    ):
        with pytest.raises(ConfigError) as err:
            CommCosts(**kwargs)
        assert err.value.field == field


def test_a_decode_run_needs_a_token_to_decode():
    """One output token is prefill's alone: the decode run used to hold those sequences'
    KV blocks for ever and end in an assertion that they leaked."""
    from xds.serve.decode import DecodeConfig

    with pytest.raises(ConfigError, match="prefill makes the first token") as err:
        DecodeConfig(output_tokens=1)
    assert err.value.field == "output_tokens"


def test_reliable_decode_configs_and_a_crash_of_every_dp():
    from xds.serve.reliability import ExecutorCrash, ReliabilityConfig, ReliableDecode

    with pytest.raises(ConfigError, match="output_tokens"):
        ReliabilityConfig(output_tokens=1)
    with pytest.raises(ConfigError, match=r"faults\[0\]"):
        ReliabilityConfig(faults=({"kind": "executor_crash", "dp": 0, "iteration": 1},))  # type: ignore[arg-type]
    cfg = ReliabilityConfig(
        dps=2, faults=(ExecutorCrash(dp=0, iteration=1), ExecutorCrash(dp=1, iteration=1))
    )
    res = xds.run(lambda: ReliableDecode(cfg).run())
    assert res.stopped.startswith("restart-the-world: DPs 0, 1 missed a heartbeat")
    assert {v.dp for v in res.verdicts} == {0, 1}
    assert all(o.reason == res.stopped for o in res.outcomes)


def test_dataflow_delays_name_a_component_that_exists():
    from xds.serve.dataflow import ComponentDelay, DataflowConfig

    for component in ("attention:01", "attention:\u0663"):
        with pytest.raises(ConfigError, match="plain decimal"):
            ComponentDelay(component=component, extra_ns=1)
    with pytest.raises(ConfigError, match="until_ns"):
        ComponentDelay(component="attention:1", extra_ns=1, from_ns=5, until_ns=2)
    with pytest.raises(ConfigError, match=r"delays\[0\]"):
        DataflowConfig(delays=({"component": "attention:1", "extra_ns": 5},))  # type: ignore[arg-type]


def test_marked_tests_stop_a_hang_kept_alive_by_a_periodic_task(pytester):
    pytester.makepyfile(
        """
        import anyio, pytest, xds

        @pytest.mark.xds
        async def test_hangs():
            async def heartbeat():
                while True:
                    await xds.sleep_ns(10**9)

            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat)
                await anyio.Event().wait()
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "ModelTimeLimit" in result.stdout.str()


def test_reproduce_and_ma_decode_options_that_would_mislead_are_errors(tmp_path, capsys):
    assert "--quick applies to peak-decode, production" in _one_line(
        capsys, ["reproduce", "p2p", "--quick"]
    )
    assert "--strict judges the paper's configurations" in _one_line(
        capsys, ["reproduce", "all", "--quick", "--strict"]
    )
    small = tmp_path / "ma.toml"
    small.write_text(
        "domains = 2\nattention_dies_per_domain = 8\nexpert_dies = 32\nshared_expert_dies = 0\n"
        "batch_per_die = 8\noutput_tokens = 16\n"
    )
    assert "--iterations sets a window" in _one_line(
        capsys, ["ma-decode", "--deployment", str(small), "--full", "--iterations", "3"]
    )
    err = _one_line(capsys, ["ma-decode", "--deployment", str(small), "--iterations", "100"])
    assert "100 iterations from token 8 may run past the end of decode" in err


def test_fourth_review_deployment_files_and_api_misuse_are_one_clear_error(tmp_path, capsys):
    """Wrong-typed values are not coerced, efficiencies have a floor, and the MA, dataflow,
    decode and EPLB entry points name what is wrong."""
    dep = tmp_path / "d.toml"
    dep.write_text('dies = 32\nshared_expert_dies = 0\nbatch_per_die = "8"\n')
    assert "batch_per_die: Expected `int`, got `str`" in _one_line(
        capsys, ["decode", "--deployment", str(dep)]
    )
    dep.write_text("dies = 32\nshared_expert_dies = 0\n[efficiency]\ngemm_compute = 1e-300\n")
    assert "efficiency.gemm_compute: Expected `float` >= 0.001" in _one_line(
        capsys, ["decode", "--deployment", str(dep)]
    )
    ma = tmp_path / "ma.toml"
    ma.write_text("domains = 10\n")
    assert "domains: 10 domains x 160 attention dies" in _one_line(
        capsys, ["ma-decode", "--deployment", str(ma)]
    )
    assert "'--duplicates': 'nan' is not a finite number" in _one_line(
        capsys, ["dataflow", "--duplicates", "nan"]
    )
    assert "--slow: attention:9: there are 4 attention workers" in _one_line(
        capsys, ["dataflow", "--slow", "attention:9:200"]
    )
    from xds.serve.decode import DecodeInstance
    from xds.serve.eplb import register_policy

    with pytest.raises(ConfigError, match="must be a plain function taking"):
        register_policy("two-args", lambda counts, layout: None)

    from xds.serve.decode import CommCosts

    async def zero():
        cfg = DecodeConfig(dies=32, batch_per_die=1, shared_expert_dies=0)
        comm = CommCosts(2, 10_000, 10_000)
        comm_mtp = CommCosts(1, 10_000, 10_000)
        await DecodeInstance(cfg, comm, comm_mtp).serve(16, max_iterations=0)

    with pytest.raises(ConfigError) as err:
        xds.run(zero)
    assert err.value.field == "max_iterations"

    async def numpy_counts():  # numpy integers are integers
        cfg = DecodeConfig(dies=32, batch_per_die=1, shared_expert_dies=0, output_tokens=3)
        comm = CommCosts(2, 10_000, 10_000)
        comm_mtp = CommCosts(1, 10_000, 10_000)
        inst = DecodeInstance(cfg, comm, comm_mtp)
        return await inst.serve(np.int64(16), max_iterations=np.int64(1))

    assert xds.run(numpy_counts).iterations == 1


def test_an_ma_instance_checks_its_arguments():
    from xds.serve.ma_config import MADecodeConfig
    from xds.serve.ma_decode import MADecodeInstance

    with pytest.raises(ConfigError, match="must be an MADecodeConfig, got dict") as err:
        MADecodeInstance({"domains": 3})  # type: ignore[arg-type]
    assert err.value.field == "config"
    with pytest.raises(ConfigError, match="must be an AECurve, got str") as err:
        MADecodeInstance(MADecodeConfig(), "x")  # type: ignore[arg-type]
    assert err.value.field == "curve"


def test_an_ma_instance_measures_its_own_curve_when_given_none():
    from xds.serve.ma_config import MADecodeConfig
    from xds.serve.ma_decode import MADecodeInstance

    cfg = MADecodeConfig(
        domains=2,
        attention_dies_per_domain=4,
        expert_dies=16,
        shared_expert_dies=0,
        batch_per_die=4,
        output_tokens=4,
    )

    async def main():
        return await MADecodeInstance(cfg).serve()  # the A2E/E2A curve measured in a thread

    assert xds.run(main).mean_iteration_ns > 0


def _fabric_calls():
    """(call on a 16-die size-or-bytes fabric inside a run, the argument it must name)."""
    from xds.fabric.xccl import AppBuffer

    buf = AppBuffer(0, 64)
    return [
        (lambda f, x: f.write(0, 99, 0, b"x"), "dst"),
        (lambda f, x: f.write(-1, 1, 0, b"x"), "src"),
        (lambda f, x: f.write(0, 1.0, 0, b"x"), "dst"),
        (lambda f, x: f.write(0, 1, None, b"x"), "offset"),
        (lambda f, x: f.write(0, 1, True, b"x"), "offset"),
        (lambda f, x: f.write(0, 1, -8, b"x"), "offset"),
        (lambda f, x: f.write(0, 1, 0, None), "data"),
        (lambda f, x: f.write(0, 1, 0, 1.5), "data"),
        (lambda f, x: f.write(0, 1, 0, b"x", aivs=True), "aivs"),
        (lambda f, x: f.write(0, 1, 0, b"x", aivs=2.0), "aivs"),
        (lambda f, x: f.write(0, 1, 0, b"x", aivs=0), "aivs"),
        (lambda f, x: f.write(0, 1, 0, b"x", engine="rdma"), "engine"),
        (lambda f, x: f.post_write(0, 1, 0.5, b"x"), "offset"),
        (lambda f, x: f.read(0, 1, 0, 8.0), "nbytes"),
        (lambda f, x: f.read(0, 1, 0, -1), "nbytes"),
        (lambda f, x: f.read(0, 1, "0", 8), "offset"),
        (lambda f, x: f.read(99, 1, 0, 8), "reader"),
        (lambda f, x: f.read(0, None, 0, 8), "owner"),
        (lambda f, x: f.read(0, 1, 0, 8, aivs=np.float64(2)), "aivs"),
        (lambda f, x: f.read_local(0, 0.5, 3), "offset"),
        (lambda f, x: f.read_local(0, 0, None), "nbytes"),
        (lambda f, x: f.read_local(True, 0, 3), "die"),
        (lambda f, x: f.write_local(0, 0.5, b"x"), "offset"),
        (lambda f, x: f.write_local(0, 0, "text"), "data"),
        (lambda f, x: f.write_local(0, 0, 3), "data"),
        (lambda f, x: f.memory(True), "die"),
        (lambda f, x: x.send(0, 99, buf, 1), "dst"),
        (lambda f, x: x.send(0.0, 1, buf, 1), "src"),
        (lambda f, x: x.receive(1, 99, buf, 1), "src"),
        (lambda f, x: x.receive(None, 0, buf, 1), "dst"),
        (lambda f, x: x.send(0, 1, buf, 1, n_aiv=2.0), "n_aiv"),
        (lambda f, x: x.send_async(0, 1, buf, 1, n_aiv=True), "n_aiv"),
        (lambda f, x: x.receive_async(1, 0, buf, 1.0), "event_id"),
        (lambda f, x: x.send(0, 1, (0, 64), 1), "buf"),
        (lambda f, x: x.send(0, 1, AppBuffer(0, None), 1), "AppBuffer.nbytes"),  # type: ignore[arg-type]
        (lambda f, x: x.send(0, 1, AppBuffer(1 << 40, 8), 1), "buf.offset"),
        (lambda f, x: x.send(0, 1, AppBuffer(0, 1 << 40), 1), "buf.nbytes"),
        (lambda f, x: x.reset_pair(0, 99), "dst"),
        (lambda f, x: x.reset_pair(0.0, 1), "src"),
        (lambda f, x: x.completion_queue(1.0), "die"),
    ]


def test_fabric_and_xccl_arguments_are_one_clear_error_naming_the_argument():
    """Floats, None, bools, negatives and dies out of range, on every public fabric and XCCL
    entry point: a one-line ConfigError naming the argument as the function spells it."""
    from xds.fabric import UBFabric
    from xds.fabric.xccl import XCCL

    async def main():
        fab = UBFabric(xds.hw.CloudMatrix384(servers=1), app_bytes=1 << 20)
        async with XCCL(fab) as x:
            for i, (call, field) in enumerate(_fabric_calls()):
                with pytest.raises(ConfigError) as err:
                    result = call(fab, x)
                    if hasattr(result, "__await__"):
                        await result
                assert err.value.field == field, (i, err.value)
                assert "\n" not in str(err.value)
            assert xds.now_ns() == 0  # refused at once

    xds.run(main)


def test_numpy_integers_are_accepted_wherever_an_integer_is():
    from xds.fabric import UBFabric
    from xds.fabric.xccl import XCCL, AppBuffer

    i = np.int64

    async def main():
        fab = UBFabric(xds.hw.CloudMatrix384(servers=1))
        fab.write_local(i(0), i(0), b"abcd")
        await fab.write(i(0), i(1), i(8), b"xy", aivs=i(2))
        assert await fab.read(i(2), i(1), i(8), i(2), aivs=np.int32(3)) == b"xy"
        assert fab.read_local(i(1), i(8), i(2)) == b"xy"
        async with XCCL(fab) as x:
            h = x.send_async(i(0), i(1), AppBuffer(i(0), i(4)), i(1), n_aiv=i(2))
            await x.receive(i(1), i(0), AppBuffer(i(64), i(4)), i(1), n_aiv=np.uint8(2))
            c = await h.wait()
        assert fab.read_local(1, 64, 4) == b"abcd"
        assert all(type(v) is int for v in (c.die, c.peer, c.event_id, c.nbytes))
        assert x.reset_pair(i(0), i(1)) == xds.now_ns()

    xds.run(main)


def test_event_fields_whose_keys_would_collide_in_json_are_refused():
    async def main():
        for fields in (
            {1: "a", "1": "b"},
            {"x": {2: 1, "2": 3}},
            {1e16: "a", "1e16": "b"},
            {1e-7: 1, "1e-7": 2},
        ):
            with pytest.raises(ConfigError, match=r"are both written as") as err:
                xds.emit("c", "e", d=fields)
            assert err.value.field == "d"
        xds.emit("c", "e", d={1: "a", "b": 2})  # mixed, distinct: fine
        xds.emit("c", "e", d={1e-7: 1, "1e-07": 2})  # the log writes 1e-7: distinct
        return [e.fields["d"] for e in xds.current_runtime().events]

    assert xds.run(main) == [{1: "a", "b": 2}, {1e-7: 1, "1e-07": 2}]


def test_public_constructors_name_an_argument_of_the_wrong_type():
    from xds.serve.dataflow import Dataflow
    from xds.serve.reliability import ReliableDecode, layer_times

    for make in (lambda: ReliableDecode(None), lambda: Dataflow(None), lambda: layer_times("x")):
        with pytest.raises(ConfigError, match=r"^config: must be a ") as err:
            make()  # type: ignore[arg-type]
        assert err.value.field == "config"


def test_reliability_faults_of_another_kind_are_named_and_a_list_is_kept_as_a_tuple():
    from xds.serve.recovery import MemoryFault as ReplayMemoryFault
    from xds.serve.reliability import NetworkError, ReliabilityConfig

    with pytest.raises(ConfigError, match=r"got xds\.serve\.recovery\.MemoryFault$") as err:
        ReliabilityConfig(faults=(ReplayMemoryFault(at_ns=0, dp=0),))
    assert err.value.field == "faults[0]"
    with pytest.raises(ConfigError, match=r"got builtins\.str$"):
        ReliabilityConfig(faults=("boom",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected a tuple of faults, got str"):
        ReliabilityConfig(faults="boom")  # type: ignore[arg-type]
    cfg = ReliabilityConfig(faults=[NetworkError(dp=2, iteration=4)])  # type: ignore[arg-type]
    assert cfg.faults == (NetworkError(dp=2, iteration=4),)


def test_decode_router_arguments_are_checked():
    from xds.serve.routing import DecodeRouter

    router = DecodeRouter(4, 2)
    for args, kwargs, field in (
        (("a", -5), {}, "max_output_tokens"),
        (("a", 12.5), {}, "max_output_tokens"),
        (("a", "12"), {}, "max_output_tokens"),
        (("a", 12), {"input_tokens": -3}, "input_tokens"),
    ):
        with pytest.raises(ConfigError) as err:
            router.route(*args, **kwargs)
        assert err.value.field == field
    assert router.route("a", 12) in range(4)  # nothing half-routed by the failures
    with pytest.raises(ConfigError) as err:
        router.remove("0")  # type: ignore[arg-type]
    assert err.value.field == "dp_index"
    router.remove(3)
    with pytest.raises(ConfigError) as err:
        router.restore(3, "3")  # type: ignore[arg-type]
    assert err.value.field == "batch_limit"
    router.restore(3, 2)


def test_replay_review_cli_errors_name_the_flag_or_file(tmp_path, capsys):
    lengths = tmp_path / "l.csv"
    lengths.write_text("a,b\n10,5\n20,6\n")
    err = _one_line(capsys, ["replay", str(lengths), "--format", "lengths", "--columns", "a,a"])
    assert "--columns names 'a' for both input and output" in err
    (tmp_path / "dup.json").write_text('{"prefill": {"tes": 2}, "prefill": {"tes": 3}}')
    err = _one_line(
        capsys, ["replay", "--synthetic", "3", "--deployment", str(tmp_path / "dup.json")]
    )
    assert "dup.json: key 'prefill' appears twice" in err
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}\n'
        '{"timestamp": 100, "input_length": 1000, "output_length": 10, "hash_ids": [1, 3]}\n'
    )
    (tmp_path / "blk.toml").write_text("[prefill]\nprefix_block_tokens = 256\n")
    err = _one_line(capsys, ["replay", str(trace), "--deployment", str(tmp_path / "blk.toml")])
    assert "blk.toml: prefill.prefix_block_tokens: " in err and err.endswith("(line 2)\n")
    # a decode deployment's cross-field checks name the file and the line too
    (tmp_path / "kv.toml").write_text("dies = 32\nbatch_per_die = 60\ninput_tokens = 100000\n")
    err = _one_line(capsys, ["decode", "--deployment", str(tmp_path / "kv.toml")])
    assert "kv.toml: shared_expert_dies: " in err  # 32 of 32 dies: the default is the problem
    assert err.endswith("(the default: the file does not set it)\n")
    (tmp_path / "kv.toml").write_text(
        "dies = 32\nbatch_per_die = 60\ninput_tokens = 100000\nshared_expert_dies = 0\n"
    )
    err = _one_line(capsys, ["decode", "--deployment", str(tmp_path / "kv.toml")])
    assert "kv.toml: batch_per_die: " in err and err.endswith("(line 2)\n")
    err = _one_line(capsys, ["replay", str(trace), "--format", "azure"])
    assert "this looks like JSON lines: is --format right?" in err
    err = _one_line(capsys, ["replay", str(lengths), "--format", "mooncake"])
    assert "at position 0 of the line); a JSONL trace has one JSON object per line" in err


def test_capacity_search_start_and_floor_at_the_ends_of_the_clock(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {k * 1000}, "input_length": 100, "output_length": 4}}\n'
            for k in range(40)
        )
    )
    err = _one_line(capsys, ["capacity", str(trace), "--start", "1e300"])
    assert "--start: at 3.90625e+297x its rate the trace's arrivals fall in one nanosecond" in err
    err = _one_line(capsys, ["capacity", str(trace), "--start", "1e-12"])
    assert "--start: at 1e-12x its rate the workload arrives over more than 24.3 days" in err


def test_moe_communication_arguments_are_checked_at_the_call():
    from xds.fabric import UBFabric
    from xds.fabric.xccl.a2e import AEConfig, AEGroup
    from xds.fabric.xccl.ep import EPConfig, EPGroup
    from xds.fabric.xccl.moe import ExpertMap
    from xds.model.reference_moe import TinyMoE
    from xds.serve.decode import DecodeInstance, measure_comm
    from xds.serve.decode_model import CommCosts
    from xds.serve.ma_config import MADecodeConfig, measure_ae

    fabric = UBFabric(xds.hw.CloudMatrix384(servers=1), payload_mode="size")
    for n_aiv in (0, -5, 1000):
        with pytest.raises(ConfigError) as err:
            AEGroup(fabric, [0], [1, 2], ExpertMap(2, 2), AEConfig(hidden=8, top_k=1, n_aiv=n_aiv))
        assert err.value.field == "config.n_aiv"
    with pytest.raises(ConfigError, match="top-8 routing needs at least 8 experts") as err:
        EPGroup(fabric, [0, 1], ExpertMap(4, 2), EPConfig(hidden=8, top_k=8, max_tokens_per_rank=1))
    assert err.value.field == "config.top_k"
    for kw, field in ((dict(top_k=8, n_experts=4), "top_k"), (dict(hidden=0), "hidden")):
        with pytest.raises(ConfigError) as err:
            TinyMoE(**kw)
        assert err.value.field == field
    with pytest.raises(ConfigError, match=r"physical slot 0\.5 does not exist"):
        ExpertMap(2, 2, replicas=[[0.5], [1]], slots_rank=[0, 1])  # type: ignore[list-item]
    small = DecodeConfig(dies=32, batch_per_die=8, output_tokens=8, shared_expert_dies=0)
    for call, field in (
        (lambda: measure_comm(small, -5), "tokens_per_die"),
        (lambda: measure_comm(None, 8), "config"),  # type: ignore[arg-type]
        (lambda: measure_ae(MADecodeConfig(), 0), "tokens_per_die"),
        (lambda: DecodeInstance(small, "x"), "comm"),  # type: ignore[arg-type]
        (lambda: DecodeInstance(small, CommCosts(1, 1, 1), 7), "comm_mtp"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.field == field
    # costs measured for another pass would price this one silently wrong
    main, mtp = CommCosts(16, 1, 1), CommCosts(8, 1, 1)  # batch 8 with one MTP draft
    for args, field, says in (
        ((mtp, mtp), "comm", r"at 8 tokens per die, but the main pass carries 16 .*\(config, 16\)"),
        ((main, main), "comm_mtp", r"at 16 tokens per die, but the MTP pass carries 8"),
        ((main,), "comm_mtp", r"MTP \(k=1\) runs a pass of 8 tokens .*measure_comm\(config, 8\)"),
    ):
        with pytest.raises(ConfigError, match=says) as err:
            DecodeInstance(small, *args)
        assert err.value.field == field
    assert DecodeInstance(small, main, mtp).model.comm_mtp is mtp

    async def fractional_count():
        group = EPGroup(
            fabric, [0, 1], ExpertMap(2, 2), EPConfig(hidden=8, top_k=1, max_tokens_per_rank=4)
        )
        with pytest.raises(ConfigError, match=r"a token count must be an integer, got 2\.5"):
            await group.dispatch(0, 2.5, np.zeros((2, 1), dtype=np.int64), event_id=1)

    xds.run(fractional_count)


def test_decode_commands_name_the_other_command_and_a_missing_delay(capsys):
    err = _one_line(capsys, ["decode", "--deployment", "ma-peak-decode"])
    assert "(it is an `xds ma-decode` deployment)" in err
    err = _one_line(capsys, ["ma-decode", "--deployment", "peak-decode"])
    assert "(it is an `xds decode` deployment)" in err
    err = _one_line(capsys, ["decode", "--deployment", "production-4p1d"])
    assert "(it is an `xds replay` deployment)" in err
    err = _one_line(capsys, ["dataflow", "--slow", "attention:0"])
    assert "the extra delay in us is missing" in err


def test_fault_specs_given_twice_empty_or_out_of_range_name_the_fault(tmp_path, capsys):
    twice = ["--fault", "network_error:dp=1,iteration=2"] * 2
    assert "the same fault is given twice" in _one_line(capsys, ["faults", *twice])
    node = ["--fault", "node:at=60,server=3"] * 2
    err = _one_line(capsys, ["replay", "--synthetic", "5", *node])
    assert "--fault node:at=60,server=3: the same fault is given twice" in err
    err = _one_line(capsys, ["faults", "--fault", "network_error:dp=1,iteration=1,code="])
    assert "code has no value" in err
    err = _one_line(capsys, ["faults", "--fault", "network_error:dp=1,iteration=1,,"])
    assert "an empty item (a stray comma?)" in err
    for spec, says in (
        ("memory:at=60,dp=128", "--fault memory:at=60,dp=128: dp: dp 128 does not exist"),
        ("memory:at=60,dp=0,blocks=99999999", ",blocks=99999999: blocks: blocks 0..9999"),
        ("memory:at=60,dp=0,blocks=0", "--fault memory:at=60,dp=0,blocks=0: blocks: "),
    ):
        assert says in _one_line(capsys, ["replay", "--synthetic", "5", "--fault", spec])
    err = _one_line(
        capsys, ["replay", "--synthetic", "5", "--fault", "link_down:at=10,prefill_te=9"]
    )
    assert "prefill_te: no DistFlow instance P9-D0: the deployment has 4 Prefill TEs" in err
    (tmp_path / "e.toml").write_text("[eplb]\nspare_slots = 1000\n")
    err = _one_line(capsys, ["decode", "--deployment", str(tmp_path / "e.toml")])
    assert "e.toml: eplb.spare_slots: 1000 redundant expert slots per die" in err


def test_a_bad_command_line_fault_after_config_faults_is_named_by_its_spec(tmp_path, capsys):
    (tmp_path / "g.toml").write_text('[[faults]]\nkind = "network_error"\ndp = 1\niteration = 2\n')
    argv = ["faults", "--config", str(tmp_path / "g.toml")]
    err = _one_line(capsys, [*argv, "--fault", "network_error:dp=9,iteration=1"])
    assert "--fault network_error:dp=9,iteration=1: dp: DP 9 does not exist" in err


def test_eplb_layout_and_plan_errors_name_the_real_cause():
    from xds.errors import ProtocolError
    from xds.serve.eplb.policies import Layout, Plan, checked_plan

    for n in (0, -1):
        with pytest.raises(ConfigError) as err:
            Layout.one_expert_per_die(n, 8)
        assert err.value.field == "n_experts"
    layout = Layout.one_expert_per_die(8, 10, 0)
    dies = [[e] for e in range(8)]
    dies[0].append(9)
    with pytest.raises(ProtocolError, match=r"die 9 has no redundant slot \(spare_slots = 0\)"):
        checked_plan(
            Plan(np.array([len(d) for d in dies]), dies),
            policy="p",
            layer=0,
            layout=layout,
            budget=4,
        )


def test_replay_faults_given_as_one_string_are_refused_whole():
    from xds.serve.presets import pd_config

    with pytest.raises(ConfigError, match=r"faults is a list of .* got str") as err:
        replay(production_workload(3, rate_per_s=1.0), pd_config("production-4p1d"), faults="node")
    assert err.value.field == "faults"
