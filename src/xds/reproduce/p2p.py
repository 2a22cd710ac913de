"""Figure 5 (P037): XCCL send/receive latency against payload and AIV count.

Setup as in the paper: one send/receive at a time between two random dies on different servers,
no other traffic, end-to-end from the start of ``send`` to its completion; payloads 4 KiB to
9 MiB, 2 to 48 AIVs. The model's costs and where each comes from:

=====================  ===========  ==========================================================
parameter              value        source
=====================  ===========  ==========================================================
UB bandwidth per die   196 GB/s     hardware (7 UB transceivers per die), ``xds.hw.UB_LINK``
UB one-way latency     1.2 us       512 B NPU-to-NPU read (CMI-S3), ``xds.hw.UB_LINK``
b_aiv (MTE per AIV)    33.3 GB/s    derived: HBM 1.6 TB/s / 48 AIVs (no fitted factor)
kernel launch          3 us         SPEC App. B emulator choice
metadata write         1 us         SPEC App. B emulator choice (t_meta)
MTE start-up           0.5 us       emulator choice, below DMA start-up (SPEC 1.5)
ring                   64 x 32 KiB  emulator choice (one MTE op per slot, 48 AIVs in flight)
=====================  ===========  ==========================================================

None of these was fitted to Figure 5: the two rows below are predictions.
"""

from __future__ import annotations

from functools import partial

import anyio

from ..fabric import UBFabric
from ..fabric.xccl import XCCL, AppBuffer
from ..hw import CloudMatrix384
from ..runtime import now_ns, rng, run
from ..units import KiB, MiB
from . import Row, TableData

PAYLOADS = [4 * KiB * 2**i for i in range(12)] + [9 * MiB]  # 4 KiB .. 8 MiB, 9 MiB
AIVS = [2, 4, 8, 16, 32, 48]


def _label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


async def transfer(xccl: XCCL, src: int, dst: int, nbytes: int, event_id: int, aivs: int) -> int:
    """One send/receive; returns the send's completion time."""
    buf = AppBuffer(0, nbytes)
    done: list[int] = []

    async def send() -> None:
        done.append(await xccl.send(src, dst, buf, event_id, n_aiv=aivs))

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        tg.start_soon(partial(xccl.receive, dst, src, buf, event_id, n_aiv=aivs))
    return done[0]


def measure(pod: CloudMatrix384 | None = None, *, seed: int = 0) -> dict[tuple[int, int], int]:
    """Latency in ns of one send/receive per (payload, AIVs), each between a fresh random
    pair of dies on different servers."""
    pod = pod or CloudMatrix384()

    async def main() -> dict[tuple[int, int], int]:
        fabric = UBFabric(pod, payload_mode="size", app_bytes=16 * MiB)
        pick = rng("reproduce/p2p/pairs")
        out: dict[tuple[int, int], int] = {}
        async with XCCL(fabric) as xccl:
            for event_id, (payload, aivs) in enumerate(
                ((p, a) for p in PAYLOADS for a in AIVS), start=1
            ):
                src = int(pick.integers(pod.n_pod_dies))
                others = [
                    d for d in range(pod.n_pod_dies) if pod.server_of[d] != pod.server_of[src]
                ]
                dst = others[int(pick.integers(len(others)))]
                start = now_ns()
                end = await transfer(xccl, src, dst, payload, event_id, aivs)
                out[(payload, aivs)] = end - start
        return out

    return run(main, seed=seed)


def reproduce() -> tuple[list[Row], list[TableData]]:
    lat = measure()
    below_1mib = max(lat[(p, 2)] for p in PAYLOADS if p < MiB) / 1e3
    speedup = lat[(9 * MiB, 2)] / lat[(9 * MiB, 48)]
    rows = [
        Row("max_latency_us_below_1MiB_aiv2", 20.0, round(below_1mib, 2), "us", "lt"),
        Row("speedup_9MiB_aiv48_vs_aiv2", 2.5, round(speedup, 3), "x", "gt"),
    ]
    grid = [
        [_label(p)]
        + [f"{lat[(p, a)] / 1e3:.1f}" for a in AIVS]
        + ["< 20 (2 AIVs)" if p < MiB else ("48 AIVs > 2.5x 2 AIVs" if p == 9 * MiB else "")]
        for p in PAYLOADS
    ]
    table = TableData(
        "Figure 5: XCCL send/receive latency (us), random dies on different servers",
        ["payload"] + [f"{a} AIVs" for a in AIVS] + ["paper (P037)"],
        grid,
        notes=[f"9 MiB: 2 AIVs / 48 AIVs = {speedup:.2f}x"],
    )
    return rows, [table]
