"""XCCL point-to-point send/receive: protocol behaviour (SPEC 3.3-3.7)."""

from __future__ import annotations

import functools
import os

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xds
from xds.errors import ConfigError, ModelDeadlock, ProtocolError, XdsError
from xds.fabric import UBFabric
from xds.fabric.xccl import XCCL, AppBuffer
from xds.hw import CloudMatrix384
from xds.units import KiB, MiB

POD = CloudMatrix384(servers=4)


def fabric(**kw):
    kw.setdefault("app_bytes", 8 * MiB)
    return UBFabric(POD, **kw)


async def transfer(x, src, dst, payload, event_id=1, n_aiv=2, engine="mte", dst_off=2 * MiB):
    n = len(payload) if isinstance(payload, bytes) else payload
    if isinstance(payload, bytes):
        x.fabric.write_local(src, 0, payload)
    times = {}

    async def send():
        times["send"] = await x.send(
            src, dst, AppBuffer(0, n), event_id, n_aiv=n_aiv, engine=engine
        )

    async def receive():
        times["receive"] = await x.receive(
            dst, src, AppBuffer(dst_off, n), event_id, n_aiv=n_aiv, engine=engine
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        tg.start_soon(receive)
    return times


@pytest.mark.xds
@pytest.mark.parametrize("engine", ["mte", "dma"])
async def test_round_trip_delivers_every_byte(xds_backend, engine):
    async with XCCL(fabric()) as x:
        for n in (0, 1, 100, 4 * KiB, 300 * KiB + 17, 3 * MiB):
            data = os.urandom(n)
            await transfer(x, 0, 40, data, event_id=n + 1, n_aiv=4, engine=engine)
            assert x.fabric.read_local(40, 2 * MiB, n) == data
        x.monitor.check()


@pytest.mark.xds
async def test_send_completes_only_after_the_receive_acks(xds_backend):
    async with XCCL(fabric()) as x:
        times = await transfer(x, 0, 20, os.urandom(64 * KiB))
        assert times["send"] > times["receive"]  # the ACK travels back after the copy-out


@pytest.mark.xds
async def test_send_without_receive_never_completes_and_poisons_the_pair(xds_backend):
    async with XCCL(fabric()) as x:
        with anyio.move_on_after(0.001) as scope:
            await x.send(0, 20, AppBuffer(0, 4 * KiB), 9)
        assert scope.cancelled_caught
        assert xds.now_ns() == 1_000_000
        with pytest.raises(ProtocolError, match="abandoned"):
            await x.send(0, 20, AppBuffer(0, 4 * KiB), 10)
        await transfer(x, 0, 21, os.urandom(4 * KiB))  # other pairs are unaffected


@pytest.mark.xds
async def test_event_id_mismatch_fails_both_sides_and_leaves_the_ring_usable(xds_backend):
    async with XCCL(fabric(ring_slots=4, slot_bytes=8 * KiB, mte_chunk_bytes=8 * KiB)) as x:
        errors = []

        async def send():
            try:
                await x.send(0, 20, AppBuffer(0, 100 * KiB), 1)
            except ProtocolError as exc:
                errors.append(("send", str(exc)))

        async def receive():
            try:
                await x.receive(20, 0, AppBuffer(2 * MiB, 100 * KiB), 2)
            except ProtocolError as exc:
                errors.append(("receive", str(exc)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(receive)
        assert sorted(side for side, _ in errors) == ["receive", "send"]
        assert any("eventID mismatch" in text for _, text in errors)
        data = os.urandom(100 * KiB)  # the pair still works: the ring was drained
        await transfer(x, 0, 20, data, event_id=3)
        assert x.fabric.read_local(20, 2 * MiB, len(data)) == data
        x.monitor.check()


@pytest.mark.xds
async def test_wrong_buffer_size_is_a_protocol_error(xds_backend):
    async with XCCL(fabric()) as x:
        with pytest.raises(BaseExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.send, 0, 20, AppBuffer(0, 8 * KiB), 1)
                tg.start_soon(x.receive, 20, 0, AppBuffer(0, 4 * KiB), 1)
        assert info.group_contains(ProtocolError, match="8192")


@pytest.mark.xds
async def test_invalid_arguments_are_clear_errors(xds_backend):
    async with XCCL(fabric()) as x:
        with pytest.raises(ConfigError, match="dst 64 does not exist"):
            await x.send(0, 64, AppBuffer(0, 16), 1)
        with pytest.raises(ConfigError, match="n_aiv"):
            await x.send(0, 1, AppBuffer(0, 16), 1, n_aiv=0)
        with pytest.raises(ConfigError, match="eventID"):
            await x.send(0, 1, AppBuffer(0, 16), 0)
        with pytest.raises(ConfigError, match="outside the application region"):
            await x.send(0, 1, AppBuffer(8 * MiB - 8, 16), 1)
        with pytest.raises(ProtocolError, match="itself"):
            await x.send(3, 3, AppBuffer(0, 16), 1)
        with pytest.raises(ConfigError, match="engine"):
            await x.send(0, 1, AppBuffer(0, 16), 1, engine="rdma")  # type: ignore[arg-type]


@pytest.mark.xds
async def test_messages_larger_than_the_ring_flow_through_it(xds_backend):
    f = fabric(ring_slots=4, slot_bytes=4 * KiB, mte_chunk_bytes=4 * KiB)
    async with XCCL(f) as x:
        data = os.urandom(256 * KiB)  # 64 chunks through a 4-slot ring
        await transfer(x, 0, 33, data, n_aiv=8)
        assert f.read_local(33, 2 * MiB, len(data)) == data
        assert x.monitor.max_occupied[(0, 33)] <= 4
        x.monitor.check()


@pytest.mark.xds
async def test_pairs_are_isolated(xds_backend):
    f = fabric(ring_slots=2, slot_bytes=4 * KiB, mte_chunk_bytes=4 * KiB)
    async with XCCL(f) as x, anyio.create_task_group() as tg:
        # 0 -> 20 fills its ring and stalls: nobody receives
        tg.start_soon(x.send, 0, 20, AppBuffer(0, 64 * KiB), 1)
        await xds.sleep_ns(50_000)
        assert x.monitor.max_occupied[(0, 20)] == 2
        data = os.urandom(64 * KiB)  # 0 -> 21 is unaffected
        f.write_local(0, 1 * MiB, data)
        async with anyio.create_task_group() as inner:
            inner.start_soon(x.send, 0, 21, AppBuffer(1 * MiB, 64 * KiB), 2)
            inner.start_soon(x.receive, 21, 0, AppBuffer(2 * MiB, 64 * KiB), 2)
        assert f.read_local(21, 2 * MiB, 64 * KiB) == data
        tg.cancel_scope.cancel()


@pytest.mark.xds
async def test_sync_mode_holds_aivs_from_launch_to_return(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        ends = []

        async def pair(dst):
            times = await transfer(x, 0, dst, 1 * MiB, event_id=dst, n_aiv=32)
            ends.append(times["send"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(pair, 20)
            tg.start_soon(pair, 36)
        alone = (await transfer(x, 0, 52, 1 * MiB, event_id=99, n_aiv=32))["send"] - max(ends)
        # 32 + 32 > 48 AIVs: the second send waits for the first to return
        assert max(ends) >= 2 * alone - 1_000
        assert x.p2p.aivs(0).free == 48


@pytest.mark.xds
async def test_async_mode_posts_completions_and_does_not_hold_aivs(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        handles = [x.send_async(0, dst, AppBuffer(0, 1 * MiB), dst, n_aiv=32) for dst in (20, 36)]
        receives = [
            x.receive_async(dst, 0, AppBuffer(0, 1 * MiB), dst, n_aiv=32) for dst in (20, 36)
        ]
        done = [await h.wait() for h in handles + receives]
        assert all(c.ok for c in done)
        queue = x.completion_queue(0)
        got = [queue.receive_nowait(), queue.receive_nowait()]
        assert sorted(c.peer for c in got) == [20, 36]
        assert all(c.op == "send" and c.nbytes == 1 * MiB for c in got)
        assert x.completion_queue(20).receive_nowait().op == "receive"
        assert x.p2p.aivs(0).free == 48


@pytest.mark.xds
async def test_async_operations_on_a_pair_run_in_posting_order(xds_backend):
    """Whatever order the backend starts tasks in (trio shuffles them), sends and receives
    posted on one pair run in the order they were posted."""
    async with XCCL(fabric()) as x:
        sends = [x.send_async(0, 20, AppBuffer(i * KiB, KiB), 10 + i) for i in range(6)]
        receives = [x.receive_async(20, 0, AppBuffer(i * KiB, KiB), 10 + i) for i in range(6)]
        done = [await h.wait() for h in sends + receives]
        assert all(c.ok for c in done)
        queue = x.completion_queue(20)
        assert [queue.receive_nowait().event_id for _ in range(6)] == list(range(10, 16))
        ends = [c.end_ns for c in done[:6]]
        assert ends == sorted(ends)


@pytest.mark.xds
async def test_async_failure_is_reported_on_the_completion_queue(xds_backend):
    async with XCCL(fabric()) as x:
        h = x.send_async(0, 20, AppBuffer(0, 4 * KiB), 5)
        r = x.receive_async(20, 0, AppBuffer(0, 4 * KiB), 6)
        with pytest.raises(ProtocolError):
            await r.wait()
        with pytest.raises(ProtocolError):
            await h.wait()
        completion = x.completion_queue(0).receive_nowait()
        assert not completion.ok and "rejected" in completion.error


def test_async_needs_a_running_xccl():
    async def main():
        x = XCCL(fabric())
        with pytest.raises(XdsError, match="async with XCCL"):
            x.send_async(0, 1, AppBuffer(0, 16), 1)

    xds.run(main)


@pytest.mark.xds
async def test_each_transfer_is_exactly_two_copies(xds_backend):
    f = fabric(payload_mode="size")
    async with XCCL(f) as x:
        await transfer(x, 0, 20, 1 * MiB, n_aiv=8)
    assert f.stats.remote_bytes == 1 * MiB  # app -> remote managed
    assert f.stats.local_bytes == 1 * MiB  # managed -> app


def test_more_aivs_only_pay_off_for_large_messages():
    def latency(n, aivs):
        async def main():
            async with XCCL(fabric(payload_mode="size", app_bytes=16 * MiB)) as x:
                t = await transfer(x, 0, 20, n, n_aiv=aivs, dst_off=0)
                return t["send"]

        return xds.run(main)

    assert latency(4 * KiB, 48) >= latency(4 * KiB, 2) * 0.9
    assert latency(9 * MiB, 48) * 2.5 < latency(9 * MiB, 2)


@pytest.mark.xds
async def test_dma_path_skips_ubuf_and_pays_its_start_up(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        mte = await transfer(x, 0, 20, 4 * KiB, event_id=1, engine="mte")
        t0 = xds.now_ns()
        dma = await transfer(x, 0, 20, 4 * KiB, event_id=2, engine="dma")
        assert dma["send"] - t0 > mte["send"]
        assert dma["send"] - t0 > POD.engines.dma_startup_ns


# -- regressions found in review -------------------------------------------------------------


@pytest.mark.xds
async def test_cancelling_a_send_at_launch_never_leaks_aivs(xds_backend):
    async with XCCL(fabric()) as x:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.send, 0, 20, AppBuffer(0, 4 * KiB), 1)
                await anyio.lowlevel.checkpoint()
                scope.cancel()
        assert x.p2p.aivs(0).free == 48


@pytest.mark.xds
async def test_zero_byte_message_with_wrong_event_id_is_an_error_not_a_hang(xds_backend):
    async with XCCL(fabric()) as x:
        with pytest.raises(BaseExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.send, 0, 17, AppBuffer(0, 0), 1)
                tg.start_soon(x.receive, 17, 0, AppBuffer(0, 0), 2)
        assert info.group_contains(ProtocolError, match="eventID mismatch")


@pytest.mark.xds
async def test_a_posted_async_receive_holds_no_aivs_while_waiting(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        handle = x.receive_async(0, 17, AppBuffer(0, 64 * KiB), 5, n_aiv=48)
        await xds.sleep_ns(1_000)
        assert x.p2p.aivs(0).free == 48
        await transfer(x, 0, 17, 64 * KiB, event_id=6, n_aiv=48)  # die 0 can still send
        await x.send(17, 0, AppBuffer(0, 64 * KiB), 5, n_aiv=48)
        assert (await handle.wait()).ok


@pytest.mark.xds
async def test_reset_pair_recovers_after_a_timed_out_send(xds_backend):
    async with XCCL(fabric()) as x:
        with anyio.move_on_after(1e-4):
            await x.send(0, 20, AppBuffer(0, 4 * KiB), 1)
        with pytest.raises(ProtocolError):
            await x.send(0, 20, AppBuffer(0, 4 * KiB), 2)
        x.reset_pair(0, 20)
        data = os.urandom(4 * KiB)
        await transfer(x, 0, 20, data, event_id=3)
        assert x.fabric.read_local(20, 2 * MiB, len(data)) == data


def test_app_buffer_fields_are_validated():
    async def main():
        async with XCCL(fabric()) as x:
            with pytest.raises(ConfigError, match=r"AppBuffer\.offset"):
                await x.send(0, 1, AppBuffer(0.5, 64), 1)  # type: ignore[arg-type]

    xds.run(main)


def test_acks_travel_back_over_the_link():
    def send_time(dst_pod_kw):
        pod = CloudMatrix384(**dst_pod_kw)
        far = pod.n_pod_dies  # the first die of an attached 910B server (RoCE)

        async def main():
            async with XCCL(UBFabric(pod, app_bytes=1 * MiB, payload_mode="size")) as x:
                t = await transfer(x, 0, far if dst_pod_kw else 20, 4 * KiB, dst_off=0)
                return t["send"] - t["receive"]

        return xds.run(main)

    ub_gap = send_time({})
    roce_gap = send_time({"servers": 4, "attached_910b_servers": 1})
    assert ub_gap == POD.config.ub.latency_ns  # the ACK's one-way latency, not just t_meta
    assert roce_gap == POD.config.roce.latency_ns


# -- cancellation mid-message and recovery -----------------------------------------------------


@pytest.mark.xds
async def test_reset_pair_after_a_cancelled_large_send_waits_for_its_in_flight_writes(
    xds_backend,
):
    f = fabric(app_bytes=16 * MiB)
    n = 4 * MiB
    f.write_local(0, 0, os.urandom(n))
    async with XCCL(f) as x:
        with anyio.move_on_after(20e-6) as scope:  # the receiver is late: give up at 20 us
            await x.send(0, 20, AppBuffer(0, n), 1)
        assert scope.cancelled_caught
        ready = x.reset_pair(0, 20)  # at once: the cancelled send's writes are still in flight
        data = os.urandom(4 * KiB)
        f.write_local(0, n, data)
        times = {}

        async def send():
            times["send"] = await x.send(0, 20, AppBuffer(n, 4 * KiB), 2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(x.receive, 20, 0, AppBuffer(0, 4 * KiB), 2)
        assert f.read_local(20, 0, 4 * KiB) == data  # no stale chunk landed on the new message
        assert x.monitor.violations == []
        x.monitor.check()
        assert ready > 20_000  # re-initialised once the in-flight writes had landed ...
        assert times["send"] > ready  # ... and the new send waited for it


@pytest.mark.xds
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_receive_cancelled_mid_message_fails_its_sender_promptly(xds_backend, mode):
    async with XCCL(fabric(payload_mode="size")) as x:
        errors: list[tuple[int, str]] = []

        async def send():
            try:
                await x.send(0, 20, AppBuffer(0, 4 * MiB), 1)
            except ProtocolError as exc:
                errors.append((xds.now_ns(), str(exc)))

        async def receive():
            with anyio.move_on_after(20e-6) as scope:  # mid-message: 4 MiB takes ~130 us
                if mode == "sync":
                    await x.receive(20, 0, AppBuffer(0, 4 * MiB), 1)
                else:  # an async receive whose XCCL instance is torn down
                    async with XCCL(x.fabric, protocol=x.p2p) as rx:
                        await rx.receive_async(20, 0, AppBuffer(0, 4 * MiB), 1).wait()
            assert scope.cancelled_caught

        async def heartbeat():  # something else alive: a hang would not be a deadlock
            for _ in range(1_000):
                await xds.sleep_ns(1_000_000)

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            tg.start_soon(send)
            tg.start_soon(receive)
            while not errors and xds.now_ns() < 10_000_000:
                await xds.sleep_ns(1_000)
            tg.cancel_scope.cancel()
        assert len(errors) == 1
        when, text = errors[0]
        assert 20_000 < when < 30_000  # within a few microseconds of the cancel
        assert "pair 0->20" in text and "cancelled receive" in text
        assert "reset_pair(0, 20)" in text
        with pytest.raises(ProtocolError, match="cancelled receive"):  # the pair stays poisoned
            await x.send(0, 20, AppBuffer(0, 4 * KiB), 2)
        with pytest.raises(ProtocolError, match="cancelled receive"):
            await x.receive(20, 0, AppBuffer(0, 4 * KiB), 2)
        x.reset_pair(0, 20)  # and reset_pair recovers it
        await transfer(x, 0, 20, 64 * KiB, event_id=3)
        assert x.p2p.aivs(0).free == x.p2p.aivs(20).free == 48
        x.monitor.check()


@pytest.mark.xds
async def test_a_send_cancelled_mid_message_fails_its_receiver_promptly(xds_backend):
    async with XCCL(fabric()) as x:
        errors: list[tuple[int, str]] = []

        async def send():
            with anyio.move_on_after(20e-6):
                await x.send(0, 20, AppBuffer(0, 4 * MiB), 1)

        async def receive():
            try:
                await x.receive(20, 0, AppBuffer(0, 4 * MiB), 1)
            except ProtocolError as exc:
                errors.append((xds.now_ns(), str(exc)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(receive)
        assert len(errors) == 1
        when, text = errors[0]
        assert 20_000 < when < 30_000
        assert "pair 0->20" in text and "cancelled send" in text and "reset_pair" in text
        x.reset_pair(0, 20)
        data = os.urandom(300 * KiB)
        await transfer(x, 0, 20, data, event_id=2)
        assert x.fabric.read_local(20, 2 * MiB, len(data)) == data
        x.monitor.check()


@pytest.mark.xds
async def test_reset_pair_leaves_the_reverse_direction_alone(xds_backend):
    f = fabric(ring_slots=4, slot_bytes=4 * KiB, mte_chunk_bytes=4 * KiB)
    async with XCCL(f) as x:
        back = os.urandom(64 * KiB)  # 20 -> 0 fills its ring and waits for credits
        f.write_local(20, 0, back)
        async with anyio.create_task_group() as tg:
            tg.start_soon(x.send, 20, 0, AppBuffer(0, 64 * KiB), 1)
            with anyio.move_on_after(1e-4):  # 0 -> 20 is abandoned meanwhile
                await x.send(0, 20, AppBuffer(0, 4 * KiB), 2)
            x.reset_pair(0, 20)
            tg.start_soon(x.receive, 0, 20, AppBuffer(2 * MiB, 64 * KiB), 1)
        assert f.read_local(0, 2 * MiB, 64 * KiB) == back
        x.monitor.check()


@pytest.mark.xds
async def test_an_error_in_the_body_leaves_xccl_as_itself(xds_backend):
    """XCCL's own task group does not wrap the body's error in another exception group."""
    with pytest.raises(BaseExceptionGroup) as info:
        async with XCCL(fabric()) as x, anyio.create_task_group() as tg:
            tg.start_soon(x.send, 0, 20, AppBuffer(0, 8 * KiB), 1)
            tg.start_soon(x.receive, 20, 0, AppBuffer(0, 4 * KiB), 1)
    assert all(isinstance(e, ProtocolError) for e in info.value.exceptions)  # one level
    with pytest.raises(ConfigError, match="dst 64"):
        async with XCCL(fabric()) as x:
            await x.send(0, 64, AppBuffer(0, 16), 1)


@pytest.mark.xds
async def test_a_posted_receive_can_be_cancelled_and_its_completion_is_posted(xds_backend):
    async with XCCL(fabric()) as x:
        cq = x.completion_queue(17)
        handle = x.receive_async(17, 0, AppBuffer(0, 4 * KiB), 5)
        await xds.sleep_ns(1_000)
        handle.cancel()
        entry = await cq.receive()
        assert entry.op == "receive" and not entry.ok and entry.error == "cancelled"
        assert handle.done and handle.completion == entry
        with pytest.raises(ProtocolError, match=r"async receive of die 17 .* was cancelled"):
            await handle.wait()
        assert x.p2p.aivs(17).free == 48
        handle.cancel()  # a no-op once done
        data = os.urandom(4 * KiB)  # no message had started: the pair is untouched
        await transfer(x, 0, 17, data, event_id=6)
        assert x.fabric.read_local(17, 2 * MiB, len(data)) == data


@pytest.mark.xds
async def test_cancelling_an_async_send_mid_message_fails_the_receiver(xds_backend):
    async with XCCL(fabric(payload_mode="size")) as x:
        handle = x.send_async(0, 20, AppBuffer(0, 4 * MiB), 7)

        async def cancel_soon() -> None:
            await xds.sleep_ns(20_000)
            handle.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            with pytest.raises(ProtocolError, match="pair 0->20 was abandoned"):
                await x.receive(20, 0, AppBuffer(0, 4 * MiB), 7)
        assert 20_000 < xds.now_ns() < 40_000  # promptly, not at a timeout
        assert (await x.completion_queue(0).receive()).error == "cancelled"
        x.reset_pair(0, 20)
        await transfer(x, 0, 20, 64 * KiB, event_id=8)


# -- after the communicator closed -------------------------------------------------------------
@pytest.mark.xds
async def test_completions_are_drained_after_exit_in_order_then_the_queue_ends(xds_backend):
    async with XCCL(fabric()) as x:
        queue = x.completion_queue(0)
        sends = [x.send_async(0, 20, AppBuffer(i * KiB, KiB), 10 + i) for i in range(4)]
        for i in range(4):
            x.receive_async(20, 0, AppBuffer(i * KiB, KiB), 10 + i)
        first = await queue.receive()  # one read while open, the rest after exit
    assert first == sends[0].completion
    assert x.completion_queue(0) is queue
    assert [c async for c in queue] == [h.completion for h in sends[1:]]
    with pytest.raises(anyio.EndOfStream, match="completion queue of die 0: XCCL has closed"):
        await queue.receive()
    with pytest.raises(anyio.EndOfStream, match="4 completions were posted to it"):
        queue.receive_nowait()
    received = [c async for c in x.completion_queue(20)]  # never read while open
    assert [c.event_id for c in received] == [10, 11, 12, 13]
    assert all(c.op == "receive" and c.ok for c in received)


@pytest.mark.xds
async def test_a_reader_waiting_on_a_queue_ends_when_xccl_exits(xds_backend):
    got = []
    async with anyio.create_task_group() as tg:
        async with XCCL(fabric()) as x:

            async def collect() -> None:
                async for c in x.completion_queue(0):
                    got.append(c.event_id)

            tg.start_soon(collect)
            for i in range(3):
                x.send_async(0, 20, AppBuffer(0, KiB), 5 + i)
                x.receive_async(20, 0, AppBuffer(0, KiB), 5 + i)
        end = xds.now_ns()
    assert got == [5, 6, 7]  # the reader got them all, then its loop ended (no deadlock)
    assert xds.now_ns() == end


@pytest.mark.xds
async def test_queue_of_a_die_without_async_operations_is_empty_after_exit(xds_backend):
    async with XCCL(fabric()) as x:
        await transfer(x, 0, 20, KiB)  # synchronous: nothing on any queue
        early = x.completion_queue(20)
    for queue in (early, x.completion_queue(5)):
        with pytest.raises(anyio.EndOfStream, match="no completion was posted to it"):
            await queue.receive()
        assert [c async for c in queue] == []


@pytest.mark.xds
async def test_the_queue_of_a_die_that_does_not_exist_is_a_clear_error(xds_backend):
    async with XCCL(fabric()) as x:
        with pytest.raises(ConfigError, match="die 64 does not exist"):
            x.completion_queue(64)
    with pytest.raises(ConfigError, match="die 64 does not exist"):
        x.completion_queue(64)
    with pytest.raises(ConfigError, match="die must be an integer die index, got '0'"):
        x.completion_queue("0")


@pytest.mark.xds
async def test_sending_posting_or_reentering_after_exit_is_a_clear_error(xds_backend):
    async with XCCL(fabric()) as x:
        await transfer(x, 0, 20, KiB)
    t = xds.now_ns()
    buf = AppBuffer(0, KiB)
    with pytest.raises(XdsError, match=r"XCCL has closed: send_async\(\) after"):
        x.send_async(0, 20, buf, 2)
    with pytest.raises(XdsError, match=r"XCCL has closed: receive_async\(\) after"):
        x.receive_async(20, 0, buf, 2)
    with pytest.raises(XdsError, match=r"XCCL has closed: send\(\) after"):
        await x.send(0, 20, buf, 2)
    with pytest.raises(XdsError, match=r"XCCL has closed: receive\(\) after"):
        await x.receive(20, 0, buf, 2)
    with pytest.raises(XdsError, match="an XCCL is entered once"):
        async with x:
            pass
    assert xds.now_ns() == t  # refused at once, nothing waited
    async with XCCL(x.fabric) as again:  # the way to go on: the fabric's protocol state
        await transfer(again, 0, 20, KiB, event_id=3)
        assert again.monitor is x.monitor


@pytest.mark.xds
async def test_an_xccl_cannot_be_entered_twice_at_once(xds_backend):
    async with XCCL(fabric()) as x:
        with pytest.raises(XdsError, match="already open"):
            async with x:
                pass
        await transfer(x, 0, 20, KiB)  # the open one is unharmed


def test_waits_behind_a_previous_operation_on_the_pair_say_so():
    """A second send on a pair waits for the first (one message at a time), a send for AIVs,
    an async receive for the one posted before it, and a handle's wait for its operation: a
    deadlock names each."""

    async def main():
        async with XCCL(fabric()) as x, anyio.create_task_group() as tg:
            tg.start_soon(lambda: x.send(0, 20, AppBuffer(0, KiB), 1, n_aiv=48))  # all its AIVs
            await xds.sleep_ns(1)
            tg.start_soon(x.send, 0, 20, AppBuffer(0, KiB), 2)
            tg.start_soon(x.send, 0, 36, AppBuffer(0, KiB), 5)
            x.receive_async(17, 0, AppBuffer(0, KiB), 3)
            handle = x.receive_async(17, 0, AppBuffer(0, KiB), 4)
            await handle.wait()

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main)
    notes = " | ".join(w.waiting_for for w in info.value.waiting)
    assert (
        "send of die 0 (to 20, eventID 2): send of die 0 (to 20, eventID 1) posted before it to "
        "finish" in notes
    )
    assert "send eventID 5, die 0 -> die 36: 2 AIVs of die 0 (0 of 48 free)" in notes
    assert (
        "async receive of die 17 (from 0, eventID 4): async receive of die 17 (from 0, eventID "
        "3) posted before it to finish" in notes
    )
    assert "async receive of die 17 (from 0, eventID 4) to complete" in notes


# -- one protocol state per fabric ----------------------------------------------------------------
@pytest.mark.xds
async def test_a_fresh_xccl_on_a_used_fabric_goes_on(xds_backend):
    """The fabric's rings and metadata keep the pairs' sequence state: every XCCL(fabric)
    shares the fabric's one P2P (pairs, AIVs, monitor), so a new communicator just works."""
    fab = fabric()
    seen = []
    for i in range(3):
        async with XCCL(fab) as x:
            data = os.urandom(40 * KiB + i)
            await transfer(x, 0, 20, data, event_id=i + 1)
            assert fab.read_local(20, 2 * MiB, len(data)) == data
            h = x.send_async(0, 20, AppBuffer(0, KiB), 100 + i)
            await x.receive(20, 0, AppBuffer(0, KiB), 100 + i)
            assert (await h.wait()).ok
            seen.append(x)
    assert all(x.p2p is fab.p2p and x.monitor is fab.p2p.monitor for x in seen)
    assert fab.p2p.monitor.violations == []
    assert fab.p2p.aivs(0).free == fab.p2p.aivs(20).free == 48


def test_a_fabric_has_one_point_to_point_protocol():
    from xds.fabric.xccl import P2P

    fab = fabric()
    mine = P2P(fab)
    assert fab.p2p is mine and XCCL(fab).p2p is mine  # built first: XCCL(fabric) uses it
    with pytest.raises(ConfigError, match="already has its point-to-point protocol") as err:
        P2P(fab)
    assert err.value.field == "fabric" and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        XCCL(fab, protocol=P2P(fabric()))
    assert err.value.field == "protocol" and "another fabric" in str(err.value)
    with pytest.raises(ConfigError) as err:
        XCCL(fab, protocol="p2p")  # type: ignore[arg-type]
    assert err.value.field == "protocol"
    with pytest.raises(ConfigError) as err:
        XCCL(POD)  # type: ignore[arg-type]
    assert err.value.field == "fabric"


@pytest.fixture(scope="module")
def shared_fabric():
    return UBFabric(CloudMatrix384(servers=1), payload_mode="size")


async def _ping(fab) -> int:
    start = xds.now_ns()
    async with XCCL(fab) as x, anyio.create_task_group() as tg:
        tg.start_soon(x.send, 0, 1, AppBuffer(0, MiB), 1)
        tg.start_soon(x.receive, 1, 0, AppBuffer(0, MiB), 1)
    return xds.now_ns() - start


@pytest.mark.xds
@pytest.mark.parametrize("round_", [1, 2])
async def test_a_module_scoped_fabric_serves_every_test(xds_backend, shared_fabric, round_):
    """Each test is its own run (virtual time starts at 0 again): the fabric starts it idle,
    without the port bookings of an earlier timeline, its pairs re-initialised."""
    took = await _ping(shared_fabric)
    assert took == await _ping(UBFabric(CloudMatrix384(servers=1), payload_mode="size"))
    assert shared_fabric.p2p.monitor.violations == []


# -- posting order: sync and async operations on a pair ------------------------------------------
@pytest.mark.xds
async def test_a_sync_send_waits_for_an_async_send_posted_before_it(xds_backend):
    async with XCCL(fabric()) as x:
        x.fabric.write_local(0, 0, b"a" * 64 + b"b" * 64)
        h = x.send_async(0, 1, AppBuffer(0, 64), 1)  # posted first

        async def rx():
            await x.receive(1, 0, AppBuffer(4096, 64), 1)
            await x.receive(1, 0, AppBuffer(8192, 64), 2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(rx)
            await x.send(0, 1, AppBuffer(64, 64), 2)  # posted second
            assert h.done and h.completion.end_ns < xds.now_ns()
        assert x.fabric.read_local(1, 4096, 64) == b"a" * 64
        assert x.fabric.read_local(1, 8192, 64) == b"b" * 64


@pytest.mark.xds
async def test_two_xccls_side_by_side_keep_one_posting_order_per_pair(xds_backend):
    """Sends posted through two communicators on one pair go in the order they were posted:
    the order is the fabric's, not one XCCL's."""
    fab = fabric()
    fab.write_local(0, 0, b"a" * 64 + b"b" * 64)
    async with XCCL(fab) as first, XCCL(fab) as second:
        h1 = first.send_async(0, 1, AppBuffer(0, 64), 1)  # posted first, by one XCCL
        h2 = second.send_async(0, 1, AppBuffer(64, 64), 2)  # then by the other
        r1 = second.receive_async(1, 0, AppBuffer(4096, 64), 1)
        r2 = first.receive_async(1, 0, AppBuffer(8192, 64), 2)
        for h in (h1, h2, r1, r2):
            assert (await h.wait()).ok
    assert h1.completion.end_ns <= h2.completion.end_ns
    assert fab.read_local(1, 4096, 64) == b"a" * 64 and fab.read_local(1, 8192, 64) == b"b" * 64


def test_a_sync_operation_waiting_behind_an_async_one_says_so():
    async def main():
        async with XCCL(fabric()) as x:
            x.receive_async(17, 0, AppBuffer(0, KiB), 3)
            await x.receive(17, 0, AppBuffer(0, KiB), 4)

    with pytest.raises(ModelDeadlock) as info:
        xds.run(main)
    notes = " | ".join(w.waiting_for for w in info.value.waiting)
    assert (
        "receive of die 17 (from 0, eventID 4): async receive of die 17 (from 0, eventID 3) "
        "posted before it to finish" in notes
    )


_OP = st.tuples(st.booleans(), st.sampled_from([0, 3_000]), st.integers(1, 40 * KiB))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.tuples(_OP, _OP), min_size=1, max_size=6),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_sync_and_async_operations_on_a_pair_run_in_posting_order(ops, backend):
    """Message i's send and receive are each sync or async, posted after a gap: whatever the
    mix, the receives get the messages in the order the sends were posted, intact."""
    sizes = [send[2] for send, _ in ops]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    payloads = [bytes([i + 1]) * n for i, n in enumerate(sizes)]

    async def main():
        fab = fabric()
        for off, data in zip(offsets, payloads, strict=True):
            fab.write_local(0, off, data)
        sync_done: dict[tuple[str, int], int] = {}

        async def posted(op, name, i, *a, task_status=anyio.TASK_STATUS_IGNORED):
            task_status.started()  # carries straight on into the op: posted now
            sync_done[(name, i)] = await op(*a)

        async with XCCL(fab) as x, anyio.create_task_group() as tg:

            async def side(name, op, op_async, die, peer, base, pick):
                handles = {}
                for i, pair in enumerate(ops):
                    sync, gap, _ = pick(pair)
                    await xds.sleep_ns(gap)
                    buf = AppBuffer(base + offsets[i], sizes[i])
                    if sync:
                        await tg.start(posted, op, name, i, die, peer, buf, i + 1)
                    else:
                        handles[i] = op_async(die, peer, buf, i + 1)
                return handles

            results = {}

            async def run_side(*a):
                results[a[0]] = await side(*a)

            tg.start_soon(run_side, "send", x.send, x.send_async, 0, 20, 0, lambda p: p[0])
            tg.start_soon(
                run_side, "receive", x.receive, x.receive_async, 20, 0, 2 * MiB, lambda p: p[1]
            )
        for i, data in enumerate(payloads):
            assert fab.read_local(20, 2 * MiB + offsets[i], sizes[i]) == data
        ends = {
            key: sync_done.get(key) or results[key[0]][key[1]].completion.end_ns
            for key in [(n, i) for n in ("send", "receive") for i in range(len(ops))]
        }
        for name in ("send", "receive"):  # each completes after the one posted before it
            times = [ends[(name, i)] for i in range(len(ops))]
            assert times == sorted(times)
        assert fab.p2p.monitor.violations == []

    xds.run(main, backend=backend)


def test_a_receive_that_does_not_hold_its_aivs_takes_them_when_the_message_is_there():
    """hold_aivs=False: while the sender is late, the receiving die's AIVs stay free."""
    seen = {}

    async def main():
        fab = UBFabric(CloudMatrix384(servers=1), payload_mode="size")
        async with XCCL(fab) as x, anyio.create_task_group() as tg:
            tg.start_soon(
                functools.partial(x.receive, 1, 0, AppBuffer(0, KiB), 1, n_aiv=48, hold_aivs=False)
            )
            await xds.sleep_ns(50_000)
            seen["free while waiting"] = x.p2p.aivs(1).free
            await x.send(0, 1, AppBuffer(0, KiB), 1, n_aiv=48)
            with pytest.raises(ConfigError) as err:
                await x.receive(1, 0, AppBuffer(0, KiB), 2, hold_aivs="no")  # type: ignore[arg-type]
            seen["field"] = err.value.field

    xds.run(main)
    assert seen == {"free while waiting": 48, "field": "hold_aivs"}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=6),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_an_operation_cancelled_while_waiting_its_turn_lets_no_later_one_overtake(plan, backend):
    """Sends 2..n+1 on one pair, each sync or async, posted behind a 1 MiB send; those marked
    are cancelled at 1 us, while still waiting their turn (``Handle.cancel()``, or a cancel
    scope around a sync send). The receiver asks for the others in posting order and gets
    each one intact: a cancelled operation hands its turn on to the ones before it."""
    n_big = MiB

    async def main():
        fab = fabric()
        fab.write_local(0, 0, b"\x00" * n_big)
        for i in range(1, len(plan) + 1):
            fab.write_local(0, n_big + i * 64, bytes([i]) * 64)
        kept = [0] + [i + 1 for i, (_, cancel) in enumerate(plan) if not cancel]
        async with XCCL(fab) as x, anyio.create_task_group() as tg:
            x.send_async(0, 20, AppBuffer(0, n_big), 1)
            for i, (sync, cancel) in enumerate(plan, start=1):
                buf = AppBuffer(n_big + i * 64, 64)
                if sync:

                    async def send(
                        buf=buf, i=i, cancel=cancel, task_status=anyio.TASK_STATUS_IGNORED
                    ):
                        with anyio.CancelScope() as scope:
                            task_status.started(scope)
                            await x.send(0, 20, buf, i + 1)

                    scope = await tg.start(send)
                    if cancel:
                        tg.start_soon(_cancel_later, scope.cancel)
                else:
                    h = x.send_async(0, 20, buf, i + 1)
                    if cancel:
                        tg.start_soon(_cancel_later, h.cancel)
            got = []
            for i in kept:
                n = n_big if i == 0 else 64
                await x.receive(20, 0, AppBuffer(2 * MiB, n), i + 1)
                got.append(x.fabric.read_local(20, 2 * MiB, 1))
        assert got == [b"\x00"] + [bytes([i]) for i in kept[1:]]

    xds.run(main, backend=backend, time_limit_ns=10**9)


async def _cancel_later(cancel) -> None:
    await xds.sleep_ns(1_000)
    cancel()
