"""Collectives with a failed die (``XCCL.fail_die``): a member's failure breaks a dispatch/combine
or A2E/E2A group; every member's operation completes or raises ``DieFailure`` when its die
learns of the failure, nothing hangs, results that complete are right, and a repaired die needs
a new group."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xds
from xds.errors import DieFailure, ProtocolError
from xds.fabric import UBFabric
from xds.fabric.xccl import XCCL
from xds.fabric.xccl.a2e import AEConfig, AEGroup
from xds.fabric.xccl.ep import EPConfig, EPGroup
from xds.fabric.xccl.moe import ExpertMap
from xds.hw import CloudMatrix384
from xds.model import ReferenceMoE, TinyMoE

POD = CloudMatrix384(servers=4)
SHAPE = TinyMoE(hidden=16, intermediate=8, n_experts=8, top_k=2)
RANKS = [0, 5, 19, 40]  # dies on different chips and servers
TIERS = ("protocol", "collective")


class Outcome:
    """How one member's operation ended: when, and its result or the error it raised."""

    def __init__(self, start: int, end: int, result: object):
        self.start, self.end, self.result = start, end, result

    @property
    def failed(self) -> bool:
        return isinstance(self.result, BaseException)


async def attempt(coro) -> Outcome:
    start = xds.now_ns()
    try:
        result = await coro
    except ProtocolError as exc:
        return Outcome(start, xds.now_ns(), exc)
    return Outcome(start, xds.now_ns(), result)


def moe_group(fabric: UBFabric, tier: str, ranks=RANKS) -> EPGroup:
    cfg = EPConfig(
        hidden=SHAPE.hidden,
        top_k=SHAPE.top_k,
        max_tokens_per_rank=64,
        n_aiv=4,
        dispatch_dtype="fp32",
        combine_dtype="fp32",
    )
    return EPGroup(fabric, ranks, ExpertMap(SHAPE.n_experts, len(ranks)), cfg, tier=tier)


def inputs(seed: int = 0, batch: int = 6):
    rng = np.random.default_rng(seed)
    model = ReferenceMoE(SHAPE, rng)
    xs = [rng.standard_normal((batch, SHAPE.hidden)).astype(np.float32) for _ in RANKS]
    return model, xs, [model.route(x) for x in xs]


async def layer(group: EPGroup, model, xs, routes, out: dict, *, event: int = 2) -> None:
    """Every rank: dispatch, its experts, combine; ``out[(rank, phase)]`` is each Outcome."""
    emap = group.expert_map
    expert_of = {
        (int(emap.slots_rank[p]), int(emap.local_index[p])): e
        for e, reps in enumerate(emap.replicas)
        for p in reps
    }

    async def rank(r: int) -> None:
        idx, w = routes[r]
        d = out[(r, "dispatch")] = await attempt(group.dispatch(r, xs[r], idx, event))
        if d.failed:
            return
        h = d.result
        y = np.zeros((h.n_recv, SHAPE.top_k, SHAPE.hidden), np.float32)
        for i in range(h.n_recv):
            for j in range(SHAPE.top_k):
                s = int(h.recv_local_slots[i, j])
                if s >= 0:
                    y[i, j] = model.expert(expert_of[(r, s)], h.recv_x[i : i + 1])[0]
        out[(r, "combine")] = await attempt(group.combine(r, h, y, w, event + 1))

    async with anyio.create_task_group() as tg:
        for r in range(len(group.ranks)):
            tg.start_soon(rank, r)


async def ae_layer(group: AEGroup, routes: list[np.ndarray], out: dict) -> None:
    """Every attention die: A2E then E2A; every expert die: receive then return (size mode);
    ``out[(op, index)]`` is each Outcome (ops after a failed one are not attempted)."""

    async def att(i: int) -> None:
        a = out[("a2e", i)] = await attempt(group.a2e(i, 4, routes[i], 1))
        if not a.failed:
            out[("e2a", i)] = await attempt(group.e2a(a.result, None, 2))

    async def exp(j: int) -> None:
        r = out[("receive", j)] = await attempt(group.expert_receive(j, 1))
        if not r.failed:
            out[("return", j)] = await attempt(group.expert_return(j, r.result, None, 2))

    async with anyio.create_task_group() as tg:
        for i in range(group.N):
            tg.start_soon(att, i)
        for j in range(group.M):
            tg.start_soon(exp, j)


def runs_on(fabric: UBFabric, fails: tuple[int | None, ...], one_layer) -> list[dict]:
    """One ``xds.run`` per entry of ``fails`` on the same fabric: that die fails at t = 0
    (None: none), then ``await one_layer(out)``; each run's ``out``."""
    outs: list[dict] = []

    async def main(die: int | None) -> None:
        async with XCCL(fabric) as x:
            if die is not None:
                x.fail_die(die)
            out: dict = {}
            await one_layer(out)
            outs.append(out)

    for die in fails:
        xds.run(main, die)
    return outs


async def fail_at(x: XCCL, die: int, when_ns: int, detect_ns: int) -> None:
    await xds.sleep_until_ns(when_ns)
    x.fail_die(die, detect_ns=detect_ns)


@pytest.mark.xds
@pytest.mark.parametrize("tier", ["protocol", "collective"])
async def test_a_rank_that_failed_before_joining_fails_every_peer_when_it_learns(xds_backend, tier):
    model, xs, routes = inputs()
    async with XCCL(UBFabric(POD)) as x:
        group = moe_group(x.fabric, tier)
        x.fail_die(RANKS[3], detect_ns=40_000)
        out: dict = {}
        await layer(group, model, xs, routes, out)
        failures = x.fabric.failures
        for r, die in enumerate(RANKS):
            o = out[(r, "dispatch")]
            assert isinstance(o.result, DieFailure), (r, o.result)
            assert o.result.die == RANKS[3] and o.result.at_ns == 0
            # the failed rank at once; each peer exactly when it learns of the failure
            assert o.end == failures.known_ns(failures.of(RANKS[3]), die)
            assert (r, "combine") not in out
        assert out[(3, "dispatch")].end == 0
        assert out[(0, "dispatch")].end >= 40_000
        assert f"dispatch eventID 2 at rank 0 (die {RANKS[0]}): die {RANKS[3]} failed at t=0" in (
            str(out[(0, "dispatch")].result)
        )


@pytest.mark.xds
@pytest.mark.parametrize("tier", ["protocol", "collective"])
async def test_a_die_outside_the_group_failing_changes_nothing(xds_backend, tier):
    model, xs, routes = inputs()
    ends = []
    for fail in (False, True):
        async with XCCL(UBFabric(POD)) as x:
            group = moe_group(x.fabric, tier)
            if fail:
                x.fail_die(7)
            out: dict = {}
            t0 = xds.now_ns()
            await layer(group, model, xs, routes, out)
            assert not any(o.failed for o in out.values())
            ends.append([out[(r, "combine")].end - t0 for r in range(len(RANKS))])
    assert ends[0] == ends[1]


@pytest.mark.xds
@pytest.mark.parametrize("tier", ["protocol", "collective"])
async def test_a_broken_group_stays_broken_and_a_new_group_after_repair_works(xds_backend, tier):
    model, xs, routes = inputs()
    async with XCCL(UBFabric(POD)) as x:
        group = moe_group(x.fabric, tier)
        out: dict = {}
        await layer(group, model, xs, routes, out)  # a healthy layer first
        assert not any(o.failed for o in out.values())
        x.fail_die(RANKS[1])
        await xds.sleep_ns(100_000)  # every rank knows by now
        again: dict = {}
        await layer(group, model, xs, routes, again, event=4)
        assert all(isinstance(o.result, DieFailure) for o in again.values())
        assert all(o.end == o.start for o in again.values())  # at once: they all know
        await xds.sleep_until_ns(x.repair_die(RANKS[1]))
        with pytest.raises(ProtocolError, match="build a new group"):
            await group.dispatch(0, xs[0], routes[0][0], 6)
        fresh = moe_group(x.fabric, tier)
        done: dict = {}
        await layer(fresh, model, xs, routes, done, event=8)
        for r in range(len(RANKS)):
            y = done[(r, "combine")].result
            np.testing.assert_allclose(y, model.forward(xs[r], *routes[r]), rtol=1e-5, atol=1e-5)


def _layer_with_failure(
    tier: str,
    dead: int,
    fail_ns: int,
    detect_ns: int,
    seed: int,
    backend: str = "asyncio",
    repair_ns: int | None = None,
) -> dict:
    model, xs, routes = inputs(seed)
    out: dict = {"model": model, "xs": xs, "routes": routes}

    async def main() -> None:
        async with XCCL(UBFabric(POD)) as x:
            group = moe_group(x.fabric, tier)
            async with anyio.create_task_group() as tg:
                tg.start_soon(fail_at, x, RANKS[dead], fail_ns, detect_ns)
                if repair_ns is not None:
                    tg.start_soon(repair_at, x, RANKS[dead], repair_ns)
                await layer(group, model, xs, routes, out)
            failure = group._failures.failed[RANKS[dead]]
            out["known"] = [x.fabric.failures.known_ns(failure, die) for die in RANKS]

    xds.run(main, seed=seed, backend=backend)
    return out


async def repair_at(x: XCCL, die: int, when_ns: int) -> None:
    await xds.sleep_until_ns(when_ns)
    x.repair_die(die)


def _failures(out: dict) -> dict:
    """(rank, phase) -> virtual time it failed, or None if it completed."""
    return {
        key: (o.end if o.failed else None)
        for key, o in out.items()
        if isinstance(key, tuple) and isinstance(o, Outcome)
    }


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    dead=st.integers(0, len(RANKS) - 1),
    fail_ns=st.integers(0, 15_000),  # a healthy layer takes ~13 us
    detect_ns=st.sampled_from([0, 349, 3_000, 1_000_000]),
    seed=st.integers(0, 3),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_every_member_completes_correctly_or_fails_once_it_knows(
    dead, fail_ns, detect_ns, seed, backend
):
    """Property: nothing hangs; an operation that completes ends before its die learns of the
    failure and its result is right; one that fails raises DieFailure naming the dead die, at
    the instant its die learns of it (or when it starts, if it already knows); the protocol and
    collective tiers fail the same operations at the same instants, on both backends."""
    outs = {
        tier: _layer_with_failure(tier, dead, fail_ns, detect_ns, seed, backend) for tier in TIERS
    }
    assert _failures(outs["protocol"]) == _failures(outs["collective"])
    out = outs["protocol"]
    model, xs, routes, known = out["model"], out["xs"], out["routes"], out["known"]
    for r in range(len(RANKS)):
        for phase in ("dispatch", "combine"):
            o = out.get((r, phase))
            if o is None:
                assert phase == "combine" and out[(r, "dispatch")].failed
                continue
            if o.failed:
                assert isinstance(o.result, DieFailure)
                assert o.result.die == RANKS[dead] and o.result.at_ns == fail_ns
                assert o.end == max(o.start, known[r])
            else:
                assert o.end < known[r]
                if phase == "combine":
                    ref = model.forward(xs[r], *routes[r])
                    np.testing.assert_allclose(o.result, ref, rtol=1e-5, atol=1e-5)
    # the dead rank itself never completes anything after it failed
    for phase in ("dispatch", "combine"):
        o = out.get((dead, phase))
        if o is not None and not o.failed:
            assert o.end < fail_ns


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ties_at_one_instant_are_decided_the_same_on_every_tier_and_backend(backend):
    """A peer that learns of the failure at the very instant it would complete fails; a die
    that fails at the instant it posts its metadata has posted nothing."""
    healthy = _layer_with_failure("protocol", 3, 10**9, 0, 0, backend)
    done = healthy[(0, "dispatch")].end
    learn = _layer_with_failure("protocol", 3, 5_000, 0, 0, backend)["known"][0] - 5_000
    for tier in TIERS:
        at_completion = _layer_with_failure(tier, 3, 5_000, done - 5_000 - learn, 0, backend)
        assert at_completion["known"][0] == done
        assert isinstance(at_completion[(0, "dispatch")].result, DieFailure)
    posted = []
    for fail_ns in range(3_000, 4_000, 5):  # the dead rank's posting instant is in there
        outs = [_layer_with_failure(t, 3, fail_ns, 10**6, 0, backend) for t in TIERS]
        assert _failures(outs[0]) == _failures(outs[1]), fail_ns
        posted.append(outs[0][(0, "dispatch")].failed)
    assert True in posted and False in posted  # the sweep crosses the posting instant


@pytest.mark.parametrize("tier", TIERS)
def test_a_repair_before_the_peers_learn_does_not_undo_the_failure(tier):
    """Die 40 fails during its launch (before posting) and is repaired at once; its peers still
    fail when they learn of the failure, on both tiers, with nothing from it."""
    out = _layer_with_failure(tier, 3, 100, 1_000_000, 0, repair_ns=200)
    for r in range(3):
        o = out[(r, "dispatch")]
        assert isinstance(o.result, DieFailure) and o.end == out["known"][r]
    assert out[(3, "dispatch")].end == 100


@pytest.mark.xds
@pytest.mark.parametrize("tier", TIERS)
async def test_a_group_built_after_a_member_failed_is_broken_from_the_start(xds_backend, tier):
    model, xs, routes = inputs()
    async with XCCL(UBFabric(POD)) as x:
        x.fail_die(RANKS[3])
        group = moe_group(x.fabric, tier)
        out: dict = {}
        await layer(group, model, xs, routes, out)
        assert all(isinstance(o.result, DieFailure) for o in out.values())
        assert [out[(r, "dispatch")].end for r in range(4)] == [
            x.fabric.failures.known_ns(x.fabric.failures.of(RANKS[3]), d) for d in RANKS
        ]


@pytest.mark.parametrize("tier", TIERS)
def test_a_group_serves_later_runs_healthy_or_broken_by_that_runs_failure(tier):
    """One group on one fabric over three runs: broken, healthy, then broken by a failure
    before its first operation of that run; each run on its own terms."""
    model, xs, routes = inputs()
    fabric = UBFabric(POD)
    group = moe_group(fabric, tier)
    outs = runs_on(
        fabric, (RANKS[2], None, RANKS[2]), lambda out: layer(group, model, xs, routes, out)
    )
    assert all(isinstance(o.result, DieFailure) for o in outs[0].values())
    assert all(isinstance(o.result, DieFailure) for o in outs[2].values())
    assert not any(o.failed for o in outs[1].values())
    for r in range(len(RANKS)):
        ref = model.forward(xs[r], *routes[r])
        np.testing.assert_allclose(outs[1][(r, "combine")].result, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.xds
@pytest.mark.parametrize("tier", ["protocol", "collective"])
@pytest.mark.parametrize("mode", ["trampoline", "direct"])
async def test_a2e_e2a_an_expert_die_failing_fails_every_e2a_and_nothing_hangs(
    xds_backend, tier, mode
):
    n_att, n_exp = 3, 5
    attention, experts = [40, 42, 44], [0, 2, 4, 6, 8]
    dead = experts[0]  # a trampoline in trampoline mode
    emap = ExpertMap(10, n_exp)
    cfg = AEConfig(hidden=16, top_k=2, mode=mode)
    rng = np.random.default_rng(0)
    routes = [rng.permuted(np.tile(np.arange(10), (4, 1)), axis=1)[:, :2] for _ in attention]
    async with XCCL(UBFabric(POD, payload_mode="size")) as x:
        group = AEGroup(x.fabric, attention, experts, emap, cfg, tier=tier)
        out: dict = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(fail_at, x, dead, 2_000, 10_000)
            tg.start_soon(ae_layer, group, routes, out)
        failures = x.fabric.failures
        failure = failures.of(dead)
        for key, o in out.items():
            die = attention[key[1]] if key[0] in ("a2e", "e2a") else experts[key[1]]
            if o.failed:
                assert isinstance(o.result, DieFailure) and o.result.die == dead, (key, o.result)
                assert o.end == max(o.start, failures.known_ns(failure, die))
            else:
                assert o.end <= failures.known_ns(failure, die)
        # no attention die gets its outputs back: every one needs the dead die's copies
        # (directly, or through its trampoline's gather)
        for i in range(n_att):
            e2a = out.get(("e2a", i))
            assert e2a is None or isinstance(e2a.result, DieFailure)
        assert isinstance(out[("receive", 0)].result, DieFailure)
        assert out[("receive", 0)].end == 2_000  # the failed die stops at once


@pytest.mark.parametrize("tier", TIERS)
def test_an_a2e_group_serves_later_runs_from_idle(tier):
    """The same A2E/E2A group in three runs: healthy, broken by a trampoline's failure,
    healthy again with the first run's timings (no eventID or block of an earlier run leaks)."""
    attention, experts = [40, 42, 44], [0, 2, 4, 6, 8]
    rng = np.random.default_rng(1)
    routes = [rng.permuted(np.tile(np.arange(10), (4, 1)), axis=1)[:, :2] for _ in attention]
    fabric = UBFabric(POD, payload_mode="size")
    group = AEGroup(
        fabric, attention, experts, ExpertMap(10, 5), AEConfig(hidden=16, top_k=2), tier=tier
    )
    runs = runs_on(fabric, (None, experts[1], None), lambda out: ae_layer(group, routes, out))
    assert all(isinstance(o.result, DieFailure) for o in runs[1].values())
    ends = [[run[("e2a", i)].end for i in range(len(attention))] for run in (runs[0], runs[2])]
    assert not any(o.failed for o in runs[2].values()) and ends[0] == ends[1]


ATTENTION, EXPERTS = [40, 42, 44], [0, 2, 4, 6, 8]


def _ae_with_failure(tier: str, mode: str, dead: int, fail_ns: int, detect_ns: int) -> dict:
    rng = np.random.default_rng(3)
    routes = [rng.permuted(np.tile(np.arange(10), (4, 1)), axis=1)[:, :2] for _ in ATTENTION]
    out: dict = {}

    async def main() -> None:
        async with XCCL(UBFabric(POD, payload_mode="size")) as x:
            cfg = AEConfig(hidden=16, top_k=2, mode=mode)
            group = AEGroup(x.fabric, ATTENTION, EXPERTS, ExpertMap(10, 5), cfg, tier=tier)
            async with anyio.create_task_group() as tg:
                tg.start_soon(fail_at, x, dead, fail_ns, detect_ns)
                tg.start_soon(ae_layer, group, routes, out)

    xds.run(main)
    return out


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["trampoline", "direct"]),
    dead=st.sampled_from(ATTENTION + EXPERTS),
    fail_ns=st.integers(0, 60_000),  # a healthy A2E/E2A here takes ~40 us
    detect_ns=st.sampled_from([0, 5_000, 1_000_000]),
)
def test_a2e_e2a_tiers_fail_the_same_operations_at_the_same_instants(
    mode, dead, fail_ns, detect_ns
):
    """Property: whichever die fails when, the protocol and collective tiers of A2E/E2A
    complete and fail the same operations, failures at the same instants, naming the die."""
    outs = [_ae_with_failure(t, mode, dead, fail_ns, detect_ns) for t in TIERS]
    assert _failures(outs[0]) == _failures(outs[1])
    for o in outs[0].values():
        assert not o.failed or o.result.die == dead
