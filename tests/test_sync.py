"""The reusable Barrier."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import xds
from xds.runtime import Barrier


@pytest.mark.xds
async def test_barrier_releases_everyone_when_the_last_arrives(xds_backend):
    barrier = Barrier(4)
    released: list[tuple[int, int]] = []

    async def party(i: int) -> None:
        for step in range(3):
            await xds.sleep_ns((i + 1) * 10)
            await barrier.wait()
            released.append((step, xds.now_ns()))

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(party, i)
    # every step ends when the slowest (40 ns per step) arrives
    assert sorted(released) == [(s, 40 * (s + 1)) for s in range(3) for _ in range(4)]
    assert barrier.generation == 3


@given(delays=st.lists(st.integers(0, 1000), min_size=1, max_size=12))
def test_barrier_time_is_the_max_arrival(delays):
    async def main() -> list[int]:
        barrier = Barrier(len(delays))
        out: list[int] = []

        async def party(d: int) -> None:
            await xds.sleep_ns(d)
            out.append(await barrier.wait())

        async with anyio.create_task_group() as tg:
            for d in delays:
                tg.start_soon(party, d)
        return out

    rt = xds.Runtime()
    ranks = rt.run(main)
    assert rt.end_ns == max(delays)
    assert sorted(ranks) == list(range(len(delays)))


def test_cancelled_waiter_leaves_the_generation():
    async def main() -> int:
        barrier = Barrier(2)
        with anyio.move_on_after(1e-6):
            await barrier.wait()
        assert barrier.waiting == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(barrier.wait)
            await barrier.wait()
        return barrier.generation

    assert xds.run(main) == 1


def test_ranks_stay_unique_after_a_cancelled_waiter(xds_backend):
    async def main() -> list[int]:
        barrier = Barrier(3)
        ranks: list[int] = []

        async def quitter() -> None:
            with anyio.move_on_after(1e-6):
                await barrier.wait()

        async def party(delay: int) -> None:
            await xds.sleep_ns(delay)
            ranks.append(await barrier.wait())

        async with anyio.create_task_group() as tg:
            tg.start_soon(quitter)
            for delay in (500, 2_000, 3_000):
                tg.start_soon(party, delay)
        return ranks

    assert sorted(xds.run(main, backend=xds_backend)) == [0, 1, 2]


def test_barrier_needs_a_party():
    with pytest.raises(ValueError):
        Barrier(0)


def test_a_barrier_takes_a_party_count_as_an_integer_from_one():
    import numpy as np

    assert Barrier(np.int64(2)).parties == 2
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(xds.errors.ConfigError, match="parties: must be an integer >= 1"):
            Barrier(bad)
