"""Property tests of XCCL point-to-point (hypothesis): integrity, order, R1, R2, and mutants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from xccl_scenarios import EarlyAck, EarlyTail, Msg, Scenario, run_scenario, scenarios
from xds.units import KiB

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(sc=scenarios())
def test_every_byte_arrives_intact_in_order_exactly_once(sc):
    out = run_scenario(sc)
    assert out.problems == []
    for pair, occupied in out.max_occupied.items():
        assert occupied <= sc.ring_slots, pair
    for i in out.send_done_ns:  # a send completes only after its receive
        assert out.send_done_ns[i] > out.recv_done_ns[i]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_size_mode_has_the_same_timing_as_bytes_mode(sc):
    a = run_scenario(sc, mode="bytes")
    b = run_scenario(sc, mode="size")
    assert a.problems == [] and b.problems == []
    assert (a.send_done_ns, a.recv_done_ns, a.end_ns) == (b.send_done_ns, b.recv_done_ns, b.end_ns)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(max_messages=4, max_bytes=12 * KiB))
def test_smallest_cases_on_trio(sc):
    # Trio shuffles tasks that are runnable at the same instant, so transfers issued at the
    # same nanosecond may reserve a port in another order: invariants must hold regardless.
    out = run_scenario(sc, backend="trio")
    assert out.problems == []
    for pair, occupied in out.max_occupied.items():
        assert occupied <= sc.ring_slots, pair


MUTANT_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("mutant", [EarlyTail, EarlyAck])
def test_the_checks_catch_a_broken_protocol(mutant):
    # hypothesis must find a scenario in which the mutant is caught by the same checks
    found = find(
        scenarios(max_messages=4),
        lambda sc: bool(run_scenario(sc, protocol=mutant).problems),
        settings=MUTANT_SETTINGS,
    )
    assert run_scenario(found, protocol=mutant).problems
    assert run_scenario(found).problems == []  # the correct protocol passes the same scenario


def test_fixed_scenarios_catch_each_mutant():
    big = Msg(0, 16, 32 * KiB, 2, "mte", 0, 0)
    sc = Scenario(ring_slots=2, slot_bytes=4 * KiB, messages=(big,), jitter_ns=3_000)
    assert run_scenario(sc).problems == []
    early_tail = run_scenario(sc, protocol=EarlyTail).problems
    assert any("R1" in p or "reads chunk" in p or "corrupted" in p for p in early_tail)
    early_ack = run_scenario(sc, protocol=EarlyAck).problems
    assert any("R2" in p or "corrupted" in p for p in early_ack)
