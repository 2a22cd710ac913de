"""The UB fabric: lazy die memory, posted writes, costs, contention, payload modes."""

from __future__ import annotations

import anyio
import pytest

import xds
from xds.errors import ConfigError
from xds.fabric import META_FIELD_BYTES, UBFabric
from xds.fabric.memory import META_FORMAT, Direction
from xds.hw import CloudMatrix384
from xds.units import KiB, MiB

POD = CloudMatrix384(servers=4)  # 64 dies


def run(main, backend="asyncio"):
    return xds.run(main, backend=backend)


def test_a_full_pod_allocates_nothing_until_touched():
    fabric = UBFabric(CloudMatrix384())
    mems = [fabric.memory(d) for d in range(768)]
    assert sum(m.allocated_bytes for m in mems) == 0
    fabric.memory(5).meta(9, 3, Direction.RX)
    assert fabric.memory(5).allocated_bytes == META_FIELD_BYTES
    fabric.memory(5).slot(9, 3)
    assert fabric.memory(5).allocated_bytes == META_FIELD_BYTES + fabric.config.slot_bytes


def test_metadata_field_is_32_bytes_in_spec_layout():
    field = UBFabric(POD).memory(0).meta(1, 0, Direction.TX)
    field.event_id, field.chunk_id, field.flags, field.tail_ptr, field.ack = 7, 3, 2, 4096, 1024
    raw = field.pack()
    assert len(raw) == 32
    assert META_FORMAT.unpack(raw) == (7, 3, 2, 4096, 1024)


def test_size_mode_holds_no_data():
    fabric = UBFabric(POD, payload_mode="size")
    with pytest.raises(ConfigError, match="size"):
        fabric.memory(0).app  # noqa: B018


@pytest.mark.xds
async def test_remote_write_is_invisible_until_completion(xds_backend):
    fabric = UBFabric(POD, app_bytes=1 * MiB)
    fabric.write_local(17, 0, b"old!" * 16)
    t = fabric.post_write(0, 17, 0, b"new!" * 16)
    assert t.visible_ns > t.end_ns > 0
    await xds.sleep_until_ns(t.visible_ns - 1)
    assert fabric.read_local(17, 0, 64) == b"old!" * 16  # a reader polling early sees old bytes
    await xds.sleep_ns(1)
    assert fabric.read_local(17, 0, 64) == b"new!" * 16


@pytest.mark.xds
async def test_remote_read_sees_bytes_visible_when_it_arrives(xds_backend):
    fabric = UBFabric(POD, app_bytes=1 * MiB)
    fabric.write_local(33, 128, b"abcd")
    data = await fabric.read(0, 33, 128, 4)
    assert data == b"abcd"
    assert xds.now_ns() > POD.config.ub.latency_ns


def _time_of(fn, *args):
    async def main():
        fabric = UBFabric(POD, app_bytes=4 * MiB, payload_mode="size")
        await fn(fabric, *args)
        return xds.now_ns()

    return xds.run(main)


async def _writes(fabric, pairs, nbytes, engine="mte", aivs=16):
    async with anyio.create_task_group() as tg:
        for src, dst in pairs:
            tg.start_soon(
                lambda s=src, d=dst: fabric.write(s, d, 0, nbytes, engine=engine, aivs=aivs)
            )


def test_concurrent_writes_into_one_die_share_its_ingress():
    one = _time_of(_writes, [(0, 20)], 2 * MiB)
    two = _time_of(_writes, [(0, 20), (40, 20)], 2 * MiB)
    apart = _time_of(_writes, [(0, 20), (40, 60)], 2 * MiB)
    assert two > 1.8 * one - 5_000  # two flows into one ingress take about twice as long
    assert apart < 1.05 * one  # disjoint pairs do not interfere


def test_port_throughput_never_exceeds_link_bandwidth():
    fabric_bw = POD.config.ub.bandwidth
    nbytes = 4 * MiB
    t = _time_of(_writes, [(s, 20) for s in (0, 16, 32, 48, 2, 18)], nbytes)
    assert 6 * nbytes / (t / 1e9) <= fabric_bw * 1.0001


def test_transfer_time_is_uniform_across_the_pod():
    near = _time_of(_writes, [(0, 2)], 1 * MiB)  # same server, other chip
    far = _time_of(_writes, [(0, 63)], 1 * MiB)  # other server
    assert near == far


def test_dma_starts_slower_but_is_not_bound_by_aivs():
    small_mte = _time_of(_writes, [(0, 20)], 4 * KiB, "mte", 1)
    small_dma = _time_of(_writes, [(0, 20)], 4 * KiB, "dma", 1)
    big_mte = _time_of(_writes, [(0, 20)], 4 * MiB, "mte", 1)
    big_dma = _time_of(_writes, [(0, 20)], 4 * MiB, "dma", 1)
    assert small_dma > small_mte
    assert big_dma < big_mte


@pytest.mark.parametrize("mode", ["bytes", "size"])
def test_payload_modes_have_identical_timing(mode):
    async def main():
        fabric = UBFabric(POD, app_bytes=2 * MiB, payload_mode=mode)
        data = b"x" * (1 * MiB) if mode == "bytes" else 1 * MiB
        await fabric.write(0, 30, 0, data, aivs=4)
        await fabric.write(30, 0, 0, data, engine="dma")
        return xds.now_ns()

    assert xds.run(main) == _reference_mode_time()


def _reference_mode_time():
    async def main():
        fabric = UBFabric(POD, app_bytes=2 * MiB, payload_mode="size")
        await fabric.write(0, 30, 0, 1 * MiB, aivs=4)
        await fabric.write(30, 0, 0, 1 * MiB, engine="dma")
        return xds.now_ns()

    return xds.run(main)


def test_an_mte_operation_larger_than_half_a_ubuf_is_rejected():
    from xds.errors import ProtocolError

    fabric = UBFabric(POD)
    with pytest.raises(ProtocolError, match="half a UBuf"):
        fabric.mte_transfer(0, 1, 1 * MiB, start_ns=0, op_bytes=128 * KiB)
    t = fabric.mte_transfer(0, 1, 1 * MiB, start_ns=0, op_bytes=96 * KiB)
    assert t.end_ns > 0


def test_aivs_split_a_transfer_and_only_those_with_an_operation_speed_it_up():
    one_op = [_time_of(_writes, [(0, 20)], 32 * KiB, "mte", a) for a in (1, 2, 48)]
    # 32 KiB split over 2 AIVs is two 16 KiB operations, over 48 it is 64 of the 512-byte
    # minimum: more AIVs never slow it, each one's first load is its own share
    assert one_op[0] > one_op[1] > one_op[2]
    tiny = [_time_of(_writes, [(0, 20)], 512, "mte", a) for a in (1, 48)]
    assert tiny[0] == tiny[1]  # one minimum-size operation: one AIV's work


def test_xccl_dma_path_carries_bulk_messages_near_the_link_rate():
    from xds.fabric.xccl import XCCL, AppBuffer

    def latency(nbytes, engine):
        async def main():
            async with XCCL(UBFabric(POD, payload_mode="size", app_bytes=64 * MiB)) as x:
                buf = AppBuffer(0, nbytes)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: x.send(0, 40, buf, 7, n_aiv=48, engine=engine))
                    tg.start_soon(lambda: x.receive(40, 0, buf, 7, n_aiv=48, engine=engine))
                return xds.now_ns()

        return xds.run(main)

    nbytes = 48 * MiB
    dma = latency(nbytes, "dma")
    # the DMA engines' descriptors run at link rate and the receiver's 48 AIVs copy out of
    # the ring: the DMA start-up is the only extra over the MTE path
    assert nbytes / (dma / 1e9) > 0.9 * POD.config.ub.bandwidth
    assert dma < latency(nbytes, "mte") + 2 * POD.engines.dma_startup_ns


def test_bad_fabric_arguments_are_clear_errors():
    for pod in (None, "pod"):
        with pytest.raises(ConfigError, match=r"^pod: must be a CloudMatrix384"):
            UBFabric(pod)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^fabric\.app_bytes: .* exceeds a die.s HBM"):
        UBFabric(POD, app_bytes=1 << 40)
    with pytest.raises(ConfigError, match="half a UBuf"):
        UBFabric(POD, mte_chunk_bytes=128 * KiB, slot_bytes=256 * KiB)
    # attached 910B dies with a smaller UBuf bound the chunks too (a chunk sized for the 910C
    # once failed mid-message on a 910B die, leaving its peer waiting)
    import msgspec

    from xds.hw.specs import ASCEND_910B2

    small = msgspec.structs.replace(ASCEND_910B2, ubuf_bytes=32 * KiB)
    mixed = CloudMatrix384(servers=1, attached_910b_servers=1, b_die=small)
    assert UBFabric(mixed).config.mte_chunk_bytes == 16 * KiB
    with pytest.raises(ConfigError, match=r"half a UBuf \(16384 bytes\)"):
        UBFabric(mixed, mte_chunk_bytes=32 * KiB)
    with pytest.raises(ConfigError, match="unknown fabric parameter"):
        UBFabric(POD, ring_slot=3)
    with pytest.raises(ConfigError, match="slot_bytes"):
        UBFabric(POD, slot_bytes=100)

    async def main():
        fabric = UBFabric(POD, app_bytes=1 * KiB)
        with pytest.raises(ConfigError, match="outside the application region"):
            fabric.post_write(0, 1, 1000, b"x" * 100)
        with pytest.raises(ConfigError, match="does not exist"):
            fabric.post_write(0, 64, 0, b"x")
        with pytest.raises(ConfigError, match=r"^aivs: must be an integer in 1\.\.48 \(the AIVs"):
            fabric.post_write(0, 1, 0, b"x", aivs=49)
        with pytest.raises(ConfigError, match="real data"):
            fabric.post_write(0, 1, 0, 10)

    xds.run(main)


def test_call_at_ns_runs_callbacks_in_order_on_both_backends(xds_backend):
    async def main():
        seen = []
        rt = xds.current_runtime()
        for i, t in enumerate((30, 10, 30, 20, 10)):
            rt.call_at_ns(t, lambda i=i: seen.append((xds.now_ns(), i)))
        cancelled = rt.call_at_ns(15, lambda: seen.append("cancelled"))
        cancelled.cancel()
        await xds.sleep_ns(100)
        return seen

    assert xds.run(main, backend=xds_backend) == [(10, 1), (10, 4), (20, 3), (30, 0), (30, 2)]


def test_a_failing_callback_fails_the_run(xds_backend):
    async def main():
        xds.current_runtime().call_at_ns(5, lambda: 1 / 0)
        await xds.sleep_ns(10)

    with pytest.raises(ZeroDivisionError):
        xds.run(main, backend=xds_backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_write_is_visible_when_write_returns_and_at_its_visible_ns_on_every_schedule(backend):
    """The fabric applies a write at its visibility instant; a task waking at that instant
    (``await fabric.write``, or a sleep until ``visible_ns``) sees it. On trio the write is a
    timed callback and the waking task a sleeper: the callback must run first, whatever the
    schedule seed orders."""

    async def main():
        fab = UBFabric(POD)
        seen = []
        for i in range(12):
            await fab.write(0, 11 + i, 0, bytes([i + 1]) * 8)
            seen.append(fab.read_local(11 + i, 0, 8) == bytes([i + 1]) * 8)
            t = fab.post_write(1, 40 + i, 0, b"W" * 8)
            await xds.sleep_until_ns(t.visible_ns - 1)
            seen.append(fab.read_local(40 + i, 0, 8) == bytes(8))  # not a nanosecond early
            await xds.sleep_until_ns(t.visible_ns)
            seen.append(fab.read_local(40 + i, 0, 8) == b"W" * 8)
        return seen

    for seed in range(6):
        assert all(xds.run(main, backend=backend, seed=seed))


def test_mte_cost_never_falls_with_more_bytes_nor_rises_with_more_aivs():
    def cost(nbytes: int, aivs: int) -> int:
        fabric = UBFabric(POD, payload_mode="size")  # idle ports for every transfer
        return fabric.mte_transfer(0, 1, nbytes, start_ns=0, aivs=aivs).end_ns

    sizes = sorted({n + d for n in (512, 1024, 4096, 32 * KiB, 1 * MiB) for d in (-1, 0, 1)})
    sizes += [k * 777 for k in range(1, 40)]
    sizes.sort()
    for aivs in (1, 2, 3, 4, 16, 48):
        times = [cost(n, aivs) for n in sizes]
        assert times == sorted(times), aivs
    for n in sizes:
        times = [cost(n, a) for a in (1, 2, 3, 4, 16, 48)]
        assert times == sorted(times, reverse=True), n
