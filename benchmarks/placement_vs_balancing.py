"""How much a prefill placement policy matters with and without the leader's balancing.

Compares the default placement (``least_work``) with a deliberately bad one (always the first
group offered) on the built-in workload, with ``balance_split`` on and off (the default):
balancing evens each step out after placement, so it hides most of a placement's effect.

    python benchmarks/placement_vs_balancing.py [--requests N] [--rate R]
"""

from __future__ import annotations

import argparse

import msgspec

from xds.serve.presets import pd_config
from xds.serve.replay import replay
from xds.trace.production import production_workload


def first_offered(job, groups):
    return groups[0].dp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=8.0)
    args = ap.parse_args()
    workload = production_workload(args.requests, rate_per_s=args.rate, seed=0)
    base = pd_config("production-4p1d")
    print(f"{args.requests} requests at {args.rate:g} req/s on production-4p1d: mean TTFT (ms)")
    for balance in (True, False):
        cfg = msgspec.structs.replace(
            base, prefill=msgspec.structs.replace(base.prefill, balance_split=balance)
        )
        default = replay(workload, cfg).summary.ttft_ms.mean
        bad = replay(workload, cfg, prefill_placement=first_offered).summary.ttft_ms.mean
        print(
            f"  balance_split={balance!s:5}: least_work {default:8.1f}, first group "
            f"{bad:8.1f} ({bad / default - 1:+.0%})"
        )


if __name__ == "__main__":
    main()
