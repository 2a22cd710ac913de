"""SPEC 11.3 "Link probing": a dummy payload through a DistFlow pair tells saturation from a
broken link."""

from __future__ import annotations

import anyio
import pytest

from xds.errors import ConfigError
from xds.hw import PodConfig
from xds.runtime import now_ns, run, sleep_ns
from xds.serve.distflow import DistFlow, TransferState
from xds.serve.probe import LinkMonitor, LinkVerdict, ProbeConfig, probe
from xds.units import MS

POD = PodConfig()


def _flow() -> DistFlow:
    return DistFlow(
        0, tp=1, link=POD.ub, engines=POD.engines, prefill_dps=2, decode_dps=2, decode_te=0
    )


def test_a_healthy_pair_delivers_the_probe_at_normal_latency(xds_backend):
    async def main():
        return await probe(_flow())

    res = run(main, backend=xds_backend)
    assert res.verdict is LinkVerdict.HEALTHY and res.queued_ns == 0
    wire = POD.engines.dma_startup_ns + POD.ub.latency_ns + round(64 / POD.ub.bandwidth * 1e9)
    assert res.latency_ns == wire and res.pair == "P0-D0"


def test_deferred_recvs_delay_the_probe_saturated_not_failed(xds_backend):
    """Decode saturated: transfers wait for RECVs; the probe waits behind them, and completes
    once the Decode side posts them (or is still queued at the timeout)."""

    async def main():
        flow = _flow()
        ahead = [flow.register(i, 0, 4, 1 << 20) for i in range(3)]

        async def decode_side():
            await sleep_ns(30 * MS)  # KV blocks free up only now
            async with anyio.create_task_group() as tg:
                for t in ahead:
                    tg.start_soon(flow.recv, t, 1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(decode_side)
            late = await probe(flow)
            queued = await probe(flow)  # nothing ahead now: healthy again
        flow2 = _flow()
        flow2.register(0, 0, 4, 1 << 20)  # never received
        stuck = await probe(flow2, ProbeConfig(timeout_ns=10 * MS))
        return late, queued, stuck, [t.state for t in ahead]

    late, again, stuck, states = run(main, backend=xds_backend)
    assert late.verdict is LinkVerdict.SATURATED and late.queued_ns == 30 * MS
    assert late.latency_ns > 30 * MS
    assert again.verdict is LinkVerdict.HEALTHY
    assert stuck.verdict is LinkVerdict.SATURATED and stuck.queued_ns == -1
    assert states == [TransferState.COMPLETED] * 3


def test_a_downed_link_blocks_transfers_and_the_probe(xds_backend):
    async def main():
        flow = _flow()
        t = flow.register(0, 0, 4, 1 << 20)
        flow.link_down()
        async with anyio.create_task_group() as tg:
            tg.start_soon(flow.recv, t, 0)  # the RECV is posted, but nothing moves
            down = await probe(flow, ProbeConfig(timeout_ns=20 * MS))
            assert t.state is TransferState.IN_FLIGHT
            flow.link_restore()
        return down, t, await probe(flow)

    down, t, up = run(main, backend=xds_backend)
    assert down.verdict is LinkVerdict.LINK_FAILURE and down.latency_ns == -1
    assert down.queued_ns == 0  # it reached the wire: the link, not the queue, held it
    assert t.state is TransferState.COMPLETED and t.done_ns > 20 * MS
    assert up.verdict is LinkVerdict.HEALTHY


def test_the_monitor_probes_every_pair_each_period():
    async def main():
        flows = [_flow(), _flow()]
        flows[1].link_down()
        monitor = LinkMonitor(flows, ProbeConfig(period_ns=200 * MS, timeout_ns=50 * MS))
        with anyio.move_on_after(0.5):
            await monitor.run()
        return monitor.results

    results = run(main)
    assert [r.sent_ns for r in results] == [0, 0, 200 * MS, 200 * MS, 400 * MS, 400 * MS]
    verdicts = {(r.sent_ns, r.verdict) for r in results}
    assert (0, LinkVerdict.HEALTHY) in verdicts and (0, LinkVerdict.LINK_FAILURE) in verdicts


def test_probe_config_errors_name_the_field():
    with pytest.raises(ConfigError) as err:
        ProbeConfig(timeout_ns=0)
    assert err.value.field == "timeout_ns"


def _replay_setup():
    from xds.serve.decode import DecodeConfig
    from xds.serve.jitter import JitterConfig
    from xds.serve.prefill import PrefillConfig
    from xds.serve.replay import PDConfig
    from xds.trace.workload import Request, Workload

    cfg = PDConfig(
        prefill=PrefillConfig(tes=2, long_pool_tes=0),
        decode=DecodeConfig(
            dies=32, batch_per_die=4, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
        ),
    )
    wl = Workload(tuple(Request(i, i * 100 * MS, 1500, 20) for i in range(24)))
    return cfg, wl


def test_a_replay_with_probing_takes_a_downed_pair_out_of_service():
    """A link that goes down for good stalls transfers silently; the probes find it, the pair
    is declared failed, the stalled requests fail with that reason, and later requests go
    through the other Prefill TE's pair."""
    import msgspec

    from xds.serve.replay import DistFlowFault, replay

    cfg, wl = _replay_setup()
    # the first request's prefill ends at 92 ms, before the probe times out: its transfer
    # stalls on the downed link until the pair is declared failed
    probed = msgspec.structs.replace(
        cfg, probe=ProbeConfig(period_ns=200 * MS, timeout_ns=150 * MS)
    )
    fault = DistFlowFault(at_ns=0, prefill_te=0, kind="link_down")
    res = replay(wl, probed, faults=[fault], event_log=True)
    failed = [x for x in res.records if x.outcome == "failed"]
    stalled = [x for x in failed if "link down, found by link probing" in x.reason]
    assert stalled and stalled[0].request_id == 0
    # prefilled on P0 after the declaration: no pair left to move the KV
    assert all(x in stalled or "every DistFlow pair from P0 failed" in x.reason for x in failed)
    assert res.summary.completed + len(failed) == 24
    (declared,) = res.events.select("distflow", "declared-failed")
    first_failure = min(r.sent_ns for r in res.probes if r.verdict is LinkVerdict.LINK_FAILURE)
    assert declared.t_ns == first_failure + 150 * MS  # at the probe's timeout
    assert all(x.arrival_ns <= declared.t_ns for x in failed)  # later ones avoid P0
    assert {r.verdict for r in res.probes if r.pair == "P1-D0"} == {LinkVerdict.HEALTHY}


def test_a_link_that_comes_back_delays_transfers_and_fails_nothing():
    from xds.serve.replay import DistFlowFault, replay

    cfg, wl = _replay_setup()
    clean = replay(wl, cfg)
    fault = DistFlowFault(at_ns=0, prefill_te=0, kind="link_down", duration_ns=300 * MS)
    res = replay(wl, cfg, faults=[fault])
    assert res.summary.completed == 24
    stalled = max(x.kv_transfer_ns for x in res.records)
    assert stalled > 200 * MS > 100 * max(x.kv_transfer_ns for x in clean.records)
    assert not res.probes  # probing is off by default


def test_a_permanent_link_down_without_probing_is_refused():
    from xds.serve.replay import DistFlowFault, replay

    cfg, wl = _replay_setup()
    with pytest.raises(ConfigError, match="link probing") as err:
        replay(wl, cfg, faults=[DistFlowFault(at_ns=0, prefill_te=0, kind="link_down")])
    assert err.value.field == "faults[0].duration_ns"
    with pytest.raises(ConfigError) as err:
        DistFlowFault(at_ns=0, prefill_te=0, duration_ns=5)
    assert err.value.field == "duration_ns"


def _probed_replay(
    n: int, inputs: int, gap_ms: int, batch: int, probe: ProbeConfig, faults=(), outputs=20
):
    from xds.serve.decode import DecodeConfig
    from xds.serve.jitter import JitterConfig
    from xds.serve.prefill import PrefillConfig
    from xds.serve.replay import PDConfig, replay
    from xds.trace.workload import Request, Workload

    cfg = PDConfig(
        prefill=PrefillConfig(tes=2, long_pool_tes=0),
        decode=DecodeConfig(
            dies=32, batch_per_die=batch, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
        ),
        probe=probe,
    )
    wl = Workload(tuple(Request(i, i * gap_ms * MS, inputs, outputs) for i in range(n)))
    return replay(wl, cfg, faults=list(faults))


def test_long_transfers_on_a_healthy_link_are_never_a_link_failure():
    """32K-token prompts take about 6 ms to move; a 2 ms probe timeout finds the probe's
    bytes queued behind them on the ports: busy, not broken."""
    res = _probed_replay(40, 32_000, 20, 4, ProbeConfig(timeout_ns=2 * MS, period_ns=50 * MS))
    assert res.summary.completed == 40
    verdicts = {r.verdict for r in res.probes}
    assert LinkVerdict.LINK_FAILURE not in verdicts and LinkVerdict.SATURATED in verdicts


def test_a_downed_link_behind_a_saturated_decode_is_still_found():
    """Transfers stalled on the dead link hold Decode's KV, so later RECVs are deferred and the
    probe never reaches the head of the queue: the posted transfers held by the link give the
    link away, the pair is taken out of service and the replay ends."""
    from xds.serve.replay import DistFlowFault

    res = _probed_replay(
        100,
        1500,
        20,
        1,
        ProbeConfig(timeout_ns=100 * MS),
        [DistFlowFault(at_ns=200 * MS, prefill_te=0, kind="link_down")],
        outputs=200,  # long decodes: with batch 1 per die, Decode defers RECVs
    )
    p0 = [r for r in res.probes if r.pair == "P0-D0"]
    assert [r.verdict for r in p0] == [LinkVerdict.HEALTHY, LinkVerdict.LINK_FAILURE]
    assert p0[1].queued_ns == -1  # it never reached the head of the queue
    assert res.summary.completed + res.summary.failed == 100 and res.summary.failed


def test_a_transfer_on_the_wire_freezes_while_its_link_is_down(xds_backend):
    """A link failure blocks every transfer: one already moving bytes stops with what is left
    of it and, once the link is back, sends that rest again through the ports (paying the DMA
    start-up again); declared failed, it fails."""

    async def main():
        flow = _flow()
        t = flow.register(0, 0, 4, 1 << 30)  # about 5 ms on the wire

        async def outage():
            await sleep_ns(2 * MS)
            flow.link_down()
            await sleep_ns(10 * MS)
            flow.link_restore()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outage)
            tg.start_soon(flow.recv, t, 0)
        clean = _flow()
        c = clean.register(0, 0, 4, 1 << 30)
        start = now_ns()
        await clean.recv(c, 0)
        duration = c.done_ns - start

        dead = _flow()
        d = dead.register(0, 0, 4, 1 << 30)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dead.recv, d, 0)
            await sleep_ns(2 * MS)
            dead.link_down()
            res = await probe(dead, ProbeConfig(timeout_ns=5 * MS))
            assert dead.stalled == 1
            dead.declare_failed()
        return t, duration, res, d, flow.engines.dma_startup_ns

    t, duration, res, d, restart = run(main, backend=xds_backend)
    assert t.state is TransferState.COMPLETED
    assert abs(t.done_ns - (duration + 10 * MS + restart)) <= 2  # whole-nanosecond bookings
    assert res.verdict is LinkVerdict.LINK_FAILURE
    assert d.state is TransferState.FAILED


@pytest.mark.parametrize("outage_ms", [1, 10])
def test_an_outage_costs_its_length_and_a_restart_however_short(outage_ms):
    """The frozen transfer gives its port bookings back: a short outage does not make the rest
    queue behind the transfer's own dead booking."""

    async def main():
        clean = _flow()
        c = clean.register(0, 0, 4, 1 << 30)
        await clean.recv(c, 0)
        duration = c.done_ns - c.recv_ns
        flow = _flow()
        t = flow.register(0, 0, 4, 1 << 30)

        async def outage():
            await sleep_ns(2 * MS)
            flow.link_down()
            await sleep_ns(outage_ms * MS)
            flow.link_restore()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outage)
            tg.start_soon(flow.recv, t, 0)
        return t.done_ns - t.recv_ns, duration, flow.engines.dma_startup_ns

    took, duration, restart = run(main)
    assert abs(took - (duration + outage_ms * MS + restart)) <= 2


def test_a_probe_queues_on_the_ports_of_the_dps_it_travels_between():
    """A 1 GiB transfer from prefill DP 1 to decode DP 1 fills DP 1's egress port for ~5.5 ms:
    a probe from DP 1 waits behind it; one from DP 0 to DP 0 does not."""

    async def main():
        flow = _flow()
        big = flow.register(0, 1, 4, 1 << 30)
        async with anyio.create_task_group() as tg:
            tg.start_soon(flow.recv, big, 1)
            await sleep_ns(1)  # the transfer is on the wire
            free = await probe(flow, prefill_dp=0, decode_dp=0)
            busy = await probe(flow, ProbeConfig(timeout_ns=50 * MS), prefill_dp=1, decode_dp=0)
        return free, busy

    free, busy = run(main)
    assert free.verdict is LinkVerdict.HEALTHY
    assert busy.verdict is LinkVerdict.SATURATED and busy.latency_ns > 5 * MS


def test_a_probe_between_dps_the_pair_lacks_is_a_clear_error():
    async def main():
        with pytest.raises(ConfigError, match=r"prefill_dp: must be an integer in 0\.\.1"):
            await probe(_flow(), prefill_dp=2)
        with pytest.raises(ConfigError, match=r"decode_dp: must be an integer in 0\.\.1"):
            await probe(_flow(), decode_dp=-1)

    run(main)
