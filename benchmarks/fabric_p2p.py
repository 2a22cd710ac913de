"""1,000 random concurrent XCCL transfers on a 64-die pod, in bytes mode (issue: < 10 s wall).

Random pairs (src != dst) among 64 dies (4 servers), sizes log-uniform in 4 KiB .. 1 MiB,
2..16 AIVs, start times uniform in the first 200 us; transfers on the same pair run in order.
Every payload is random bytes and is checked at its destination. Prints wall time, virtual
time and throughput.

Run: ``python benchmarks/fabric_p2p.py [--transfers 1000] [--mode bytes|size] [--seed 0]``
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import xds
from xds.fabric import UBFabric
from xds.fabric.xccl import XCCL, AppBuffer
from xds.hw import CloudMatrix384
from xds.units import KiB, MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", type=int, default=1000)
    parser.add_argument("--mode", choices=["bytes", "size"], default="bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()

    pod = CloudMatrix384(servers=4)
    rng = np.random.default_rng(args.seed)
    n = args.transfers
    src = rng.integers(0, pod.n_pod_dies, n)
    dst = (src + rng.integers(1, pod.n_pod_dies, n)) % pod.n_pod_dies
    sizes = np.exp(rng.uniform(np.log(4 * KiB), np.log(1 * MiB), n)).astype(int)
    aivs = rng.integers(2, 17, n)
    starts = np.sort(rng.integers(0, 200_000, n))
    # Lay out each transfer's source and destination ranges in the dies' app regions.
    src_off = np.zeros(n, dtype=int)
    dst_off = np.zeros(n, dtype=int)
    used = np.zeros(pod.n_pod_dies, dtype=int)
    for i in range(n):
        src_off[i] = used[src[i]]
        used[src[i]] += sizes[i]
        dst_off[i] = used[dst[i]]
        used[dst[i]] += sizes[i]
    app_bytes = int(-(-used.max() // 32) * 32)
    payloads = [rng.bytes(int(s)) for s in sizes] if args.mode == "bytes" else None
    by_pair: dict[tuple[int, int], list[int]] = {}
    for i in range(n):
        by_pair.setdefault((int(src[i]), int(dst[i])), []).append(i)

    async def run() -> tuple[int, int, object]:
        fabric = UBFabric(pod, payload_mode=args.mode, app_bytes=app_bytes)
        if payloads is not None:
            for i in range(n):
                fabric.write_local(int(src[i]), int(src_off[i]), payloads[i])

        async with XCCL(fabric) as xccl:

            async def sender(indices: list[int]) -> None:
                for i in indices:
                    await xds.sleep_until_ns(int(starts[i]))
                    await xccl.send(
                        int(src[i]),
                        int(dst[i]),
                        AppBuffer(int(src_off[i]), int(sizes[i])),
                        i + 1,
                        n_aiv=int(aivs[i]),
                    )

            async def receiver(indices: list[int]) -> None:
                for i in indices:
                    await xds.sleep_until_ns(int(starts[i]))
                    await xccl.receive(
                        int(dst[i]),
                        int(src[i]),
                        AppBuffer(int(dst_off[i]), int(sizes[i])),
                        i + 1,
                        n_aiv=int(aivs[i]),
                    )

            async with anyio.create_task_group() as tg:
                for indices in by_pair.values():
                    tg.start_soon(sender, indices)
                    tg.start_soon(receiver, indices)
        bad = 0
        if payloads is not None:
            for i in range(n):
                if fabric.read_local(int(dst[i]), int(dst_off[i]), int(sizes[i])) != payloads[i]:
                    bad += 1
        xccl.monitor.check()
        return xds.now_ns(), bad, fabric.stats

    wall = time.perf_counter()
    end_ns, bad, stats = xds.run(run, seed=args.seed, backend=args.backend, event_log=False)
    wall = time.perf_counter() - wall
    total = int(sizes.sum())
    print(
        f"{n} transfers ({len(by_pair)} pairs), {total / MiB:.1f} MiB, {args.mode} mode, "
        f"{args.backend}"
    )
    print(f"virtual time   {end_ns / 1e3:,.1f} us")
    print(f"wall time      {wall:.2f} s")
    print(f"corrupted      {bad}")
    print(f"fabric stats   {stats}")


if __name__ == "__main__":
    main()
