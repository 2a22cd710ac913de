"""A model that can make no progress raises a clear error instead of hanging."""

from __future__ import annotations

import re

import anyio
import pytest

import xds
from xds.errors import ConfigError, ModelDeadlock, ModelLivelock, ModelTimeLimit, ModelTimeStepLimit
from xds.runtime.core import UNWIND_SPIN_LIMIT


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


def test_a_deadlock_report_counts_and_names_tasks_started_on_library_calls(xds_backend):
    """Tasks started directly on a library or xds coroutine (no frame of the model's own) are
    waiting tasks too: counted, placed at the call they were started on, with their notes."""

    async def main() -> None:
        barrier = xds.runtime.Barrier(3)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(barrier.wait)
            tg.start_soon(anyio.Event().wait)
            tg.start_soon(anyio.sleep_forever)

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    err = info.value
    assert len(err.waiting) == 5 and "5 task(s) waiting" in str(err)
    by_name = {w.name: w for w in err.waiting}
    barrier = by_name["xds.runtime.sync.Barrier.wait"]
    assert "in Barrier.wait" in barrier.waiting_in
    assert barrier.waiting_for == "Barrier generation 0: 2 of 3 parties arrived"
    assert "in sleep_forever" in by_name["anyio.sleep_forever"].waiting_in
    event = next(w for w in err.waiting if w.name.endswith("Event.wait"))
    assert "in Event.wait" in event.waiting_in


def test_a_deadlock_report_says_what_each_task_waits_for(xds_backend):
    state = {"credits": 0}

    async def main() -> None:
        never = anyio.Event()

        async def sender(i: int) -> None:
            with xds.waiting_for("a credit"):
                with xds.waiting_for(lambda: f"credit {i} (holds {state['credits']})"):
                    await never.wait()
                await never.wait()  # unreachable; the outer note would apply here

        async def broken() -> None:
            with xds.waiting_for(lambda: 1 / 0):
                await never.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(sender, 0, name="s0")
            tg.start_soon(broken, name="s1")
            await xds.sleep_ns(10)
            state["credits"] = 3  # the note is rendered when the report is made
            with xds.waiting_for("done"):
                pass  # a note leaves with its block
            await xds.sleep_ns(10)

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    notes = {w.name: w.waiting_for for w in info.value.waiting}
    assert notes == {
        "s0": "a credit > credit 0 (holds 3)",  # nested notes: the outer first
        "s1": "<the note could not be rendered: ZeroDivisionError: division by zero>",
        "main": "",
    }
    assert "waiting for a credit > credit 0 (holds 3)" in str(info.value)


def test_a_nested_note_gives_way_to_the_outer_one_when_its_block_ends(xds_backend):
    async def main() -> None:
        with xds.waiting_for("outer"):
            with xds.waiting_for("inner"):
                await xds.sleep_ns(1)
            await anyio.Event().wait()

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    assert [w.waiting_for for w in info.value.waiting] == ["outer"]


def test_nested_notes_are_all_reported_outer_first(xds_backend):
    async def main() -> None:
        never = anyio.Event()

        async def nested() -> None:
            with xds.waiting_for("outer"), xds.waiting_for(lambda: "middle"):
                with xds.waiting_for("inner"):
                    await xds.sleep_ns(1)
                with xds.waiting_for("second inner"):
                    await never.wait()

        async def other() -> None:  # another task's notes stay its own
            with xds.waiting_for("its own"):
                await never.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(nested, name="a")
            tg.start_soon(other, name="b")

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    notes = {w.name: w.waiting_for for w in info.value.waiting}
    assert notes == {"a": "outer > middle > second inner", "b": "its own", "main": ""}
    assert "\n      waiting for outer > middle > second inner\n" in str(info.value)


def test_leaving_every_nested_note_clears_the_tasks_notes(xds_backend):
    async def main() -> None:
        rt = xds.current_runtime()
        with xds.waiting_for("outer"), xds.waiting_for("inner"):
            assert len(rt.waiting_notes) == 1
        assert rt.waiting_notes == {}
        await anyio.Event().wait()

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    assert [w.waiting_for for w in info.value.waiting] == [""]


@pytest.mark.parametrize(
    ("what", "got"),
    [
        (123, "got 123 (int)"),
        (None, "got None (NoneType)"),
        (b"bytes", "got b'bytes' (bytes)"),
        (lambda peer: f"credit from {peer}", "got a function that needs arguments"),
        (lambda *, peer: f"credit from {peer}", "got a function that needs arguments"),
    ],
)
def test_a_note_that_is_neither_text_nor_a_function_of_nothing_is_refused_at_the_call(what, got):
    expected = "what must be text (a str) or a function of no arguments returning text"

    async def main() -> None:
        with pytest.raises(ConfigError) as info, xds.waiting_for(what):
            pass
        assert info.value.field == "what"
        assert str(info.value).startswith(f"what: {expected}") and got in str(info.value)
        assert "\n" not in str(info.value)
        assert xds.current_runtime().waiting_notes == {}

    xds.run(main)
    with pytest.raises(ConfigError, match=re.escape(expected)), xds.waiting_for(what):
        pass  # outside a run too


def test_notes_that_are_functions_of_defaults_or_callable_objects_are_accepted():
    class Note:
        def __call__(self) -> str:
            return "an object's note"

    async def main() -> None:
        for what in (lambda s=3: f"slot {s}", Note(), str, "text"):
            with xds.waiting_for(what):
                pass
        with xds.waiting_for(lambda s=3: f"slot {s}"), xds.waiting_for(Note()):
            await anyio.Event().wait()

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main)
    assert [w.waiting_for for w in info.value.waiting] == ["slot 3 > an object's note"]


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


def _poll_forever(period_ns: int, cleaned: list[str] | None = None):
    """A model whose poller checks every ``period_ns`` for an event nobody sets."""

    async def main() -> None:
        ready = anyio.Event()

        async def poll() -> None:
            try:
                while not ready.is_set():
                    xds.emit("poller", "poll")
                    await xds.sleep_ns(period_ns)
            finally:
                if cleaned is not None:
                    cleaned.append("poller")

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, name="poller")
            with xds.waiting_for("the ready flag"):
                await ready.wait()

    return main


def test_a_fine_grained_poll_stops_at_the_time_step_limit(xds_backend):
    """A 1 us poll would take days of wall time to reach a one-day limit; the time-step limit
    ends it after so many jumps of the clock, with the time limit's report."""
    cleaned: list[str] = []
    with pytest.raises(ModelTimeStepLimit) as info:
        xds.run(
            _poll_forever(1_000, cleaned),
            backend=xds_backend,
            time_limit_ns=86_400 * 10**9,
            time_step_limit=5_000,
        )
    err = info.value
    assert isinstance(err, ModelTimeLimit)  # one of the run's limits, caught as such
    assert (err.t_ns, err.step_limit, err.limit_ns) == (5_000_000, 5_000, 86_400 * 10**9)
    assert {w.name for w in err.waiting} == {"poller", "main"}
    assert next(w for w in err.waiting if w.name == "main").waiting_for == "the ready flag"
    assert str(err).startswith("time-step limit of 5000 reached at t=5000000 ns")
    assert "poller: test_runtime_failures.py" in str(err)
    assert cleaned == ["poller"]  # the model unwound at the instant the limit was reached


def test_the_time_step_limit_counts_jumps_of_the_clock_not_timers(xds_backend):
    """Timers due at one nanosecond are one step; a run takes exactly its limit and no more,
    and the count is the same on both backends."""

    async def main() -> int:
        async def sleeper(i: int) -> None:
            for _ in range(10):
                await xds.sleep_ns(100)  # eight tasks, ten shared instants

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(sleeper, i)
        return xds.current_runtime().time_steps

    rt = xds.Runtime(backend=xds_backend, time_step_limit=10)
    assert rt.run(main) == 10 and rt.time_steps == 10 and rt.end_ns == 1_000
    with pytest.raises(ModelTimeStepLimit) as info:
        xds.run(main, backend=xds_backend, time_step_limit=9)
    assert info.value.t_ns == 900  # the tenth jump, to 1000 ns, was refused
    assert xds.run(main, backend=xds_backend) == 10  # no limit by default


def test_a_poll_that_keeps_polling_in_a_shield_still_stops_at_the_step_limit(xds_backend):
    async def main() -> None:
        with anyio.CancelScope(shield=True):
            while True:
                await xds.sleep_ns(1)

    with pytest.raises(ModelTimeStepLimit, match="time-step limit of 50 reached at t=50 ns"):
        xds.run(main, backend=xds_backend, time_step_limit=50)


def test_a_time_step_limit_report_is_deterministic():
    def report(backend: str) -> tuple[str, str]:
        rt = xds.Runtime(seed=3, backend=backend, time_step_limit=777)
        with pytest.raises(ModelTimeStepLimit) as info:
            rt.run(_poll_forever(1_000))
        return str(info.value), rt.events.digest()

    assert report("asyncio") == report("asyncio")
    assert report("trio") == report("trio")
    assert report("asyncio")[0] == report("trio")[0]  # the same instant on both backends


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1000", 10**6 + 0.0])
def test_a_bad_time_step_limit_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"^time_step_limit: time_step_limit must be a positive"):
        xds.run(_poll_forever(1), time_step_limit=bad)


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


def test_a_task_parked_with_sleep_forever_is_cancellable(xds_backend):
    """anyio's idiom: park a task with sleep_forever, cancel it later (no timer is armed)."""

    async def main() -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep_forever, name="parked")
            await xds.sleep_ns(1_000)
            tg.cancel_scope.cancel()
        with anyio.move_on_after(float("inf")):
            await xds.sleep_ns(5)
        return xds.now_ns()

    assert xds.run(main, backend=xds_backend) == 1_005


def test_sleeping_forever_alone_is_a_deadlock(xds_backend):
    with pytest.raises(ModelDeadlock):
        xds.run(anyio.sleep_forever, backend=xds_backend)


def test_time_stops_at_the_exact_horizon(xds_backend):
    """Past 2**22 s float seconds lose nanoseconds: the run stops there with a clear report
    instead of drifting (a huge finite sleep, or one beyond the horizon)."""
    from xds.runtime.loop import HORIZON_NS

    async def far() -> None:
        await anyio.sleep(1e300)

    async def just_beyond() -> None:
        await xds.sleep_ns(HORIZON_NS - 10)
        await xds.sleep_ns(20)

    for main in (far, just_beyond):
        with pytest.raises(ModelTimeLimit) as info:
            xds.run(main, backend=xds_backend)
        assert info.value.limit_ns == HORIZON_NS
        assert "horizon" in str(info.value)
    with pytest.raises(ModelTimeLimit) as info:  # the caller's own limit still wins
        xds.run(far, backend=xds_backend, time_limit_ns=1_000)
    assert info.value.limit_ns == 1_000


def test_a_replay_beyond_the_horizon_is_refused_up_front():
    from xds.errors import ConfigError
    from xds.serve.presets import pd_config
    from xds.serve.replay import replay
    from xds.trace.workload import fixed

    with pytest.raises(ConfigError) as info:
        replay(fixed(2000, 50, 3, rate_per_s=1e-7), pd_config("production-4p1d"))
    assert info.value.field == "arrival_ns" and "days" in str(info.value)


def test_waiting_for_outside_a_run_does_nothing():
    from xds.runtime import Barrier

    async def main() -> list[int]:
        barrier = Barrier(2)
        ranks: list[int] = []

        async def party() -> None:
            ranks.append(await barrier.wait())

        with xds.waiting_for("nothing"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(party)
                tg.start_soon(party)
        return sorted(ranks)

    assert anyio.run(main) == [0, 1]  # plain anyio: no xds run, no labels needed


def test_a_task_swallowing_cancellation_in_a_spin_still_ends_the_run(xds_backend):
    async def main() -> None:
        async def poller() -> None:
            while True:
                try:
                    await anyio.sleep(0)
                except anyio.get_cancelled_exc_class():  # a bug of the model: it swallows
                    pass  # the cancellation

        async with anyio.create_task_group() as tg:
            tg.start_soon(poller, name="poller")

    with pytest.raises(ModelLivelock) as info:
        xds.run(main, backend=xds_backend, livelock_limit=1000)
    assert "poller: test_runtime_failures.py" in str(info.value)  # names the spinning task
    assert any(t.name == "poller" for t in info.value.tasks)


def test_a_barrier_party_cancelled_at_the_instant_of_release_has_passed():
    from xds.runtime import Barrier

    async def main() -> list[tuple[int, int]]:
        barrier = Barrier(3)
        passed: list[tuple[int, int]] = []

        async def timed() -> None:
            with anyio.move_on_after(10e-9):  # its deadline is the release instant
                passed.append((0, await barrier.wait()))

        async def late(i: int) -> None:
            await xds.sleep_ns(10)
            passed.append((i, await barrier.wait()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(late, 1)
            tg.start_soon(late, 2)
            tg.start_soon(timed)
        return sorted(passed)

    assert xds.run(main) == [(0, 0), (1, 1), (2, 2)]  # nobody's rank is lost


def test_a_cancelled_timer_does_not_move_virtual_time(xds_backend):
    async def main() -> None:
        handle = xds.runtime.call_at_ns(10**9, lambda: None)
        await xds.sleep_ns(5)
        handle.cancel()
        await anyio.Event().wait()

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main, backend=xds_backend)
    assert info.value.t_ns == 5  # on trio too: the cancelled timer held no deadline


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_task_swallowing_cancellation_is_stopped_soon_and_named(backend):
    """A failed run cancels its tasks; one that catches the cancellation and waits again
    once spun up to livelock_limit (a million loop iterations, about a minute) before the
    run stopped, and the report did not say why."""

    async def stubborn() -> None:
        while True:
            try:
                await anyio.Event().wait()
            except anyio.get_cancelled_exc_class():
                continue

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stubborn, name="stubborn")

    rt = xds.Runtime(backend=backend)
    with pytest.raises(ModelDeadlock) as info:
        rt.run(main)
    (note,) = info.value.__notes__
    assert f"spun {UNWIND_SPIN_LIMIT:,} loop iterations" in note
    assert "catches the cancellation" in note and "stubborn" in note


def test_a_task_swallowing_every_exception_leaves_no_hang_behind_on_trio():
    """A trio task catching every exception in a loop (``except BaseException: pass``): the run
    ends with its report, and neither the next run nor the interpreter's exit hangs. (Collecting
    the abandoned trio run closed that coroutine outside any run, where its awaits raise at
    once: it spun in close() forever, at the next run or at exit.)"""
    import subprocess
    import sys
    import textwrap

    program = textwrap.dedent(
        """
        import anyio, xds
        from xds.errors import ModelDeadlock

        async def swallow():
            async def t():
                while True:
                    try:
                        await anyio.sleep_forever()
                    except BaseException:
                        pass
            async with anyio.create_task_group() as tg:
                tg.start_soon(t)
                await anyio.sleep_forever()

        async def five():
            await xds.sleep_ns(5)
            return xds.now_ns()

        try:
            xds.run(swallow, backend="trio")
        except ModelDeadlock:
            print("deadlock reported")
        print(xds.run(five, backend="asyncio"), xds.run(five, backend="trio"))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["deadlock reported", "5 5"]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_waiting_on_a_worker_thread_is_refused_at_the_call(backend):
    """A thread's result comes back in wall-clock time: whether the run deadlocked or went on
    once depended on the machine (on trio, 27 runs of 30 deadlocked)."""

    async def main() -> int:
        async def ticker() -> None:
            for _ in range(50):
                await xds.sleep_ns(1_000)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            return await anyio.to_thread.run_sync(sum, range(10))

    with pytest.raises(BaseExceptionGroup) as info:
        xds.run(main, backend=backend)
    (error,) = info.value.exceptions
    assert isinstance(error, ConfigError) and error.field == "to_thread"
    assert "anyio.to_thread.run_sync" in str(error)

    async def outside() -> int:  # outside a run, anyio's threads are anyio's own
        return await anyio.to_thread.run_sync(sum, range(10))

    assert anyio.run(outside, backend=backend) == 45


def test_trio_worker_threads_called_directly_are_refused_in_a_run():
    import trio

    async def main() -> int:
        return await trio.to_thread.run_sync(sum, range(10))

    with pytest.raises(ConfigError, match=r"trio\.to_thread\.run_sync") as info:
        xds.run(main, backend="trio")
    assert info.value.field == "to_thread"
    assert trio.run(main) == 45  # outside a run, trio's threads are trio's own


def test_asyncio_executors_are_refused_in_a_run():
    import asyncio

    async def main() -> int:
        return await asyncio.to_thread(sum, range(10))

    with pytest.raises(ConfigError, match=r"run_in_executor / asyncio\.to_thread"):
        xds.run(main)


def test_an_interrupt_raised_into_trios_loop_surfaces_as_itself():
    """A BaseException raised into trio's run loop from outside the model (pytest-timeout's
    Failed, from its signal handler) once surfaced as "internal error in Trio - please file
    a bug!". Here a timed callback, run by the clock inside trio's loop, raises one."""
    from xds.runtime.core import current_runtime

    class Interrupt(BaseException):
        pass

    def interrupt() -> None:
        raise Interrupt("from outside the model")

    async def main() -> None:
        current_runtime().call_at_ns(10, interrupt)
        await xds.sleep_ns(100)

    with pytest.raises(Interrupt, match="from outside the model") as info:
        xds.run(main, backend="trio")
    assert info.value.__cause__ is None


def test_a_model_calling_sys_exit_ends_the_run_as_itself_and_quietly(capfd, caplog):
    import gc
    import sys

    async def child():
        await xds.sleep_ns(10)
        sys.exit(3)  # say, from a policy the model calls

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
            await xds.sleep_ns(100)

    with pytest.raises(SystemExit) as exc:
        xds.run(main)
    assert exc.value.code == 3
    gc.collect()  # asyncio reports the root task's exception at shutdown or collection
    assert capfd.readouterr().err == ""
    assert not [r for r in caplog.records if r.name == "asyncio"]  # nor logs it
