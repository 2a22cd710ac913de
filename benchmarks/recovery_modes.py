"""Recovery modes compared on production-4p1d: one NPU fault, three ways to recover (SPEC 11.2).

    python benchmarks/recovery_modes.py [--rate 4] [--requests 1600] [--at 120]

The built-in SPEC 12.4 workload (``--requests`` arrivals at ``--rate`` req/s) replays on the
``production-4p1d`` deployment (servers 0-7: four Prefill TEs of two servers; 8-15: the Decode
TE of DP128/EP128) with one node fault at ``--at`` seconds, once on a Prefill server (1) and
once on a Decode server (9), under each recovery mode:

* ``restart_world`` (stage 1, P118): everything restarts, Decode first;
* ``independent`` (stage 2, P119): only the struck TE restarts (kill-P-to-preserve-D for a
  Decode TE short of servers);
* ``scale_down`` (stage 2, later, P119): a Decode TE drops the struck server's 16 dies and
  serves on at EP112; a Prefill fault is handled as ``independent``.

For each it prints completed and failed requests, SLA goodput, mean TPOT of the requests that
arrive after the fault, and output tokens/s per chip. Restart and scale-down times are
[emulator choice] (:class:`xds.serve.recovery.RecoveryConfig`); the paper gives none. No
``../shared`` needed; about 40 s.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np

from xds.serve.presets import pd_config
from xds.serve.recovery import NodeFault
from xds.serve.replay import replay
from xds.trace.production import production_workload
from xds.units import S


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=1600)
    ap.add_argument("--at", type=float, default=120.0, help="fault time (s)")
    args = ap.parse_args()
    wall = time.perf_counter()
    base = pd_config("production-4p1d")
    workload = production_workload(args.requests, rate_per_s=args.rate, seed=0)
    at = round(args.at * S)
    print(
        f"production-4p1d, {args.requests} requests at {args.rate:g} req/s, one NPU fault at "
        f"{args.at:g} s"
    )
    header = (
        f"{'fault':<16}{'recovery':<15}{'completed':>10}{'failed':>8}{'goodput':>9}"
        f"{'TPOT after (ms)':>17}{'tok/s/chip':>12}"
    )
    print(header)
    print("-" * len(header))
    clean = replay(workload, base, seed=0).summary
    print(
        f"{'none':<16}{'-':<15}{clean.completed:>10}{clean.failed:>8}{clean.goodput:>9.1%}"
        f"{clean.tpot_ms.mean:>17.2f}{clean.output_tokens_per_s_per_chip:>12.1f}"
    )
    for server, where in ((1, "Prefill (1)"), (9, "Decode (9)")):
        for mode in ("restart_world", "independent", "scale_down"):
            cfg = msgspec.structs.replace(
                base, recovery=msgspec.structs.replace(base.recovery, mode=mode)
            )
            res = replay(workload, cfg, seed=0, faults=[NodeFault(at_ns=at, server=server)])
            s = res.summary
            after = [
                r.tpot_ns
                for r in res.records
                if r.arrival_ns >= at and r.outcome == "completed" and r.output_tokens > 1
            ]
            tpot = f"{float(np.mean(after)) / 1e6:.2f}" if after else "none completed"
            print(
                f"{where:<16}{mode:<15}{s.completed:>10}{s.failed:>8}{s.goodput:>9.1%}"
                f"{tpot:>17}{s.output_tokens_per_s_per_chip:>12.1f}"
            )
    print(f"wall {time.perf_counter() - wall:.1f} s")


if __name__ == "__main__":
    main()
