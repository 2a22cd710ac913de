"""The built-in demo: the pod's topology and a timed virtual-time run on every die.

Each of the pod's dies is a task. For a number of steps every die computes for a jittered time
(drawn from its own seeded stream), then waits at a pod-wide barrier, the way decode DP ranks
meet at the first dispatch barrier (SPEC 6.5). The report shows virtual time per step, the
barrier wait the jitter causes, and how fast the simulator ran.
"""

from __future__ import annotations

import time

import anyio
import msgspec
import numpy as np

from .hw import CloudMatrix384
from .runtime import Barrier, Runtime, emit, now_ns, rng, sleep_ns
from .units import US


class DemoReport(msgspec.Struct, frozen=True):
    dies: int
    steps: int
    virtual_ns: int
    step_mean_ns: float
    barrier_wait_mean_ns: float
    barrier_wait_max_ns: int
    events: int
    wall_s: float
    digest: str


async def barrier_steps(n_dies: int, steps: int, compute_ns: int, jitter_ns: int) -> np.ndarray:
    """Run ``steps`` compute+barrier rounds on ``n_dies`` die tasks; return barrier waits [ns]."""
    barrier = Barrier(n_dies)
    waits = np.zeros((steps, n_dies), dtype=np.int64)

    async def die(i: int) -> None:
        gen = rng(f"demo/die/{i}")
        for step in range(steps):
            await sleep_ns(compute_ns + int(gen.exponential(jitter_ns)))
            arrived = now_ns()
            await barrier.wait()
            waits[step, i] = now_ns() - arrived
        emit("die", "done", die=i)

    async with anyio.create_task_group() as tg:
        for i in range(n_dies):
            tg.start_soon(die, i, name=f"die-{i}")
    return waits


def run_demo(
    pod: CloudMatrix384 | None = None, *, steps: int = 20, seed: int = 0, backend: str = "asyncio"
) -> DemoReport:
    pod = pod or CloudMatrix384()
    rt = Runtime(seed=seed, backend=backend)  # type: ignore[arg-type]
    wall = time.perf_counter()  # noqa: TID251 - reports the simulator's own speed
    waits = rt.run(barrier_steps, pod.n_pod_dies, steps, 500 * US, 20 * US)
    wall = time.perf_counter() - wall  # noqa: TID251
    end = rt.end_ns or 0
    return DemoReport(
        dies=pod.n_pod_dies,
        steps=steps,
        virtual_ns=end,
        step_mean_ns=end / steps,
        barrier_wait_mean_ns=float(waits.mean()),
        barrier_wait_max_ns=int(waits.max()),
        events=2 * steps * pod.n_pod_dies,
        wall_s=wall,
        digest=rt.events.digest(),
    )
