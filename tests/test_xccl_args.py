"""Misuse of the XCCL collectives is one clear error naming the argument, on both tiers."""

from __future__ import annotations

import re

import anyio
import numpy as np
import pytest

import xds
from xds.errors import ConfigError, ModelDeadlock, ProtocolError
from xds.fabric import UBFabric
from xds.fabric.xccl import XCCL
from xds.fabric.xccl.a2e import AEConfig, AEGroup
from xds.fabric.xccl.ep import EPConfig, EPGroup
from xds.fabric.xccl.moe import ExpertMap
from xds.fabric.xccl.p2p import AppBuffer
from xds.hw import CloudMatrix384

POD = CloudMatrix384(servers=1)
H, K = 16, 2


def _group(tier: str) -> EPGroup:
    return EPGroup(
        UBFabric(POD),
        [0, 1, 2, 3],
        ExpertMap(8, 4),
        EPConfig(
            hidden=H, top_k=K, max_tokens_per_rank=8, dispatch_dtype="fp32", combine_dtype="fp32"
        ),
        tier=tier,
    )


def _x(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal((3, H)).astype(np.float32)


def _idx(rank: int) -> np.ndarray:
    return np.array([[rank * 2, (rank * 2 + 1) % 8]] * 3)


def _fails(call, tier: str = "protocol") -> BaseException:
    """Run ``call(group)`` on rank 0 of a fresh group; the error it raises."""

    async def main():
        await call(_group(tier))

    with pytest.raises((ConfigError, ProtocolError)) as err:
        xds.run(main)
    return err.value


def _single(main) -> BaseException:
    """The (first) error a run of ``main`` (ranks in a task group) ends with."""
    try:
        xds.run(main)
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        return leaf
    except BaseException as exc:
        return exc
    raise AssertionError("the run did not fail")


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_dispatch_checks_its_arguments(tier):
    for bad in (0, -1, "a", True, 2**64):
        err = _fails(lambda g, bad=bad: g.dispatch(0, _x(0), _idx(0), event_id=bad), tier)
        assert isinstance(err, ConfigError) and err.field == "event_id"
    for x in (_x(0)[:, :4], _x(0)[0], "abc", -3):
        err = _fails(lambda g, x=x: g.dispatch(0, x, _idx(0), event_id=1), tier)
        assert err.field == "x", err
    err = _fails(lambda g: g.dispatch(0, _x(0), _idx(0) + 0.5, event_id=1), tier)
    assert err.field == "topk_idx" and "integers" in str(err)
    err = _fails(lambda g: g.dispatch(0, _x(0), _idx(0)[:2], event_id=1), tier)
    assert err.field == "topk_idx" and "(3, 2)" in str(err)
    err = _fails(lambda g: g.combine(0, None, None, None, event_id=2), tier)
    assert err.field == "handle"


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_combine_checks_the_expert_outputs_shape(tier):
    async def main():
        g = _group(tier)

        async def rank(r: int) -> None:
            h = await g.dispatch(r, _x(r), _idx(r), event_id=np.int64(5))  # numpy ints are fine
            out = np.zeros((h.n_recv, K, H), np.float32)
            await g.combine(r, h, out[..., :3] if r == 0 else out, np.ones((3, K)), event_id=6)

        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(rank, r)

    err = _single(main)
    assert isinstance(err, ConfigError) and err.field == "expert_out"
    assert f", {K}, {H})" in str(err)


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_ranks_that_disagree_on_the_event_id_are_a_protocol_error(tier):
    async def main():
        g = _group(tier)
        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(lambda r=r: g.dispatch(r, _x(r), _idx(r), event_id=3 if r else 1))

    err = _single(main)
    assert isinstance(err, ProtocolError) and "disagree" in str(err)


async def _each_rank(rank) -> None:
    """``rank(r)`` for the group's four ranks at once."""
    async with anyio.create_task_group() as tg:
        for r in range(4):
            tg.start_soon(rank, r)


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_combine_refuses_another_ranks_handle(tier):
    async def main():
        g = _group(tier)
        handles: dict[int, object] = {}
        all_in = anyio.Event()

        async def rank(r: int) -> None:
            handles[r] = await g.dispatch(np.int64(r), _x(r), _idx(r), event_id=1)
            if len(handles) == 4:
                all_in.set()
            await all_in.wait()
            h = handles[(r + 1) % 4]  # the neighbour's, as a swapped loop variable would
            await g.combine(r, h, np.zeros((h.n_recv, K, H), np.float32), np.ones((3, K)), 2)

        await _each_rank(rank)

    err = _single(main)
    assert isinstance(err, ConfigError) and err.field == "handle"
    said = re.search(r"handle is rank (\d)'s dispatch output, not rank (\d)'s", str(err))
    assert said and (int(said[1]) - int(said[2])) % 4 == 1


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_combine_refuses_a_handle_from_another_group(tier):
    async def main():
        g, other = _group(tier), _group(tier)

        async def rank(r: int) -> None:
            await g.dispatch(r, _x(r), _idx(r), event_id=1)
            h = await other.dispatch(r, _x(r), _idx(r), event_id=1)
            await g.combine(r, h, np.zeros((h.n_recv, K, H), np.float32), np.ones((3, K)), 2)

        await _each_rank(rank)

    err = _single(main)
    assert isinstance(err, ConfigError) and err.field == "handle"
    assert "another group" in str(err)


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_a_rank_joining_one_exchange_twice_is_a_protocol_error(tier):
    async def main():
        g = _group(tier)
        async with anyio.create_task_group() as tg:
            tg.start_soon(g.dispatch, 0, _x(0), _idx(0), 1)
            for r in range(4):
                tg.start_soon(g.dispatch, r, _x(r), _idx(r), 1)

    err = _single(main)
    assert isinstance(err, ProtocolError) and "joined dispatch eventID 1 twice" in str(err)


def test_groups_check_their_constructor_arguments():
    fabric, emap = UBFabric(POD), ExpertMap(8, 4)
    cfg = EPConfig(hidden=H, top_k=K, max_tokens_per_rank=8)
    for args, field in (
        (("fabric", [0, 1, 2, 3], emap, cfg), "fabric"),
        ((fabric, [0, 1, 2, 3], 8, cfg), "expert_map"),
        ((fabric, [0, 1, 2, 3], emap, {"hidden": H}), "config"),
        ((fabric, "0123", emap, cfg), "ranks"),
        ((fabric, [0, 1, 2.0, 3], emap, cfg), "ranks"),
    ):
        with pytest.raises(ConfigError) as err:
            EPGroup(*args)
        assert err.value.field == field
    assert EPGroup(fabric, np.arange(4), emap, cfg).ranks == [0, 1, 2, 3]
    ae = AEConfig(hidden=H, top_k=K)
    for args, field in (
        (([], [4, 5, 6, 7], emap, ae), "attention"),
        (([0], [], emap, ae), "experts"),
        (([0], [4, 5, 6, 7], emap, AEConfig(hidden=H, top_k=9)), "config.top_k"),
        (([0], [4, 5, 6, 7], "map", ae), "expert_map"),
    ):
        with pytest.raises(ConfigError) as err:
            AEGroup(fabric, *args)
        assert err.value.field == field


def test_dispatch_checks_replica_positions():
    emap = ExpertMap(
        8,
        4,
        replicas=[[e, 8 + e] if e < 4 else [e] for e in range(8)],
        slots_rank=[e // 2 for e in range(8)] + [3, 2, 1, 0],
    )

    def fails(positions) -> ConfigError:
        async def main():
            g = EPGroup(
                UBFabric(POD),
                [0, 1, 2, 3],
                emap,
                EPConfig(hidden=H, top_k=K, max_tokens_per_rank=8),
            )
            await g.dispatch(0, _x(0), _idx(0), event_id=1, positions=positions)

        with pytest.raises(ConfigError) as err:
            xds.run(main)
        return err.value

    assert "shape (3,)" in str(fails(np.arange(2)))
    assert "integers" in str(fails(np.array([0.0, 1.0, 2.0])))
    assert ">= 0" in str(fails(np.array([0, -1, 2])))
    assert fails(np.arange(2)).field == "positions"


def test_a2e_checks_dies_indices_and_event_ids():
    fabric = UBFabric(POD)
    emap = ExpertMap(8, 4)
    with pytest.raises(ConfigError, match="listed twice"):
        AEGroup(fabric, [0, 0, 1], [4, 5, 6, 7], emap, AEConfig(hidden=H, top_k=K))
    with pytest.raises(ConfigError) as err:
        AEGroup(fabric, [0, 1], [4, 5, 6, 7], emap, AEConfig(hidden=H, top_k=K, n_shared=7))
    assert err.value.field == "n_shared"
    with pytest.raises(ConfigError, match="hidden"):
        AEConfig(hidden=0, top_k=K)

    def fails(call) -> ConfigError:
        async def main():
            await call(
                AEGroup(UBFabric(POD), [0, 1], [4, 5, 6, 7], emap, AEConfig(hidden=H, top_k=K))
            )

        with pytest.raises(ConfigError) as err:
            xds.run(main)
        return err.value

    assert fails(lambda g: g.a2e(7, _x(0), _idx(0), event_id=1)).field == "att"
    assert fails(lambda g: g.a2e(-1, _x(0), _idx(0), event_id=1)).field == "att"
    assert fails(lambda g: g.a2e(0, _x(0), _idx(0), event_id=0)).field == "event_id"
    assert fails(lambda g: g.a2e(0, _x(0)[:, :4], _idx(0), event_id=1)).field == "x"
    assert fails(lambda g: g.expert_receive(9, event_id=1)).field == "j"
    assert fails(lambda g: g.e2a(None, None, event_id=2)).field == "handle"


def test_buffers_and_expert_maps_check_their_fields():
    for offset, nbytes, field in (
        (-1, 10, "AppBuffer.offset"),
        (0.5, 10, "AppBuffer.offset"),
        (0, -2, "AppBuffer.nbytes"),
    ):
        with pytest.raises(ConfigError) as err:
            AppBuffer(offset, nbytes)  # type: ignore[arg-type]
        assert err.value.field == field
    for n in ("16", 16.0, 0, True):
        with pytest.raises(ConfigError) as err:
            ExpertMap(n, 4)  # type: ignore[arg-type]
        assert err.value.field == "n_experts"
    fabric = UBFabric(POD)
    with pytest.raises(ConfigError) as err:
        fabric._check_range(0, 2**62, "buffer")
    assert err.value.field == "nbytes"


def test_a_second_group_on_the_same_fabric_reads_past_the_first_ones_metadata():
    from xds.reproduce import dispatch_combine

    # a fresh EPGroup per batch on one fabric: the fields still hold the last group's eventIDs
    out = dispatch_combine.measure([1, 2], ep=16, tier="protocol")
    assert set(out) == {1, 2} and all(d > 0 and c > 0 for d, c in out.values())


def test_groups_on_one_fabric_never_read_each_others_metadata():
    """Two EPGroups on the same dies and fabric, both using eventIDs 1 and 2: the second must
    wait for its own ranks, not pass its barrier on the first group's leftovers."""
    from ep_harness import POD as POD4
    from xds.model import ReferenceMoE, TinyMoE

    shape = TinyMoE(hidden=H, n_experts=8, top_k=K)
    model = ReferenceMoE(shape, np.random.default_rng(0))
    xs = [np.random.default_rng(r).standard_normal((3, H)).astype(np.float32) for r in range(4)]
    ys: dict[tuple[int, int], np.ndarray] = {}

    async def main():
        fabric = UBFabric(POD4)
        cfg = EPConfig(
            hidden=H, top_k=K, max_tokens_per_rank=8, dispatch_dtype="fp32", combine_dtype="fp32"
        )
        for g_i in range(2):
            g = EPGroup(fabric, [0, 1, 2, 3], ExpertMap(8, 4), cfg)

            async def rank(r: int, g=g, g_i=g_i) -> None:
                await xds.sleep_ns(5_000 * g_i * (4 - r))  # the second group's ranks stagger
                idx, w = model.route(xs[r])
                h = await g.dispatch(r, xs[r], idx, event_id=1)
                out = np.zeros((h.n_recv, K, H), np.float32)
                for i, j in zip(*np.nonzero(h.recv_local_slots >= 0), strict=True):
                    out[i, j] = model.expert(2 * r + h.recv_local_slots[i, j], h.recv_x[i : i + 1])[
                        0
                    ]
                ys[(g_i, r)] = await g.combine(r, h, out, w, event_id=2)

            async with anyio.create_task_group() as tg:
                for r in range(4):
                    tg.start_soon(rank, r)

    xds.run(main)
    for (_, r), y in ys.items():
        np.testing.assert_allclose(
            y, model.forward(xs[r], *model.route(xs[r])), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_ranks_an_odd_number_of_events_apart_deadlock_with_a_report_naming_both(tier):
    """eventIDs of different parity use different metadata fields (double buffering), so the
    ranks cannot see that they disagree: like a real barrier they wait, and xds's deadlock
    report says which eventID each rank waits in and which one its peer last joined."""

    async def main():
        g = _group(tier)
        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(lambda r=r: g.dispatch(r, _x(r), _idx(r), event_id=2 if r else 1))

    err = _single(main)
    assert isinstance(err, ModelDeadlock)
    notes = [w.waiting_for for w in err.waiting if w.waiting_for]
    assert len(notes) == 4
    assert any("eventID 1: rank 0 waits for rank 1" in n and "joined eventID 2" in n for n in notes)
    assert any("eventID 2: rank 1 waits for rank 0" in n and "joined eventID 1" in n for n in notes)


@pytest.mark.parametrize("missing", ["receive", "send"])
def test_an_unmatched_point_to_point_operation_deadlocks_saying_what_it_waits_for(missing):
    async def main():
        fabric = UBFabric(POD)
        async with XCCL(fabric) as xccl, anyio.create_task_group() as tg:
            if missing != "send":
                tg.start_soon(xccl.send, 0, 7, AppBuffer(0, 1 << 22), 42)
            if missing != "receive":
                tg.start_soon(xccl.receive, 7, 0, AppBuffer(0, 1 << 22), 42)

    err = _single(main)
    assert isinstance(err, ModelDeadlock)
    notes = " | ".join(w.waiting_for for w in err.waiting)
    if missing == "receive":  # the ring filled up: the sender waits for the receiver's credit
        assert "send eventID 42, die 0 -> die 7: credit for ring slot" in notes
    else:
        assert "receive at die 7 from die 0: a send from die 0 (none is posted" in notes


@pytest.mark.parametrize("tier", ["protocol", "collective"])
@pytest.mark.parametrize("weights", [np.ones(3), 2.0, np.ones((3, K, 1)), [["a", "b"]] * 3, None])
def test_combine_checks_the_gate_weights(tier, weights):
    """Weights of the wrong shape or type are one ConfigError naming ``topk_weights`` (a
    string array once reached numpy's own ValueError)."""

    async def main():
        g = _group(tier)

        async def rank(r: int) -> None:
            h = await g.dispatch(r, _x(r), _idx(r), event_id=1)
            out = np.zeros((h.n_recv, K, H), np.float32)
            await g.combine(r, h, out, weights if r == 0 else np.ones((3, K)), event_id=2)

        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(rank, r)

    err = _single(main)
    assert isinstance(err, ConfigError) and err.field == "topk_weights", err


def test_expert_ids_out_of_range_are_refused_before_they_could_wrap():
    """A uint64 id of 2**64-1 once wrapped to -1 (an empty slot) and its token was dropped."""
    for bad in (2**64 - 1, 2**63, 2**62):
        idx = np.array([[0, 1], [2, 3], [4, bad]], dtype=np.uint64)
        err = _fails(lambda g, idx=idx: g.dispatch(0, _x(0), idx, event_id=1))
        assert err.field == "topk_idx" and f"expert id {bad} is out of range" in str(err)
    err = _fails(lambda g: g.dispatch(0, _x(0), np.array([[0, 1], [2, 3], [4, 1e30]]), 1))
    assert err.field == "topk_idx" and "out of range" in str(err)


def _ae_fails(call) -> BaseException:
    """An AEGroup with one shared-expert instance: attention die 0 (die 8) runs ``call``."""

    async def main():
        fabric = UBFabric(POD, payload_mode="bytes")
        cfg = AEConfig(hidden=H, top_k=K, n_shared=1, a2e_dtype="fp32", e2a_dtype="fp32")
        g = AEGroup(fabric, [8], [0, 1, 2], ExpertMap(9, 3), cfg)

        async def experts():
            for j in range(3):
                inp = await g.expert_receive(j, 1)
                await g.expert_return(j, inp, np.zeros((inp.n, g.width, H), np.float32), 2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(experts)
            await call(g)

    return _single(main)


@pytest.mark.parametrize("weights", [np.ones(3), 2.0, np.ones((3, K, 1)), np.ones((3, K + 1))])
def test_e2a_checks_the_gate_weights_with_shared_experts(weights):
    """With shared-expert instances, bad weights once failed inside numpy (AxisError,
    IndexError) before the shape check; now one ConfigError naming ``weights``, at the call."""

    async def call(g):
        h = await g.a2e(0, _x(0), _idx(0) % 8, event_id=1)
        await g.e2a(h, weights, event_id=2)

    err = _ae_fails(call)
    assert isinstance(err, ConfigError) and err.field == "weights", err
    assert f"must have shape (3, {K})" in str(err)


def test_a2e_refuses_routed_ids_naming_a_shared_instance():
    err = _ae_fails(lambda g: g.a2e(0, _x(0), np.array([[0, 8]] * 3), event_id=1))
    assert isinstance(err, ConfigError) and err.field == "topk_idx"
    assert "routed expert ids must be in -1..7" in str(err)


def test_expert_at_names_the_logical_expert_of_a_local_slot_under_any_map():
    """A received row's ``recv_local_slots`` entry is a slot on the receiving rank; with
    replicas (EPLB) the logical expert is not ``4 * rank + slot``: ``expert_at`` says it."""
    emap = ExpertMap(4, 2, replicas=[[3], [0, 2], [1], [4]], slots_rank=[0, 0, 1, 1, 1])
    assert [emap.expert_at(0, s) for s in range(2)] == [1, 2]
    assert [emap.expert_at(1, s) for s in range(3)] == [1, 0, 3]
    assert [ExpertMap(8, 4).expert_at(r, s) for r in range(4) for s in range(2)] == list(range(8))
    for rank, slot, field in ((2, 0, "rank"), (0, 2, "local_slot"), (True, 0, "rank")):
        with pytest.raises(ConfigError) as err:
            emap.expert_at(rank, slot)
        assert err.value.field == field


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_reusing_the_eventid_just_completed_is_a_protocol_error_not_stale_rows(tier):
    """Dispatching eventID 1 twice in a row: the metadata fields of that parity still hold
    eventID 1, so the protocol tier's barrier once passed at once and the faster rank pulled
    the slower one's old rows (silently wrong). Both tiers now refuse the second join; a
    different eventID of the same parity (1, 3, 1) is fine."""

    def run(ids):
        async def main():
            g = _group(tier)
            got = {}

            async def rank(r):
                for step, eid in enumerate(ids):
                    if r == 1:
                        await xds.sleep_ns(20_000)  # rank 1 is late every step
                    x = np.full((3, H), 10 * step + r + 1, np.float32)
                    idx = np.array([[0, 2]] * 3)  # every token to ranks 0 and 1
                    h = await g.dispatch(r, x, idx, event_id=eid)
                    got.setdefault(r, []).append(sorted(set(h.recv_x[:, 0].tolist())))

            async with anyio.create_task_group() as tg:
                for r in range(4):
                    tg.start_soon(rank, r)
            return got

        return xds.run(main)

    assert run([1, 3, 1])[0] == [
        [1.0, 2.0, 3.0, 4.0],
        [11.0, 12.0, 13.0, 14.0],
        [21.0, 22.0, 23.0, 24.0],
    ]
    with pytest.raises(BaseExceptionGroup) as info:
        run([1, 1])
    err = info.value.exceptions[0]
    assert isinstance(err, ProtocolError)
    assert re.match(r"rank [023] joined dispatch eventID 1 again after completing it", str(err))


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_a2e_collecting_an_eventid_already_read_is_a_protocol_error(tier):
    from xds.fabric.xccl.push import Block, PushExchange

    async def main():
        push = PushExchange(UBFabric(POD, payload_mode="bytes"), ("x",), tier=tier)
        block = {0: Block(1, b"\x01", np.zeros(1, np.int8))}
        await push.push("x", 1, 5, block, [0], 1, lanes=1)
        await push.collect("x", 0, 5, [1])
        await push.collect("x", 0, 5, [1])

    with pytest.raises(ProtocolError, match=r"^x: die 0 collects eventID 5 from die 1 again"):
        xds.run(main)
