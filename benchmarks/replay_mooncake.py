"""Wall time of replaying a real trace on ``production-4p1d`` (issue 7's performance figure).

    python benchmarks/replay_mooncake.py [--limit N] [--trace PATH] [--format F] [--spread-ties]

Any trace ``xds.trace.load`` reads works (e.g. the Azure 2023 CSVs).

Prints the summary rows and the wall time; the budget is 30 s for the whole Mooncake
conversation trace (12,031 requests over 59 minutes). Needs ``../shared/data``.
"""

from __future__ import annotations

import argparse
import time

from _data import MOONCAKE_CONVERSATION
from xds.runtime.rng import RngStreams
from xds.serve.presets import pd_config
from xds.serve.replay import replay
from xds.trace import load

DEFAULT = MOONCAKE_CONVERSATION


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--format", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument(
        "--spread-ties",
        action="store_true",
        help="spread requests sharing a timestamp over its step (xds replay --spread-ties)",
    )
    args = ap.parse_args()
    wl = load(args.trace, args.format).limited(args.limit)
    if args.spread_ties:
        wl = wl.spread_ties(RngStreams(0)("trace/spread-ties"))
    wl = wl.scaled(args.rate_scale)
    start = time.perf_counter()
    res = replay(wl, pd_config("production-4p1d"))
    wall = time.perf_counter() - start
    s = res.summary
    print(f"trace            {wl.source} ({len(wl):,} requests)")
    print(f"completed/failed {s.completed:,} / {s.failed:,} {s.failures}")
    t = s.ttft_ms
    print(f"TTFT ms          mean {t.mean:,.1f}  p50 {t.p50:,.1f}  p99 {t.p99:,.1f}")
    t = s.tpot_ms
    print(f"TPOT ms          mean {t.mean:,.2f}  p50 {t.p50:,.2f}  p99 {t.p99:,.2f}")
    print(f"tokens/s/chip    {s.output_tokens_per_s_per_chip:,.1f}")
    print(f"goodput          {s.goodput:.1%}")
    print(f"prefix hits      {s.prefix_hit_ratio:.1%} of prompt tokens")
    d = s.decode
    assert d is not None
    print(f"first arrival to last completion {s.duration_s:,.1f} s")
    print(f"decode iterations {res.decode_iterations:,}")
    print(
        f"decode           {d.mean_iteration_ms:.1f} ms per iteration, {d.sequences_per_die:.2f} "
        f"sequences per die, busiest die's context {d.context_max_over_ideal:.2f}x an even "
        f"spread ({d.context_max_over_mean:.2f}x the mean die with sequences)"
    )
    print(f"wall             {wall:.1f} s ({s.duration_s / wall:,.0f}x real time)")


if __name__ == "__main__":
    main()
