"""XCCL point-to-point with a failed die (``XCCL.fail_die`` / ``repair_die``): fail-stop, peers
learn of it after the in-flight writes and the detection delay, nothing hangs, repair recovers."""

from __future__ import annotations

import contextlib
import os

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xds
from xds.errors import ConfigError, DieFailure, ProtocolError
from xds.fabric import UBFabric
from xds.fabric.xccl import XCCL, AppBuffer
from xds.hw import CloudMatrix384
from xds.runtime import Runtime
from xds.units import KiB, MiB

POD = CloudMatrix384(servers=4)


def fabric(**kw):
    kw.setdefault("app_bytes", 8 * MiB)
    return UBFabric(POD, **kw)


async def fail_at(x: XCCL, die: int, when_ns: int, detect_ns: int = 0) -> None:
    await xds.sleep_until_ns(when_ns)
    x.fail_die(die, detect_ns=detect_ns)


async def outcome(coro) -> tuple[int, BaseException | int]:
    """(virtual time it ended, the error it raised or what it returned)."""
    try:
        result = await coro
    except ProtocolError as exc:
        return xds.now_ns(), exc
    return xds.now_ns(), result


async def both(x: XCCL, src: int, dst: int, nbytes: int, fail: tuple[int, int], detect_ns=0):
    """Send and receive ``nbytes`` while die ``fail[0]`` fails at ``fail[1]`` ns."""
    out: dict[str, tuple[int, BaseException | int]] = {}

    async def run(name, coro):
        out[name] = await outcome(coro)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "send", x.send(src, dst, AppBuffer(0, nbytes), 1))
        tg.start_soon(run, "receive", x.receive(dst, src, AppBuffer(0, nbytes), 1))
        tg.start_soon(fail_at, x, fail[0], fail[1], detect_ns)
    return out


@pytest.mark.xds
@pytest.mark.parametrize("dead", ["sender", "receiver"])
async def test_a_die_failing_mid_message_fails_both_sides_and_nothing_hangs(xds_backend, dead):
    async with XCCL(fabric(payload_mode="size")) as x:
        die = 0 if dead == "sender" else 20
        out = await both(x, 0, 20, 4 * MiB, (die, 20_000))  # 4 MiB takes ~130 us
        for side in ("send", "receive"):
            when, err = out[side]
            assert isinstance(err, DieFailure), (side, err)
            assert err.die == die and err.at_ns == 20_000
            assert f"die {die} failed at t=20000 ns" in str(err)
            assert "repair_die" in str(err)
            assert 20_000 <= when < 30_000  # promptly: no waiting for a timeout
        assert x.failed_dies() == {die: 20_000}
        assert x.p2p.aivs(0).free == x.p2p.aivs(20).free == 48  # no AIV leaks


@pytest.mark.xds
async def test_the_failed_die_stops_writing_at_once_and_its_peer_learns_later(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        out = await both(x, 0, 20, 4 * MiB, (0, 20_000), detect_ns=500_000)
        send_t, send_err = out["send"]
        recv_t, recv_err = out["receive"]
        # the dead die: as soon as the chunk it was moving is out (it issues no other)
        assert isinstance(send_err, DieFailure) and 20_000 <= send_t < 21_000
        assert isinstance(recv_err, DieFailure)
        assert 520_000 <= recv_t < 530_000  # the peer: detection delay after the failure
        # nothing the failed die issued after its failure reached the receiver's ring
        assert x.fabric.stats.remote_bytes < 4 * MiB


@pytest.mark.xds
async def test_a_message_that_arrived_before_the_sender_failed_still_completes(xds_backend):
    async with XCCL(fabric()) as x:
        data = os.urandom(64 * KiB)
        x.fabric.write_local(0, 0, data)
        out: dict[str, tuple[int, BaseException | int]] = {}

        async def receive():
            out["receive"] = await outcome(x.receive(20, 0, AppBuffer(4 * MiB, len(data)), 7))

        async def send():
            out["send"] = await outcome(x.send(0, 20, AppBuffer(0, len(data)), 7))

        async def crash_after_the_data_is_out():
            # the sender's data is visible after ~4 us; its final ACK has not come back yet
            while x.fabric.stats.remote_bytes < len(data):
                await xds.sleep_ns(100)
            await xds.sleep_ns(1_500)
            x.fail_die(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            tg.start_soon(send)
            tg.start_soon(crash_after_the_data_is_out)
        assert isinstance(out["receive"][1], int)  # delivered in full
        assert x.fabric.read_local(20, 4 * MiB, len(data)) == data
        assert isinstance(out["send"][1], DieFailure)  # the dead die never sees the ACK


@pytest.mark.xds
async def test_a_receive_waiting_for_a_send_from_a_failed_die_fails_instead_of_hanging(
    xds_backend,
):
    async with XCCL(fabric()) as x:
        out: dict[str, tuple[int, BaseException | int]] = {}

        async def receive():
            out["receive"] = await outcome(x.receive(20, 0, AppBuffer(0, KiB), 1))

        async def posted():
            h = x.receive_async(30, 0, AppBuffer(0, KiB), 2)
            with contextlib.suppress(ProtocolError):
                await h.wait()
            out["posted"] = (xds.now_ns(), h.completion)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            tg.start_soon(posted)
            await xds.sleep_ns(10_000)
            x.fail_die(0, detect_ns=40_000)
        when, err = out["receive"]
        assert isinstance(err, DieFailure) and 50_000 <= when < 52_000
        when, completion = out["posted"]
        assert completion is not None and not completion.ok
        assert "die 0 failed" in completion.error and 50_000 <= when < 52_000
        assert x.completion_queue(30).receive_nowait() == completion


@pytest.mark.xds
async def test_operations_started_after_the_failure_wait_to_learn_of_it_then_fail(xds_backend):
    async with XCCL(fabric()) as x:
        x.fail_die(5, detect_ns=10_000)
        t, err = await outcome(x.send(5, 6, AppBuffer(0, KiB), 1))  # the failed die: at once
        assert isinstance(err, DieFailure) and t == 0
        t, err = await outcome(x.send(6, 5, AppBuffer(0, KiB), 1))  # a peer: once it knows
        assert isinstance(err, DieFailure) and 10_000 < t < 12_000
        t, err = await outcome(x.receive(7, 5, AppBuffer(0, KiB), 1))  # already known
        assert isinstance(err, DieFailure) and t == xds.now_ns()
        assert isinstance(await transfer_ok(x, 6, 7), int)  # other pairs are untouched
        assert x.failed_dies() == {5: 0}


async def transfer_ok(x: XCCL, src: int, dst: int) -> int:
    async with anyio.create_task_group() as tg:
        tg.start_soon(x.send, src, dst, AppBuffer(0, 4 * KiB), 9)
        end = await x.receive(dst, src, AppBuffer(0, 4 * KiB), 9)
    return end


@pytest.mark.xds
async def test_repair_brings_the_die_back_on_fresh_pairs(xds_backend):
    async with XCCL(fabric()) as x:
        out = await both(x, 0, 20, 4 * MiB, (20, 20_000))
        assert isinstance(out["send"][1], DieFailure)
        ready = x.repair_die(20)
        assert ready >= xds.now_ns()  # the pair is re-initialised once in-flight writes land
        assert x.failed_dies() == {}
        data = os.urandom(300 * KiB)
        x.fabric.write_local(0, 0, data)
        await anyio.sleep(0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(x.send, 0, 20, AppBuffer(0, len(data)), 2)
            tg.start_soon(x.receive, 20, 0, AppBuffer(5 * MiB, len(data)), 2)
        assert x.fabric.read_local(20, 5 * MiB, len(data)) == data
        assert xds.now_ns() > ready
        x.monitor.check()


@pytest.mark.xds
async def test_repair_and_fail_refuse_what_cannot_be_done(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        with pytest.raises(ProtocolError, match="die 3 has not failed"):
            x.repair_die(3)
        with pytest.raises(ConfigError, match="detect_ns"):
            x.fail_die(3, detect_ns=-1)
        with pytest.raises(ConfigError, match="die"):
            x.fail_die(10_000)
        x.fail_die(3)
        with pytest.raises(ProtocolError, match="die 3 already failed at t=0 ns"):
            x.fail_die(3)

        async def slow_peer():  # a peer that only learns after 1 ms
            await outcome(x.send(4, 3, AppBuffer(0, 4 * MiB), 1))

        x.repair_die(3)
        x.fail_die(3, detect_ns=1_000_000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow_peer)
            await xds.sleep_ns(1_000)
            with pytest.raises(ProtocolError, match="while operations on pair"):
                x.repair_die(3)  # the peer's send is still running: it has not learnt yet
        x.repair_die(3)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_die_failure_run_is_deterministic_and_logged(backend):
    async def scenario():
        async with XCCL(fabric(payload_mode="size")) as x:
            out = await both(x, 0, 20, 4 * MiB, (20, 33_333), detect_ns=7)
            x.repair_die(20)
            return {k: (t, str(e)) for k, (t, e) in out.items()}

    results, digests = [], []
    for _ in range(2):
        rt = Runtime(seed=3, backend=backend)
        results.append(rt.run(scenario))
        digests.append(rt.events.digest())
        kinds = [(e.event, e.fields) for e in rt.events if e.event.startswith("die_")]
        assert kinds == [("die_failed", {"die": 20, "detect_ns": 7}), ("die_repaired", {"die": 20})]
    assert results[0] == results[1] and digests[0] == digests[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nbytes=st.sampled_from([0, 1, 4 * KiB, 300 * KiB, 2 * MiB]),
    n_aiv=st.sampled_from([1, 2, 8]),
    victim=st.sampled_from([0, 20, 33]),  # the sender, the receiver, a bystander
    fail_ns=st.integers(0, 80_000),
    detect_ns=st.integers(0, 50_000),
    async_receive=st.booleans(),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_whenever_a_die_fails_every_operation_ends_and_repair_recovers(
    nbytes, n_aiv, victim, fail_ns, detect_ns, async_receive, backend
):
    """A die fails at a random moment of a transfer: both sides end (delivered intact, or
    DieFailure naming the die; a bystander's failure changes nothing), no AIV leaks, and after
    the repair the same pair carries a message intact."""
    data = os.urandom(nbytes)

    async def main():
        fab = fabric()
        fab.write_local(0, 0, data)
        out: dict[str, BaseException | int] = {}
        after: list[str] = []  # what the failed die started writing after it failed
        mte, meta = fab.mte_transfer, fab.post_meta

        def watched_mte(src, dst, size, **kw):
            if src in fab.p2p.failed_dies():
                after.append(f"data {src}->{dst}")
            return mte(src, dst, size, **kw)

        def watched_meta(when, owner, writer, *a, **kw):
            if writer in fab.p2p.failed_dies():
                after.append(f"metadata {writer}->{owner}")
            return meta(when, owner, writer, *a, **kw)

        fab.mte_transfer, fab.post_meta = watched_mte, watched_meta
        async with XCCL(fab) as x:

            async def send():
                out["send"] = (await outcome(x.send(0, 20, AppBuffer(0, nbytes), 1, n_aiv=n_aiv)))[
                    1
                ]

            async def receive():
                buf = AppBuffer(4 * MiB, nbytes)
                if async_receive:
                    h = x.receive_async(20, 0, buf, 1, n_aiv=n_aiv)
                    with contextlib.suppress(ProtocolError):
                        await h.wait()
                    out["receive"] = h.error if h.error is not None else h.completion.end_ns
                else:
                    out["receive"] = (await outcome(x.receive(20, 0, buf, 1, n_aiv=n_aiv)))[1]

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                tg.start_soon(receive)
                tg.start_soon(fail_at, x, victim, fail_ns, detect_ns)
            for side in ("send", "receive"):
                result = out[side]
                if victim == 33:
                    assert isinstance(result, int)
                else:
                    assert isinstance(result, int | DieFailure), result
                    if isinstance(result, DieFailure):
                        assert result.die == victim and result.at_ns == fail_ns
            if isinstance(out["receive"], int):
                assert fab.read_local(20, 4 * MiB, nbytes) == data
            assert x.p2p.aivs(0).free == x.p2p.aivs(20).free == 48
            assert after == []  # fail-stop: no chunk, credit, tailPtr or ACK after the failure
            ready = x.repair_die(victim)
            await xds.sleep_until_ns(ready)
            fab.write_local(20, 4 * MiB, bytes(nbytes))
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.send, 0, 20, AppBuffer(0, nbytes), 2)
                tg.start_soon(x.receive, 20, 0, AppBuffer(4 * MiB, nbytes), 2)
            assert fab.read_local(20, 4 * MiB, nbytes) == data
        assert fab.p2p.monitor.violations == []

    xds.run(main, backend=backend)


@pytest.mark.xds
async def test_a_receive_waiting_on_a_pair_a_cancelled_send_abandoned_fails_promptly(xds_backend):
    """The sender gives up on its final ACK (cancelled) after the receiver got the message: a
    second receive already waiting for the next send on that pair fails once the abort notice
    lands, instead of waiting for a send that can never come."""
    async with XCCL(fabric(payload_mode="size")) as x:
        scope = anyio.CancelScope()
        out = {}

        async def send():
            with scope:
                await x.p2p.send(0, 20, AppBuffer(0, 64 * KiB), 1)

        async def receives():
            await x.p2p.receive(20, 0, AppBuffer(0, 64 * KiB), 1)
            scope.cancel()
            out["second"] = await outcome(x.p2p.receive(20, 0, AppBuffer(0, KiB), 2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(receives)
        when, err = out["second"]
        assert isinstance(err, ProtocolError) and not isinstance(err, DieFailure)
        assert "abandoned by a cancelled send" in str(err) and when < 20_000


@pytest.mark.xds
async def test_a_sender_failing_during_its_launch_posts_nothing_even_an_empty_message(
    xds_backend,
):
    async with XCCL(fabric(payload_mode="size")) as x:
        out = await both(x, 0, 20, 0, (0, 1), detect_ns=100_000)
        send_t, send_err = out["send"]
        recv_t, recv_err = out["receive"]
        assert isinstance(send_err, DieFailure) and send_t < 5_000
        assert isinstance(recv_err, DieFailure) and 100_000 < recv_t < 105_000  # when it knows


@pytest.mark.xds
async def test_each_die_names_its_own_failure_before_a_peers_it_cannot_know_yet(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        out = {}

        async def fail_both():
            await xds.sleep_until_ns(20_000)
            x.fail_die(20, detect_ns=1_000_000)  # die 0 would learn of it after ~1 ms
            await xds.sleep_until_ns(30_000)
            x.fail_die(0)

        async def run(name, coro):
            out[name] = await outcome(coro)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "send", x.send(0, 20, AppBuffer(0, 4 * MiB), 1))
            tg.start_soon(run, "receive", x.receive(20, 0, AppBuffer(0, 4 * MiB), 1))
            tg.start_soon(fail_both)
        assert out["receive"][1].die == 20 and out["receive"][0] < 21_000
        assert out["send"][1].die == 0 and 30_000 <= out["send"][0] < 31_000


def test_a_later_run_on_the_same_fabric_sees_no_earlier_failure_from_the_start():
    fab = fabric()

    async def first():
        async with XCCL(fab) as x:
            x.fail_die(1)
            return x.failed_dies()

    async def second():
        async with XCCL(fab) as x:
            return x.failed_dies(), x.p2p.aivs(1).free

    assert xds.run(first) == {1: 0}
    assert xds.run(second) == ({}, 48)  # before any operation of this run
