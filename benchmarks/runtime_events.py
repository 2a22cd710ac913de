"""Timed events per CPU second: xds (asyncio, trio) vs SimPy, 768 tasks, three patterns.

Patterns (every task draws its delays from its own seeded stream, identical across engines):

* ``sleeps``   - independent sleeps: each task sleeps ``n`` jittered durations.
  events = tasks * n timed wake-ups.
* ``barrier``  - per step, each task computes for a jittered time then waits at a pod-wide
  barrier (the decode DP ranks at the first dispatch barrier). events = 2 * tasks * steps
  (the compute wake-up and the barrier wake-up).
* ``stream``   - 384 producer/consumer pairs, each over a bounded stream (capacity 4); the
  producer sleeps then sends, the consumer receives then sleeps. events = 3 * pairs * items
  (producer wake-up, hand-off wake-up, consumer wake-up).

Run: ``python benchmarks/runtime_events.py [--scale 1.0] [--json]`` (SimPy needs the ``bench``
extra: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable

import anyio
import numpy as np

import xds
from xds.runtime import Barrier

TASKS = 768


def _delays(n_tasks: int, n: int, seed: int = 0) -> np.ndarray:
    """Integer-ns delays per task, 1..20 us, the same for every engine."""
    rng = np.random.default_rng(seed)
    return rng.integers(1_000, 20_000, size=(n_tasks, n), dtype=np.int64)


# -- xds (anyio on either backend) ---------------------------------------------------------------
async def xds_sleeps(delays: np.ndarray) -> None:
    async def task(row: list[int]) -> None:
        for d in row:
            await xds.sleep_ns(d)

    async with anyio.create_task_group() as tg:
        for row in delays.tolist():
            tg.start_soon(task, row)


async def xds_barrier(delays: np.ndarray) -> None:
    barrier = Barrier(delays.shape[0])

    async def task(row: list[int]) -> None:
        for d in row:
            await xds.sleep_ns(d)
            await barrier.wait()

    async with anyio.create_task_group() as tg:
        for row in delays.tolist():
            tg.start_soon(task, row)


async def xds_stream(delays: np.ndarray) -> None:
    pairs = delays.shape[0] // 2

    async def producer(row: list[int], send: anyio.abc.ObjectSendStream[int]) -> None:
        async with send:
            for i, d in enumerate(row):
                await xds.sleep_ns(d)
                await send.send(i)

    async def consumer(row: list[int], receive: anyio.abc.ObjectReceiveStream[int]) -> None:
        async with receive:
            async for i in receive:
                await xds.sleep_ns(row[i])

    async with anyio.create_task_group() as tg:
        rows = delays.tolist()
        for p in range(pairs):
            send, receive = anyio.create_memory_object_stream[int](max_buffer_size=4)
            tg.start_soon(producer, rows[2 * p], send)
            tg.start_soon(consumer, rows[2 * p + 1], receive)


# -- SimPy ---------------------------------------------------------------------------------------
def simpy_sleeps(delays: np.ndarray) -> int:
    import simpy

    env = simpy.Environment()

    def task(row: list[int]):
        for d in row:
            yield env.timeout(d)

    for row in delays.tolist():
        env.process(task(row))
    env.run()
    return int(env.now)


def simpy_barrier(delays: np.ndarray) -> int:
    import simpy

    env = simpy.Environment()
    n = delays.shape[0]
    state = {"arrived": 0, "release": env.event()}

    def task(row: list[int]):
        for d in row:
            yield env.timeout(d)
            state["arrived"] += 1
            release = state["release"]
            if state["arrived"] == n:
                state["arrived"] = 0
                state["release"] = env.event()
                release.succeed()
            yield release

    for row in delays.tolist():
        env.process(task(row))
    env.run()
    return int(env.now)


def simpy_stream(delays: np.ndarray) -> int:
    import simpy

    env = simpy.Environment()
    rows = delays.tolist()
    items = delays.shape[1]

    def producer(row: list[int], store: simpy.Store):
        for i, d in enumerate(row):
            yield env.timeout(d)
            yield store.put(i)

    def consumer(row: list[int], store: simpy.Store):
        for _ in range(items):
            i = yield store.get()
            yield env.timeout(row[i])

    for p in range(delays.shape[0] // 2):
        store = simpy.Store(env, capacity=4)
        env.process(producer(rows[2 * p], store))
        env.process(consumer(rows[2 * p + 1], store))
    env.run()
    return int(env.now)


# -- harness -------------------------------------------------------------------------------------
PATTERNS: dict[str, tuple[Callable, Callable, int, Callable[[int, int], int]]] = {
    # name: (xds model, simpy model, steps per task at scale 1, events(tasks, steps))
    "sleeps": (xds_sleeps, simpy_sleeps, 100, lambda t, n: t * n),
    "barrier": (xds_barrier, simpy_barrier, 50, lambda t, n: 2 * t * n),
    "stream": (xds_stream, simpy_stream, 60, lambda t, n: 3 * (t // 2) * n),
}


def _cpu(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.process_time()
    end = fn()
    return time.process_time() - t0, end


def measure(scale: float = 1.0) -> list[dict[str, object]]:
    rows = []
    for name, (xds_model, simpy_model, steps, events_of) in PATTERNS.items():
        n = max(2, int(steps * scale))
        delays = _delays(TASKS, n)
        events = events_of(TASKS, n)
        row: dict[str, object] = {"pattern": name, "tasks": TASKS, "events": events}
        ends = {}
        for backend in ("asyncio", "trio"):
            rt = xds.Runtime(backend=backend, event_log=False)
            cpu, _ = _cpu(functools.partial(rt.run, xds_model, delays))
            row[f"xds_{backend}"] = events / cpu
            ends[backend] = rt.end_ns
        try:
            cpu, end = _cpu(functools.partial(simpy_model, delays))
            row["simpy"] = events / cpu
            ends["simpy"] = end
        except ImportError:
            row["simpy"] = None
        row["same_end_time"] = len(set(ends.values())) == 1
        if row["simpy"]:
            row["ratio_asyncio_over_simpy"] = row["xds_asyncio"] / row["simpy"]  # type: ignore[operator]
            row["ratio_trio_over_simpy"] = row["xds_trio"] / row["simpy"]  # type: ignore[operator]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="scale the steps per task")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    rows = measure(args.scale)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Timed events per CPU second, {TASKS} tasks")
    for col in (
        "pattern",
        "events",
        "xds asyncio",
        "xds trio",
        "SimPy",
        "asyncio/SimPy",
        "trio/SimPy",
        "same end time",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        simpy_rate = r["simpy"]
        table.add_row(
            str(r["pattern"]),
            f"{r['events']:,}",
            f"{r['xds_asyncio']:,.0f}",
            f"{r['xds_trio']:,.0f}",
            f"{simpy_rate:,.0f}" if simpy_rate else "-",
            f"{r['ratio_asyncio_over_simpy']:.3f}" if simpy_rate else "-",
            f"{r['ratio_trio_over_simpy']:.3f}" if simpy_rate else "-",
            str(r["same_end_time"]) + ("" if simpy_rate else " (xds backends)"),
        )
    Console(width=140).print(table)
    if not all(r["simpy"] for r in rows):
        print("SimPy is not installed, so it was skipped: pip install -e '.[bench]'")


if __name__ == "__main__":
    main()
