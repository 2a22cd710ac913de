"""Figure 6 (P041): dispatch vs combine latency at EP128 as the per-die batch grows.

DeepSeek-R1 shapes (hidden 7168, 256 routed experts, top-8), EP128 on 128 dies (8 servers),
INT8 token-wise dispatch and BF16 combine (SPEC 4.4, A9), uniform routing from a seeded
stream, every rank starting together; latency is the collective's: from the common start to
the last rank's completion. Runs on the collective tier (one event per collective, same ports
and costs as the protocol tier).

What the model charges (no factor here was fitted to Figure 6): kernel launch; packing through
HBM; token-wise INT8 quantisation at the die's vector peak; one metadata write per destination
issued by the AIVs; the barrier; pulls at one AIV's MTE rate each, sharing UB links at the
all-to-all efficiency fitted on DeepEP-Ascend (``a2a_congestion``); dequantisation per row;
the owner's weighted accumulation.
"""

from __future__ import annotations

import itertools

import anyio
import numpy as np

from ..fabric import UBFabric
from ..fabric.xccl.ep import EPConfig, EPGroup
from ..fabric.xccl.moe import ExpertMap
from ..hw import CloudMatrix384
from ..model import DEEPSEEK_V3
from ..runtime import now_ns, rng, run, sleep_until_ns
from . import Row, TableData

BATCHES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128]
EP = 128


def deepseek_ep_group(
    fabric: UBFabric,
    ep: int,
    tokens: int,
    *,
    tier: str = "collective",
    pull_order: str = "static",
    experts: int | None = None,
) -> EPGroup:
    """DeepSeek-R1's dispatch/combine on dies ``0..ep-1``: hidden 7168, top-8 of 256 routed
    experts (or ``experts``) spread evenly, ``tokens`` per rank at most, INT8 dispatch and
    BF16 combine."""
    model = DEEPSEEK_V3
    return EPGroup(
        fabric,
        list(range(ep)),
        ExpertMap(experts or model.routed_experts, ep),
        EPConfig(
            hidden=model.hidden,
            top_k=model.top_k,
            max_tokens_per_rank=tokens,
            dispatch_dtype="int8",
            combine_dtype="bf16",
            pull_order=pull_order,  # type: ignore[arg-type]
        ),
        tier=tier,  # type: ignore[arg-type]
    )


async def _one_batch(
    fabric: UBFabric, ep: int, batch: int, round_: int, tier: str, pull_order: str = "static"
) -> tuple[int, int]:
    """Dispatch then combine once on every rank from common starts; the two latencies."""
    model = DEEPSEEK_V3
    group = deepseek_ep_group(fabric, ep, batch, tier=tier, pull_order=pull_order)
    pick = rng(f"reproduce/dispatch-combine/{batch}")
    routes = [
        np.stack(
            [pick.choice(model.routed_experts, model.top_k, replace=False) for _ in range(batch)]
        )
        for _ in range(ep)
    ]
    return await timed_exchange(group, batch, routes, event_id=2 * round_ + 2)


async def timed_exchange(
    group: EPGroup,
    tokens: int,
    routes: list[np.ndarray],
    *,
    event_id: int = 2,
    start_in_ns: int = 1_000_000,
    combine_after_ns: int = 1_000_000,
) -> tuple[int, int]:
    """Every rank of ``group`` dispatches ``tokens`` rows routed by ``routes[rank]`` from a
    common start ``start_in_ns`` from now (after earlier traffic drained), then combines them
    from a second common start ``combine_after_ns`` later (eventIDs ``event_id`` and the next);
    the two latencies, each from its common start to the last rank's completion."""
    t_dispatch = now_ns() + start_in_ns
    t_combine = t_dispatch + combine_after_ns
    ends = {"dispatch": 0, "combine": 0}

    async def rank(r: int) -> None:
        await sleep_until_ns(t_dispatch)
        h = await group.dispatch(r, tokens, routes[r], event_id)
        ends["dispatch"] = max(ends["dispatch"], now_ns())
        await sleep_until_ns(t_combine)
        await group.combine(r, h, None, None, event_id + 1)
        ends["combine"] = max(ends["combine"], now_ns())

    async with anyio.create_task_group() as tg:
        for r in range(len(group.ranks)):
            tg.start_soon(rank, r)
    return ends["dispatch"] - t_dispatch, ends["combine"] - t_combine


def measure(
    batches: list[int] = BATCHES,
    *,
    ep: int = EP,
    seed: int = 0,
    tier: str = "collective",
    pull_order: str = "static",
) -> dict[int, tuple[int, int]]:
    """Per batch: (dispatch latency, combine latency) in ns."""
    pod = CloudMatrix384(servers=max(1, ep // 16))

    async def main() -> dict[int, tuple[int, int]]:
        fabric = UBFabric(pod, payload_mode="size")
        return {
            b: await _one_batch(fabric, ep, b, i, tier, pull_order) for i, b in enumerate(batches)
        }

    return run(main, seed=seed, event_log=False)


def crossover(lat: dict[int, tuple[int, int]]) -> float:
    """The batch where dispatch becomes faster than combine (linear interpolation of the
    difference between sweep points); 0 if dispatch is faster at every batch, the largest
    batch if it never is."""
    batches = sorted(lat)
    diff = [lat[b][0] - lat[b][1] for b in batches]
    if diff[0] <= 0:
        return 0.0
    for (b0, d0), (b1, d1) in itertools.pairwise(zip(batches, diff, strict=True)):
        if d0 > 0 >= d1:
            return b0 + (b1 - b0) * d0 / (d0 - d1)
    return float(batches[-1])


def reproduce() -> tuple[list[Row], list[TableData]]:
    lat = measure()
    cross = crossover(lat)
    d96, c96 = lat[96]
    d1, c1 = lat[1]
    faster = (
        "dispatch" if cross == 0 else "combine" if cross == float(max(lat)) else ""
    )  # at every batch of the sweep: no crossover
    rows = [
        Row(
            "crossover_batch_per_die",
            32.0,
            round(cross, 1),
            "tokens",
            "approx",
            0.25,
            "none" if faster else "",
        ),
        Row("dispatch_over_combine_batch1", 1.0, round(d1 / c1, 3), "x", "gt"),
        Row("dispatch_over_combine_batch96", 1.0, round(d96 / c96, 3), "x", "lt"),
    ]
    table = TableData(
        f"Figure 6: dispatch vs combine at EP{EP}, DeepSeek-R1, INT8 dispatch / BF16 combine",
        ["batch/die", "dispatch us", "combine us", "faster"],
        [
            [
                str(b),
                f"{lat[b][0] / 1e3:.1f}",
                f"{lat[b][1] / 1e3:.1f}",
                "dispatch" if lat[b][0] < lat[b][1] else "combine",
            ]
            for b in sorted(lat)
        ],
        notes=[
            (
                f"no crossover: {faster} is faster at every batch"
                if faster
                else f"crossover at per-die batch {cross:.1f}"
            )
            + " (paper: 32); "
            f"batch 96: dispatch {d96 / 1e3:.1f} us, combine {c96 / 1e3:.1f} us",
            "static pull order (SPEC 4.3 leaves it open; benchmarks/a2a_pull_order.py runs both)",
        ],
    )
    return rows, [table]
