"""Same model + seed -> byte-identical event log, in fresh processes and on both backends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xds.errors import ModelTimeStepLimit
from xds.runtime import Runtime
from xds.runtime.determinism import OrderedSet, ordered_cancel_scopes_installed
from xds.testing.scenarios import determinism_scenario, run_scenario


def _scenario_in_fresh_process(backend: str, *, hash_seed: str, perturb: bool) -> tuple[str, ...]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    env.pop("XDS_PERTURB", None)
    if perturb:
        env["XDS_PERTURB"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "xds.testing.scenarios", backend, "11"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return tuple(out.stdout.split())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_event_log_is_byte_identical_in_two_fresh_processes(backend):
    plain = _scenario_in_fresh_process(backend, hash_seed="1", perturb=False)
    perturbed = _scenario_in_fresh_process(backend, hash_seed="987", perturb=True)
    assert plain == perturbed
    digest, n_events, _end = plain
    assert len(digest) == 64 and int(n_events) > 500


def test_in_process_runs_match_the_fresh_process_runs():
    digest, n, end = run_scenario("asyncio", 11)
    assert (digest, str(n), str(end)) == _scenario_in_fresh_process(
        "asyncio", hash_seed="5", perturb=True
    )


def test_scenario_ends_at_the_same_virtual_time_on_both_backends():
    _, n_asyncio, end_asyncio = run_scenario("asyncio", 3)
    _, n_trio, end_trio = run_scenario("trio", 3)
    assert end_asyncio == end_trio
    assert n_asyncio == n_trio


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_time_step_limit_changes_nothing_until_it_is_reached(backend):
    digest, n, end = run_scenario(backend, 3)
    rt = Runtime(seed=3, backend=backend)  # type: ignore[arg-type]
    assert rt.run(determinism_scenario) == end
    steps = rt.time_steps
    assert steps > 10
    exact = Runtime(seed=3, backend=backend, time_step_limit=steps)  # type: ignore[arg-type]
    assert exact.run(determinism_scenario) == end
    assert (exact.events.digest(), len(exact.events)) == (digest, n)
    # one step short: the run stops, and its log so far is the prefix of the full one
    short = Runtime(seed=3, backend=backend, time_step_limit=steps - 1)  # type: ignore[arg-type]
    with pytest.raises(ModelTimeStepLimit):
        short.run(determinism_scenario)
    assert list(short.events) == list(rt.events)[: len(short.events)]
    assert all(e.t_ns < end for e in short.events)


def test_trio_schedule_seed_sweep():
    ends = set()
    counts = set()
    digests = set()
    for schedule_seed in range(6):
        digest, n, end = run_scenario("trio", 3, schedule_seed=schedule_seed)
        ends.add(end)
        counts.add(n)
        digests.add(digest)
        # the same schedule seed reproduces the same interleaving
        assert run_scenario("trio", 3, schedule_seed=schedule_seed)[0] == digest
    assert len(ends) == 1 and len(counts) == 1
    assert len(digests) > 1  # the sweep really explores different interleavings


def test_different_seeds_change_the_run():
    assert run_scenario("asyncio", 1)[0] != run_scenario("asyncio", 2)[0]


def test_anyio_cancel_scopes_use_ordered_sets_under_xds():
    import anyio

    import xds

    async def main() -> tuple[bool, bool]:
        with anyio.CancelScope() as scope:
            return (
                isinstance(scope._tasks, OrderedSet),  # type: ignore[attr-defined]
                isinstance(scope._child_scopes, OrderedSet),  # type: ignore[attr-defined]
            )

    assert xds.run(main) == (True, True)
    assert ordered_cancel_scopes_installed()


def test_ordered_set_behaves_like_a_set_in_insertion_order():
    s: OrderedSet[int] = OrderedSet()
    for x in (5, 1, 9, 1):
        s.add(x)
    assert list(s) == [5, 1, 9] and len(s) == 3 and 9 in s
    s.discard(1)
    s.discard(42)
    s.remove(5)
    assert list(s) == [9] and bool(s)
    with pytest.raises(KeyError):
        s.remove(5)
    assert s.pop() == 9 and not s


def test_the_library_patches_hold_only_during_xds_runs():
    """What the README's "Scheduling patches" says, in a fresh process (without Hypothesis,
    whose import switches trio's deterministic mode on by itself): importing xds changes
    nothing; during a run anyio's asyncio cancel scopes keep insertion order and trio schedules
    deterministically; after it, both libraries behave as shipped (trio's RNG state too)."""
    code = """
import anyio, xds
import trio._core._run as trio_run
from xds.runtime.determinism import ordered_cancel_scopes_installed as installed

async def scope_kind():
    with anyio.CancelScope() as scope:
        return type(scope._tasks).__name__

async def flag():
    return trio_run._ALLOW_DETERMINISTIC_SCHEDULING

seen = [installed(), trio_run._ALLOW_DETERMINISTIC_SCHEDULING]
seen += [xds.run(scope_kind), installed(), anyio.run(scope_kind)]
state = trio_run._r.getstate()
seen += [xds.run(flag, backend="trio"), trio_run._ALLOW_DETERMINISTIC_SCHEDULING]
seen += [trio_run._r.getstate() == state]
print(seen)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == str([False, False, "OrderedSet", True, "set", True, False, True])
