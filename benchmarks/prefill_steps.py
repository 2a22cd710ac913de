"""Where the prefill capacity of ``production-4p1d`` goes on the SPEC 12.4 mix.

    python benchmarks/prefill_steps.py [--rate R] [--window S] [--unique-prompts]

Replays ``window`` seconds of the built-in production workload at ``rate`` requests/s and
prints, over the four Prefill TEs: how busy they were, the share of their step time spent in
sequence-parallel steps (one long prompt over all 8 DP groups), how many of the 8 groups held
work in the batched steps (time-weighted; with ``PrefillConfig.balance_split`` on the leader
spreads jobs over groups that would otherwise sit a lockstep step out), and the prefix-cache
hits. No ``../shared`` needed.
"""

from __future__ import annotations

import argparse
import time

from xds.runtime import run
from xds.serve.decode_te import comm_grid
from xds.serve.presets import pd_config
from xds.serve.replay import Replay
from xds.trace.metrics import prefix_hit_ratio
from xds.trace.production import (
    MOONCAKE_CONVERSATIONS,
    NO_CONVERSATIONS,
    production_workload,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=18.0)
    ap.add_argument("--window", type=float, default=300.0)
    ap.add_argument("--unique-prompts", action="store_true")
    args = ap.parse_args()
    cfg = pd_config("production-4p1d")
    conv = NO_CONVERSATIONS if args.unique_prompts else MOONCAKE_CONVERSATIONS
    wl = production_workload(
        round(args.rate * args.window), rate_per_s=args.rate, conversations=conv
    )
    grid = comm_grid(cfg.decode)
    wall = time.perf_counter()

    async def go() -> Replay:
        r = Replay(wl, cfg, grid)
        await r.run()
        return r

    r = run(go, event_log=False)
    wall = time.perf_counter() - wall
    tes = r.prefill
    busy = sum(te.busy_ns for te in tes)
    sp = sum(te.sp_busy_ns for te in tes)
    batched = busy - sp
    groups = cfg.prefill.dps_per_te
    recs = list(r.records.values())
    print(f"workload         {wl.source}, {len(wl):,} requests")
    steps, sp_steps = sum(te.steps for te in tes), sum(te.sp_steps for te in tes)
    print(f"prefill steps    {steps:,}, of which SP {sp_steps:,}")
    print(f"SP share         {sp / max(1, busy):.1%} of prefill step time")
    print(
        f"batched steps    {sum(te.group_busy_ns for te in tes) / max(1, batched):.2f} of "
        f"{groups} DP groups hold work (time-weighted)"
    )
    print(f"prefix hits      {prefix_hit_ratio(recs):.1%} of prompt tokens")
    print(f"wall             {wall:.1f} s")


if __name__ == "__main__":
    main()
