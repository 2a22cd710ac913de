"""What SPEC 11's mechanisms cost on a DeepSeek-R1 decode group (a what-if study).

    python benchmarks/reliability.py [--dps 16] [--iterations 30]

A decode group of ``--dps`` DP dies running all 61 layers (58 MoE layers priced as one MoE layer
of the peak-decode run, :class:`xds.serve.reliability.LayerTimes`; about 88 ms per iteration)
answers three questions:

1. **Heartbeat timeout vs false positives and detection.** For each timeout (DP period 100 ms),
   a healthy run with the paper's rare long operation (one 150 ms stall of one DP, e.g. a GC or
   graph recompile) counts the DPs marked unhealthy although nothing failed, and a run with an
   executor hang measures how long the TE-shell takes to mark the hung DP. Short timeouts catch a
   hang fast and raise false positives on long healthy iterations (SPEC 11.3's trade-off).
2. **Rollback cost by layer.** A transient network error at the first, middle or last MoE layer
   of one iteration: the virtual time lost (the discarded part of the iteration, plus the
   broadcast and the slowest DP's reach).
3. **Scale-down.** One executor crash with ``on_unhealthy = "scale_down"``: the requests lost,
   the DPs left, and the slowdown of later iterations from the surviving expert replicas.

Every number comes out of the modelled mechanisms; no ``../shared`` needed; about 30 s.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from xds.runtime import run
from xds.serve.reliability import (
    ExecutorCrash,
    ExecutorHang,
    HeartbeatConfig,
    NetworkError,
    ReliabilityConfig,
    ReliabilityResult,
    ReliableDecode,
    SlowIteration,
)
from xds.units import MS


def _run(cfg: ReliabilityConfig, events: list | None = None) -> ReliabilityResult:
    async def main() -> ReliabilityResult:
        res = await ReliableDecode(cfg).run()
        if events is not None:
            from xds.runtime import current_runtime

            events.extend(current_runtime().events)
        return res

    return run(main, seed=0, event_log=events is not None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dps", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=30)
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = ReliabilityConfig(
        dps=args.dps, batch_per_dp=4, layers=58, output_tokens=args.iterations + 1
    )
    per_iter = _run(base).elapsed_ns / args.iterations
    print(f"decode group: {args.dps} DPs, 58 MoE layers, {per_iter / 1e6:.1f} ms per iteration\n")

    print("1. heartbeat timeout (DP period 100 ms, control plane 1 s)")
    print(f"{'timeout':>9} | {'false marks':>15} | {'hang marked after':>17}")
    for timeout in (50, 80, 120, 200, 500, 2000):
        hb = HeartbeatConfig(dp_period_ns=100 * MS, timeout_ns=timeout * MS, on_unhealthy="report")
        healthy = msgspec.structs.replace(
            base, heartbeat=hb, faults=(SlowIteration(dp=1, iteration=10, extra_ns=150 * MS),)
        )
        fp = len(_run(healthy).verdicts)
        hb_restart = msgspec.structs.replace(hb, on_unhealthy="restart")
        hang = msgspec.structs.replace(
            base, heartbeat=hb_restart, faults=(ExecutorHang(dp=3, iteration=12),)
        )
        events: list = []
        res = _run(hang, events)
        struck = [e.t_ns for e in events if (e.component, e.event) == ("executor", "hang")]
        if not struck:  # a healthy iteration timed out first and restarted the world
            first = res.verdicts[0].marked_ns / 1e6
            print(f"{timeout:>6} ms | {fp:>15} | restarted on a false positive at {first:.0f} ms")
            continue
        marked = min(v.marked_ns for v in res.verdicts if v.dp == 3)
        print(f"{timeout:>6} ms | {fp:>15} | {(marked - struck[0]) / 1e6:>14.1f} ms")

    print("\n2. rollback of one iteration (code LINK_FLAP, broadcast 20 us, poll 5 us)")
    clean = _run(base).elapsed_ns
    print(f"{'MoE layer':>9} | {'time lost':>10} | {'slowest reach':>13}")
    for layer in (0, 29, 57):
        res = _run(
            msgspec.structs.replace(base, faults=(NetworkError(dp=5, iteration=10, layer=layer),))
        )
        (rb,) = res.rollbacks
        reach = max(rb.observed_ns.values()) - rb.broadcast_ns
        print(f"{layer:>9} | {(res.elapsed_ns - clean) / 1e6:>7.2f} ms | {reach / 1e3:>10.1f} us")

    print("\n3. decode scale-down after an executor crash (2 expert slots per die)")
    hb = HeartbeatConfig(dp_period_ns=100 * MS, timeout_ns=200 * MS, on_unhealthy="scale_down")
    crash = msgspec.structs.replace(base, heartbeat=hb, faults=(ExecutorCrash(dp=4, iteration=10),))
    res = _run(crash)
    (sd,) = res.scale_downs
    print(
        f"requests lost {len(res.failed())} of {len(res.outcomes)}; {sd.live_dps} DPs left; "
        f"expert time x{sd.expert_scale:.2f}; run {res.elapsed_ns / 1e6:.0f} ms "
        f"(fault-free {clean / 1e6:.0f} ms)"
    )
    print(f"\nwall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
