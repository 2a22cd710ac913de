"""Seeded random streams, the event log and structlog's virtual timestamps."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import structlog

import xds
from xds.runtime import RngStreams, configure_logging, get_logger, read_jsonl


def test_same_seed_same_numbers_and_streams_are_independent_of_creation_order():
    a = RngStreams(7)
    b = RngStreams(7)
    b("newcomer").random(100)  # an extra stream, created first, consumed
    assert np.array_equal(a("gating").random(5), b("gating").random(5))
    assert np.array_equal(a("mtp").integers(0, 100, 5), b("mtp").integers(0, 100, 5))


def test_different_seeds_and_names_give_different_streams():
    assert not np.array_equal(RngStreams(1)("x").random(4), RngStreams(2)("x").random(4))
    s = RngStreams(1)
    assert not np.array_equal(s("x").random(4), s("y").random(4))


def test_same_name_returns_the_same_stateful_generator():
    s = RngStreams(0)
    assert s("a") is s("a")
    assert s.names() == ["a"]


def test_stream_values_are_stable_across_releases():
    # A fixed value: catches accidental changes of the name -> stream derivation.
    assert RngStreams(0)("golden").integers(0, 2**31) == RngStreams(0)("golden").integers(0, 2**31)
    v = RngStreams(0)("golden").integers(0, 1_000_000)
    assert v == RngStreams(0)("golden").integers(0, 1_000_000)


def test_bad_seed_is_a_config_error():
    with pytest.raises(xds.errors.ConfigError, match="seed"):
        RngStreams(-1)


def test_event_log_records_virtual_time_and_writes_jsonl(tmp_path):
    async def main() -> None:
        xds.emit("die", "start", die=3)
        await xds.sleep_ns(250)
        xds.emit("die", "stop", die=3, tokens=np.int64(12), ratio=0.5)

    rt = xds.Runtime(seed=0)
    rt.run(main)
    assert [(e.t_ns, e.event) for e in rt.events] == [(0, "start"), (250, "stop")]
    assert rt.events[1].fields == {"die": 3, "tokens": 12, "ratio": 0.5}
    path = tmp_path / "events.jsonl"
    rt.events.write_jsonl(path)
    lines = path.read_text().splitlines()
    assert json.loads(lines[1]) == {
        "t_ns": 250,
        "component": "die",
        "event": "stop",
        "fields": {"die": 3, "tokens": 12, "ratio": 0.5},
    }
    assert read_jsonl(path) == list(rt.events)
    assert len(rt.events.select(event="stop")) == 1


def test_disabled_event_log_records_nothing():
    async def main() -> None:
        xds.emit("die", "start")

    rt = xds.Runtime(event_log=False)
    rt.run(main)
    assert len(rt.events) == 0


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("fields", "named", "says"),
    [
        ({"die": 3, "ratio": 1 + 2j}, "ratio", "got complex (1+2j), which the event log cannot"),
        ({"peer": _Opaque()}, "peer", "got _Opaque <"),
        (
            {"ranks": [0, 1, _Opaque()]},
            "ranks",
            "got list [0, 1, <*, holding _Opaque <test_runtime_rng_events._Opaque *, which the",
        ),
        ({"by": {(0, 1): 2}}, "by", "holding tuple (0, 1), which the event log cannot encode"),
        ({"ids": {1, "a"}}, "ids", "cannot record in one order (it sorts sets: '<' not"),
        ({"cb": print}, "cb", "got builtin_function_or_method <built-in function print>"),
        ({"buf": memoryview(b"ab")}, "buf", "got memoryview <*, which the event log cannot take"),
    ],
)
def test_emit_refuses_a_field_the_log_cannot_encode_at_the_call(fields, named, says):
    """Not when the log is written, far from the call: at the call, naming field and event."""
    import fnmatch

    async def main() -> None:
        xds.emit("router", "picked", **fields)

    rt = xds.Runtime()
    with pytest.raises(xds.errors.ConfigError) as info:
        rt.run(main)
    err = info.value
    assert err.field == named and "\n" not in str(err)
    assert str(err).startswith(f"{named}: emit('router', 'picked') got ")
    assert fnmatch.fnmatchcase(str(err), f"*{says}*"), str(err)
    assert len(rt.events) == 0  # nothing half-recorded


def test_emit_refuses_a_component_or_event_that_is_not_a_str():
    log = xds.runtime.EventLog(lambda: 0)
    with pytest.raises(xds.errors.ConfigError, match=r"^component: emit\(\) takes the compo"):
        log.emit(3, "picked")  # type: ignore[arg-type]
    with pytest.raises(xds.errors.ConfigError, match=r"^event: emit\(\) takes the event as"):
        log.emit("router", None)  # type: ignore[arg-type]
    assert len(log) == 0


def test_emit_takes_every_encodable_field_and_records_sets_sorted(tmp_path):
    class Pick(msgspec.Struct):
        te: int

    log = xds.runtime.EventLog(lambda: 5)
    log.emit(
        "router",
        "picked",
        n=np.int32(3),
        x=np.float32(0.5),
        arr=np.arange(3),
        pick=Pick(2),
        by_dp={0: [1, 2], 1: ()},
        ids={"d", "b", "c", "a"},
        nested=[frozenset({3, 1, 2}), {"k": {9, 8}}],
        none=None,
        big=2**70,
    )
    fields = log[0].fields
    assert fields["ids"] == ["a", "b", "c", "d"]  # a set is recorded as its sorted list
    assert fields["nested"] == [[1, 2, 3], {"k": [8, 9]}]
    assert fields["pick"] == Pick(2) and fields["by_dp"] == {0: [1, 2], 1: ()}
    path = tmp_path / "log.jsonl"
    log.write_jsonl(path)
    assert json.loads(path.read_text())["fields"] == {
        "n": 3,
        "x": 0.5,
        "arr": [0, 1, 2],
        "pick": {"te": 2},
        "by_dp": {"0": [1, 2], "1": []},
        "ids": ["a", "b", "c", "d"],
        "nested": [[1, 2, 3], {"k": [8, 9]}],
        "none": None,
        "big": 2**70,
    }
    plain = {"te": 1, "dp": 2}
    log.emit("decode", "step", **plain)
    assert log[1].fields == plain  # plain fields are recorded as passed


def test_an_event_log_with_sets_is_identical_under_any_hash_seed():
    """A set of strings iterates in hash order, which changes from process to process."""
    code = (
        "import collections, msgspec, xds\n"
        "class Group(msgspec.Struct):\n"
        "    dies: set\n"
        "names = {f'die-{i}' for i in range(40)}\n"
        "async def main():\n"
        "    xds.emit('pool', 'members', names=names)\n"
        "    xds.emit('pool', 'group', group=Group(set(names)))  # inside a Struct\n"
        "    by = collections.defaultdict(set, {'a': set(names)})  # a dict subclass\n"
        "    xds.emit('pool', 'by', by=by)\n"
        "    pairs = {frozenset({f'x{i}', f'y{i}'}) for i in range(20)}  # sets of sets\n"
        "    xds.emit('pool', 'pairs', pairs=pairs)\n"
        "rt = xds.Runtime(); rt.run(main); print(rt.events.digest())\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, PYTHONHASHSEED=seed),
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1 and len(digests.pop().strip()) == 64


def test_a_disabled_event_log_checks_nothing():
    """A disabled log costs one attribute test, so it does not look at the fields either."""
    log = xds.runtime.EventLog(lambda: 0, enabled=False)
    log.emit("router", "picked", peer=_Opaque())
    assert len(log) == 0


def test_rng_inside_a_run_is_seeded_by_the_run():
    async def main() -> float:
        return float(xds.rng("jitter").random())

    assert xds.run(main, seed=5) == xds.run(main, seed=5)
    assert xds.run(main, seed=5) != xds.run(main, seed=6)


def test_structlog_lines_carry_virtual_time():
    buf = io.StringIO()
    configure_logging("info", json=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buf))
    try:

        async def main() -> None:
            await xds.sleep_ns(777)
            get_logger("fabric").info("link up", die=4)

        xds.run(main)
        record = json.loads(buf.getvalue().strip().splitlines()[-1])
        assert record["t_ns"] == 777
        assert record["component"] == "fabric"
        assert record["die"] == 4
    finally:
        structlog.reset_defaults()


def test_a_struct_holding_a_set_keeps_its_own_encoding():
    """Sorting a Struct's sets must not turn it into a dict: tags, renames and array_like
    encodings stay as msgspec writes them."""

    class Tagged(msgspec.Struct, tag=True, rename="camel"):
        die_ids: set

    class Row(msgspec.Struct, array_like=True):
        dies: frozenset

    log = xds.runtime.EventLog(lambda: 0)
    log.emit("c", "e", tagged=Tagged({3, 1, 2}), row=Row(frozenset({9, 8})))
    assert json.loads(log.to_jsonl())["fields"] == {
        "tagged": {"type": "Tagged", "dieIds": [1, 2, 3]},
        "row": [[8, 9]],
    }
    assert type(log[0].fields["tagged"]) is Tagged


def test_emit_records_a_snapshot_of_what_the_caller_later_changes():
    class Box(msgspec.Struct):
        items: list[int]

    log = xds.runtime.EventLog(lambda: 0)
    flat, nested, arr, box = [1, 2], {"dp": [1, 2]}, np.arange(3), Box([7])
    log.emit("router", "state", flat=flat, nested=nested, arr=arr, box=box)
    flat.append(3)
    nested["dp"].append(3)
    arr[0] = 99
    box.items.append(8)
    fields = log[0].fields
    assert fields["flat"] == [1, 2] and fields["nested"] == {"dp": [1, 2]}
    assert fields["arr"].tolist() == [0, 1, 2] and fields["box"] == Box([7])
    log.emit("router", "plain", flat=flat, other={"a"})  # the slow path copies flat ones too
    flat.append(4)
    assert log[1].fields["flat"] == [1, 2, 3]
    inner, arr = [1, 2], np.array([1.0, 2.0])
    log.emit("router", "mixed", a=[inner, {3}], c=[arr, {4}], d=[inner, math.nan])
    inner.append(99)  # shared parts of a field whose sets (or NaN) were rewritten
    arr[0] = 42
    fields = log[2].fields
    assert fields["a"] == [[1, 2], [3]] and fields["d"] == [[1, 2], "nan"]
    assert fields["c"][0].tolist() == [1.0, 2.0]


def test_nan_infinity_and_none_are_told_apart_in_the_log():
    def digest(value):
        log = xds.runtime.EventLog(lambda: 0)
        log.emit("c", "e", x=value, xs=[1.0, value], d={"k": value})
        return log.digest(), json.loads(log.to_jsonl())["fields"]

    runs = {
        name: digest(v)
        for name, v in [("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("none", None)]
    }
    assert len({d for d, _ in runs.values()}) == 4
    assert runs["inf"][1] == {"x": "inf", "xs": [1.0, "inf"], "d": {"k": "inf"}}
    assert runs["none"][1] == {"x": None, "xs": [1.0, None], "d": {"k": None}}
    log = xds.runtime.EventLog(lambda: 0)
    log.emit("c", "e", a=np.array([1.0, np.nan]), f=np.float32("inf"), ok=2.5)
    assert json.loads(log.to_jsonl())["fields"] == {"a": [1.0, "nan"], "f": "inf", "ok": 2.5}


def test_long_doubles_and_sets_holding_nan_are_recorded():
    """np.longdouble's .item() is itself (the encoder once recursed on it), and a set
    holding NaN once failed to sort the NaN's text among the numbers."""
    log = xds.runtime.EventLog(lambda: 0)
    log.emit("c", "e", v=np.longdouble(1.5), w=np.longdouble("nan"), s={math.nan, 1.0, -2.0})
    fields = json.loads(log.to_jsonl())["fields"]
    assert fields == {"v": 1.5, "w": "nan", "s": [-2.0, 1.0, "nan"]}
    with pytest.raises(xds.errors.ConfigError, match="cannot record in one order"):
        log.emit("c", "e", s={"a", 1})  # elements that do not compare are still refused
