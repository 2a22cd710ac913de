"""A2E/E2A: numerics through trampolines, fan-out, hop visibility, tiers."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import xds
from xds.fabric import UBFabric
from xds.fabric.xccl.a2e import AEConfig, AEGroup
from xds.fabric.xccl.moe import ExpertMap
from xds.hw import CloudMatrix384
from xds.model import ReferenceMoE, TinyMoE, dequantize_int8, quantize_int8

POD = CloudMatrix384(servers=4)


def run_ae(
    *,
    mode="trampoline",
    dtype="fp32",
    tier="protocol",
    n_att=4,
    n_exp=6,
    batch=5,
    n_shared=0,
    payload="bytes",
    seed=0,
    scale_dtype="fp32",
):
    shape = TinyMoE(hidden=32, intermediate=16, n_experts=12, top_k=3)
    rng = np.random.default_rng(seed)
    model = ReferenceMoE(shape, rng)
    xs = [rng.standard_normal((batch, 32)).astype(np.float32) for _ in range(n_att)]
    routes = [model.route(x) for x in xs]
    emap = ExpertMap(12 + n_shared, n_exp)
    slot_expert = {
        (int(emap.slots_rank[p]), int(emap.local_index[p])): e
        for e, reps in enumerate(emap.replicas)
        for p in reps
    }
    out = {"ys": [None] * n_att, "recv_end": [0] * n_exp, "hop1_end": {}}

    async def main():
        fabric = UBFabric(POD, payload_mode=payload)
        g = AEGroup(
            fabric,
            list(range(40, 40 + n_att)),
            list(range(0, 2 * n_exp, 2)),
            emap,
            AEConfig(
                hidden=32,
                top_k=3,
                n_shared=n_shared,
                a2e_dtype=dtype,
                e2a_dtype=dtype,
                mode=mode,
                scale_dtype=scale_dtype,
            ),
            tier=tier,
        )

        async def att(i):
            x = xs[i] if payload == "bytes" else batch
            h = await g.a2e(i, x, routes[i][0], event_id=1)
            out["ys"][i] = await g.e2a(h, routes[i][1], event_id=2)

        async def exp(j):
            inp = await g.expert_receive(j, event_id=1)
            out["recv_end"][j] = inp.end_ns
            res = None
            if payload == "bytes":
                res = np.zeros((inp.n, g.width, 32), np.float32)
                for r in range(inp.n):
                    for c in range(g.width):
                        s = int(inp.slots[r, c])
                        if s >= 0:
                            e = slot_expert[(j, s)]
                            if e >= 12:  # a shared-expert instance: identity for the test
                                res[r, c] = inp.x[r]
                            else:
                                res[r, c] = model.expert(e, inp.x[r : r + 1])[0]
            await g.expert_return(j, inp, res, event_id=2)

        async with anyio.create_task_group() as tg:
            for i in range(n_att):
                tg.start_soon(att, i)
            for j in range(n_exp):
                tg.start_soon(exp, j)
        out["meta"] = g.push.meta_writes
        out["end"] = xds.now_ns()

    xds.run(main, seed=seed)
    out.update(model=model, xs=xs, routes=routes)
    return out


@pytest.mark.parametrize("mode", ["trampoline", "direct"])
@pytest.mark.parametrize("tier", ["protocol", "collective"])
@pytest.mark.parametrize(
    ("dtype", "scale_dtype"), [("fp32", "fp32"), ("int8", "fp32"), ("int8", "bf16")]
)
def test_e2a_of_experts_of_a2e_equals_the_dense_reference(mode, tier, dtype, scale_dtype):
    out = run_ae(mode=mode, tier=tier, dtype=dtype, scale_dtype=scale_dtype)
    q = (lambda v: dequantize_int8(*quantize_int8(v, scale_dtype))) if dtype == "int8" else None
    for i, y in enumerate(out["ys"]):
        ref = out["model"].forward(out["xs"][i], *out["routes"][i], round_input=q, round_output=q)
        assert np.array_equal(y, ref)


def test_shared_expert_instances_add_one_unweighted_copy_per_token():
    out = run_ae(n_shared=2, n_exp=7)
    for i, y in enumerate(out["ys"]):
        ref = out["model"].forward(out["xs"][i], *out["routes"][i]) + out["xs"][i]
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)


def test_trampolines_cut_the_attention_dies_fan_out_to_one():
    tramp = run_ae(mode="trampoline", payload="size")["meta"]
    direct = run_ae(mode="direct", payload="size")["meta"]
    for die in range(40, 44):
        assert tramp[("hop1", die)] == 1  # exactly one metadata write per A2E
        assert direct[("direct", die)] == 6  # one per expert die
    # trampolines take over the fan-out (to every other expert die)
    assert all(tramp[("hop2", d)] == 5 for d in (0, 2, 4, 6))


def test_non_trampoline_experts_see_rows_only_after_both_hops():
    out = run_ae(payload="size")
    trampolines, others = out["recv_end"][:4], out["recv_end"][4:]
    dma = POD.engines.dma_startup_ns
    # hop 1 alone already costs a DMA start-up; experts fed only by hop 2 pay a second one
    assert min(others) > dma * 2
    assert max(trampolines) >= dma


def test_the_two_tiers_agree():
    for mode in ("trampoline", "direct"):
        a = run_ae(mode=mode, payload="size", tier="protocol", n_att=6, n_exp=9, batch=16)
        b = run_ae(mode=mode, payload="size", tier="collective", n_att=6, n_exp=9, batch=16)
        assert abs(a["end"] - b["end"]) <= 0.10 * a["end"]
        for x, y in zip(a["recv_end"], b["recv_end"], strict=True):
            assert abs(x - y) <= 0.10 * x


def test_bad_groups_are_clear_errors():
    from xds.errors import ConfigError

    fabric = UBFabric(POD)
    with pytest.raises(ConfigError, match="trampolines"):
        AEGroup(fabric, list(range(10)), [20, 21], ExpertMap(4, 2), AEConfig(hidden=8, top_k=1))
    with pytest.raises(ConfigError, match="both"):
        AEGroup(fabric, [1, 2], [2, 3], ExpertMap(4, 2), AEConfig(hidden=8, top_k=1))


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_an_expert_receive_cancelled_mid_collect_can_be_retried_alike_on_both_tiers(tier):
    """Expert die 0 gives up receiving at 16 us, with some rows already arrived, and receives
    the same eventID again: the collective tier once lost the rows it had read (deadlock)."""

    async def main():
        fabric = UBFabric(POD, payload_mode="bytes")
        cfg = AEConfig(hidden=16, top_k=3, a2e_dtype="fp32", e2a_dtype="fp32")
        g = AEGroup(fabric, [8, 9], [0, 1, 2, 3], ExpertMap(12, 4), cfg, tier=tier)
        rows = {}

        async def att(i):
            await xds.sleep_ns(10_000)
            idx = np.random.default_rng(i).integers(0, 12, (5, 3))
            h = await g.a2e(i, np.ones((5, 16), np.float32), idx, event_id=1)
            await g.e2a(h, np.ones((5, 3), np.float32), event_id=2)

        async def exp(j):
            if j == 0:
                with anyio.move_on_after(16e-6):
                    await g.expert_receive(j, event_id=1)
            inp = await g.expert_receive(j, event_id=1)
            await g.expert_return(j, inp, np.ones((inp.n, g.width, 16), np.float32), event_id=2)
            rows[j] = inp.n

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(att, i)
            for j in range(4):
                tg.start_soon(exp, j)
        return xds.now_ns(), rows

    end, rows = xds.run(main)
    assert rows == {0: 4, 1: 4, 2: 4, 3: 8}
    assert end == 62_814  # as without the timeout: the retry found every row where it was


@pytest.mark.parametrize("tier", ["protocol", "collective"])
@pytest.mark.parametrize(("sent", "expected"), [(2, 4), (4, 2)])
def test_dies_that_disagree_on_the_eventid_get_a_protocol_error(tier, sent, expected):
    """SPEC 3.4 R3: the eventIDs at both ends must match. An attention die pushing A2E under
    eventID ``sent`` while its trampoline receives ``expected`` (same parity, same buffer)
    is a ProtocolError naming both, on either tier, at the instant the metadata lands."""
    from xds.errors import ProtocolError

    async def main():
        fabric = UBFabric(POD, payload_mode="bytes")
        cfg = AEConfig(hidden=16, top_k=2, a2e_dtype="fp32", e2a_dtype="fp32")
        g = AEGroup(fabric, [8], [0, 1], ExpertMap(4, 2), cfg, tier=tier)

        async def att():
            idx = np.array([[0, 3], [1, 2]])
            await g.a2e(0, np.ones((2, 16), np.float32), idx, event_id=sent)

        async with anyio.create_task_group() as tg:
            tg.start_soon(att)
            tg.start_soon(g.expert_receive, 0, expected)

    with pytest.raises(BaseExceptionGroup) as info:
        xds.run(main)
    (err,) = info.value.exceptions
    assert isinstance(err, ProtocolError)
    assert str(err) == (
        f"hop1: die 8 wrote eventID {sent} where die 0 expects {expected} (the dies disagree "
        f"on the eventID, or die 0 skipped eventID {sent})"
    )


@pytest.mark.parametrize("tier", ["protocol", "collective"])
def test_a_collect_cancelled_after_some_sources_arrived_takes_nothing(tier):
    """A die collecting from two sources gives up after the first one's block has landed;
    its retry of the same eventID gets both blocks (the protocol tier once took the first
    block before the wait and then reported its metadata 'visible before its data')."""
    from xds.fabric.xccl.push import Block, PushExchange

    async def main(give_up: bool):
        fabric = UBFabric(POD, payload_mode="bytes")
        push = PushExchange(fabric, ("x",), tier=tier)
        side = np.zeros(1, np.int8)

        async def source(src, delay_ns):
            await xds.sleep_ns(delay_ns)
            await push.push("x", src, 3, {0: Block(1, bytes([src]), side)}, [0], 1, lanes=1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(source, 1, 0)
            tg.start_soon(source, 2, 50_000)
            if give_up:
                with anyio.move_on_after(20e-6) as scope:
                    await push.collect("x", 0, 3, [1, 2])
                assert scope.cancelled_caught
            got = await push.collect("x", 0, 3, [1, 2])
        return {src: block.data for src, block in got.items()}, xds.now_ns()

    got, end = xds.run(main, True)
    assert got == {1: b"\x01", 2: b"\x02"}
    assert end == xds.run(main, False)[1] > 50_000
