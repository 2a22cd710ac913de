"""A model that can make no progress raises a clear error instead of hanging."""

from __future__ import annotations

import anyio
import pytest

import xds
from xds.errors import ModelDeadlock, ModelLivelock, ModelTimeLimit


def test_deadlock_names_every_waiting_task(xds_backend):
    async def main() -> None:
        never = anyio.Event()

        async def die(i: int) -> None:
            await never.wait()

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(die, i, name=f"die-{i}")
            await xds.sleep_ns(1_000)

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    err = info.value
    assert err.t_ns == 1_000
    names = [w.name for w in err.waiting]
    assert names == ["die-0", "die-1", "die-2", "main"]  # main waits for its task group
    dies = err.waiting[:3]
    assert all("test_runtime_failures.py" in w.waiting_in for w in dies)
    assert all(w.waiting_on.endswith("wait") for w in dies)
    assert "die-1" in str(err) and "nothing runnable" in str(err)


def test_deadlock_of_main_itself(xds_backend):
    async def main() -> None:
        send, receive = anyio.create_memory_object_stream[int]()
        async with send, receive:
            await receive.receive()

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    assert [w.name for w in info.value.waiting] == ["main"]


def test_deadlock_inside_a_shielded_scope_still_stops(xds_backend):
    async def main() -> None:
        with anyio.CancelScope(shield=True):
            await anyio.Event().wait()

    with pytest.raises(ModelDeadlock):
        xds.run(main, backend=xds_backend)


def test_cleanup_runs_when_a_deadlock_is_reported():
    cleaned: list[str] = []

    async def main() -> None:
        async def die() -> None:
            try:
                await anyio.Event().wait()
            finally:
                cleaned.append("die")

        async with anyio.create_task_group() as tg:
            tg.start_soon(die)

    with pytest.raises(ModelDeadlock):
        xds.run(main)
    assert cleaned == ["die"]


def test_livelock_is_reported(xds_backend):
    async def main() -> None:
        while True:
            await anyio.sleep(0)

    with pytest.raises(ModelLivelock, match="without virtual time advancing"):
        xds.run(main, backend=xds_backend, livelock_limit=20_000)


def test_busy_but_progressing_model_is_not_a_livelock(xds_backend):
    async def main() -> int:
        n = 0
        for _ in range(100):
            for _ in range(50):
                await anyio.sleep(0)
                n += 1
            await xds.sleep_ns(1)
        return n

    assert xds.run(main, backend=xds_backend, livelock_limit=200) == 5000


def test_a_hang_behind_a_periodic_task_stops_at_the_time_limit(xds_backend):
    """A heartbeat keeps timers pending, so a lost wake-up is no deadlock; the virtual-time
    limit ends the run there and names who waits."""

    async def main() -> None:
        never = anyio.Event()

        async def heartbeat() -> None:
            while True:
                await xds.sleep_ns(1_000_000)

        async def stuck() -> None:
            await never.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, name="heartbeat")
            tg.start_soon(stuck, name="stuck")

    with pytest.raises(ModelTimeLimit) as info:
        xds.run(main, backend=xds_backend, time_limit_ns=10_500_000)
    err = info.value
    assert err.t_ns == 10_000_000  # the last beat before the limit; the next is past it
    assert {"stuck", "heartbeat", "main"} <= {w.name for w in err.waiting}
    assert "stuck" in str(err) and "10500000 ns" in str(err)


def test_a_model_within_its_time_limit_is_unaffected(xds_backend):
    async def main() -> int:
        await xds.sleep_ns(5_000)
        return xds.now_ns()

    assert xds.run(main, backend=xds_backend, time_limit_ns=5_000) == 5_000
    with pytest.raises(xds.errors.ConfigError, match="time_limit_ns"):
        xds.run(main, time_limit_ns=-1)
    with pytest.raises(ModelDeadlock):  # a real deadlock is still one, before the limit
        xds.run(anyio.Event().wait, backend=xds_backend, time_limit_ns=10**12)


def test_a_wait_inside_xds_names_the_users_call_too():
    from xds.fabric import UBFabric
    from xds.fabric.xccl import XCCL, AppBuffer

    async def main() -> None:
        fabric = UBFabric(xds.hw.CloudMatrix384(servers=1))
        async with XCCL(fabric) as xccl:
            await xccl.receive(1, 0, AppBuffer(0, 4096), event_id=1)  # nobody sends

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main)
    (main_task,) = info.value.waiting
    assert main_task.waiting_in.startswith("p2p.py:")  # where xds waits
    assert main_task.called_from.startswith("test_runtime_failures.py:")  # the user's line
    assert "called from test_runtime_failures.py" in str(info.value)
