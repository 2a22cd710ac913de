"""Same-instant transfers on the two backends: where tie order changes the numbers.

Four dies (0, 2, 4, 6) each send 1 MiB to die 20 at t = 0, every send and receive with the
same AIV count. With 48 AIVs a receive takes all of die 20's AIVs, so the receives take turns,
and the four flows share die 20's UB ingress. Which receive gets the AIVs first, and which flow
the ingress carries first, is a tie at t = 0: asyncio runs tasks in the order they were
started, trio's scheduler varies it with ``schedule_seed`` (README "Backends"). With 2 AIVs
nothing is contended but the ingress, and both backends agree.

Prints, per AIV count, when the last receive completes on asyncio and on trio seeds 0-7.

Run: ``python benchmarks/backend_tie_order.py``
"""

from __future__ import annotations

import anyio

import xds
from xds.fabric import UBFabric
from xds.fabric.xccl import XCCL, AppBuffer
from xds.hw import CloudMatrix384
from xds.units import MiB

SENDERS = (0, 2, 4, 6)
RECEIVER = 20


def last_receive_us(n_aiv: int, backend: str, schedule_seed: int = 0) -> float:
    ends: list[int] = []

    async def main() -> None:
        fabric = UBFabric(CloudMatrix384(servers=4), payload_mode="size", app_bytes=8 * MiB)
        async with XCCL(fabric) as x:

            async def receive(src: int) -> None:
                await x.receive(RECEIVER, src, AppBuffer(src * MiB, MiB), 1, n_aiv=n_aiv)
                ends.append(xds.now_ns())

            async with anyio.create_task_group() as tg:
                for src in SENDERS:
                    tg.start_soon(
                        lambda s=src: x.send(s, RECEIVER, AppBuffer(0, MiB), 1, n_aiv=n_aiv)
                    )
                    tg.start_soon(receive, src)

    kw = {"schedule_seed": schedule_seed} if backend == "trio" else {}
    xds.run(main, backend=backend, **kw)
    return max(ends) / 1e3


def main() -> None:
    for n_aiv in (48, 2):
        trio = [last_receive_us(n_aiv, "trio", s) for s in range(8)]
        print(
            f"{n_aiv:>2} AIVs: asyncio {last_receive_us(n_aiv, 'asyncio'):.1f} us; "
            f"trio seeds 0-7 {min(trio):.1f}-{max(trio):.1f} us"
        )


if __name__ == "__main__":
    main()
