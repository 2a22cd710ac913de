"""Reference scenarios used by the determinism tests, the demo and the benchmarks.

:func:`determinism_scenario` stresses every source of scheduling non-determinism ARCHITECTURE.md
lists: many timers with equal deadlines, an event fanned out to many waiters, task-group
cancellation with cleanup in ``finally`` blocks, and several consumers competing for one memory
object stream. Its end time depends only on the seed, never on scheduling order, so it must end
at the same virtual time on both backends; its event log must be byte-identical across fresh
processes on one backend.

Run ``python -m xds.testing.scenarios [asyncio|trio] [seed] [schedule_seed]`` to print the log's
digest, its length and the end time.
"""

from __future__ import annotations

import sys

import anyio
import anyio.abc

from xds.runtime import Runtime, emit, now_ns, rng, sleep_ns
from xds.units import US


async def determinism_scenario(n_tasks: int = 48, steps: int = 6) -> int:
    """Run the scenario and return the virtual time it ended at."""
    # 1. Equal-deadline timers: every task sleeps the same amount each step, then draws jitter
    #    from its own named stream, then all meet at a barrier built from a counter + Event.
    arrived = 0
    barrier = anyio.Event()

    async def die(i: int) -> None:
        nonlocal arrived, barrier
        gen = rng(f"die/{i}")
        for step in range(steps):
            await sleep_ns(10 * US)  # same deadline for every task
            emit("die", "tick", die=i, step=step)
            await sleep_ns(int(gen.integers(1, 5)) * US)  # jittered compute
            arrived += 1
            my_barrier = barrier
            if arrived == n_tasks:
                arrived = 0
                barrier = anyio.Event()
                emit("barrier", "release", step=step)
                my_barrier.set()  # 2. fan-out to every waiter
            else:
                await my_barrier.wait()
            emit("die", "passed", die=i, step=step)

    async with anyio.create_task_group() as tg:
        for i in range(n_tasks):
            tg.start_soon(die, i, name=f"die-{i}")

    # 3. Competing consumers on one stream; an item's cost depends only on the item.
    send, receive = anyio.create_memory_object_stream[int](max_buffer_size=4)

    async def consumer(c: int, rx: anyio.abc.ObjectReceiveStream[int]) -> None:
        async with rx:
            async for item in rx:
                emit("consumer", "got", consumer=c, item=item)
                await sleep_ns((item % 7 + 1) * US)

    async def producer() -> None:
        async with send:
            for item in range(4 * n_tasks):
                await send.send(item)
                emit("producer", "sent", item=item)

    async with anyio.create_task_group() as tg:
        for c in range(8):
            tg.start_soon(consumer, c, receive.clone(), name=f"consumer-{c}")
        tg.start_soon(producer, name="producer")
        receive.close()

    # 4. Task-group cancellation: workers in a cancelled scope clean up in finally blocks.
    async def worker(i: int) -> None:
        try:
            await sleep_ns(1_000_000 * US)
        finally:
            emit("worker", "cleanup", worker=i)

    async with anyio.create_task_group() as tg:
        for i in range(n_tasks):
            tg.start_soon(worker, i, name=f"worker-{i}")
        await sleep_ns(5 * US)
        tg.cancel_scope.cancel()

    # 5. Timeouts in virtual time.
    with anyio.move_on_after(25e-6) as scope:
        await sleep_ns(100 * US)
    emit("timeout", "moved_on", cancelled=scope.cancelled_caught)
    return now_ns()


def run_scenario(
    backend: str = "asyncio", seed: int = 0, schedule_seed: int | None = None
) -> tuple[str, int, int]:
    """(event-log digest, number of events, end time in ns) of one run of the scenario."""
    rt = Runtime(seed=seed, backend=backend, schedule_seed=schedule_seed)  # type: ignore[arg-type]
    end = rt.run(determinism_scenario)
    return rt.events.digest(), len(rt.events), end


def _perturb_memory_layout() -> list[object]:
    """Allocate a random amount of garbage so objects land at different addresses."""
    import os

    junk: list[object] = []
    for size in os.urandom(64):
        junk.append(bytearray(size * 17 + 1))
        junk.append({str(size): object()} if size % 2 else [object()] * (size % 13))
    return junk


if __name__ == "__main__":
    args = sys.argv[1:]
    backend = args[0] if args else "asyncio"
    seed = int(args[1]) if len(args) > 1 else 0
    schedule_seed = int(args[2]) if len(args) > 2 else None
    keep = _perturb_memory_layout() if "XDS_PERTURB" in __import__("os").environ else []
    digest, n, end = run_scenario(backend, seed, schedule_seed)
    print(digest, n, end)
