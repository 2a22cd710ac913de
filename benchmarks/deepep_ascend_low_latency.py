"""An unfitted check of the dispatch/combine cost model: DeepEP-Ascend's low-latency kernels.

DeepEP-Ascend (sgl-project/sgl-kernel-npu README, REFERENCE.md DEEPEP-ASC) publishes the
latency of its low-latency kernels on the A3 SuperPOD in a DeepSeek-V3/R1 decode setting: 128
tokens per rank, hidden 7168, top-8, INT8 dispatch and BF16 combine, EP8/16/32. Nothing in xds
was fitted to these numbers (``a2a_congestion`` was fitted to the *normal* kernels' combine
bandwidth at 4096 tokens), so the table is a prediction.

The low-latency kernels send one copy per (token, expert), not one per (token, rank). To move
the same bytes to the same number of peers, the experiment gives each rank one logical expert
and routes every token to 8 distinct ranks: 1024 rows leave each rank, spread evenly over its
peers (and itself), as with 256 experts and per-expert copies. Collective tier, every rank
starting together; latency is from the common start to the last rank's completion.

Run: ``python benchmarks/deepep_ascend_low_latency.py [--pull-order static|staggered]``
(a few seconds).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from xds.fabric import UBFabric
from xds.hw import CloudMatrix384
from xds.model import DEEPSEEK_V3
from xds.reproduce.dispatch_combine import deepseek_ep_group, timed_exchange
from xds.runtime import rng, run

TOKENS = 128
MEASURED_US = {  # EP: (dispatch, combine) latency of the low-latency kernels, DEEPEP-ASC
    8: (132, 126),
    16: (139, 135),
    32: (153, 151),
}


def latency(ep: int, *, tokens: int = TOKENS, pull_order: str = "static") -> tuple[float, float]:
    """(dispatch, combine) latency in us at EP ``ep``, ``tokens`` per rank."""
    model = DEEPSEEK_V3

    async def main() -> tuple[int, int]:
        fabric = UBFabric(CloudMatrix384(servers=max(1, ep // 16)), payload_mode="size")
        # one logical expert per rank: a row per (token, expert)
        group = deepseek_ep_group(fabric, ep, tokens, pull_order=pull_order, experts=ep)
        pick = rng("benchmark/deepep-ascend-ll")
        routes = [
            np.stack([pick.choice(ep, model.top_k, replace=False) for _ in range(tokens)])
            for _ in range(ep)
        ]
        return await timed_exchange(group, tokens, routes, combine_after_ns=10_000_000)

    d_ns, c_ns = run(main, seed=0, event_log=False)
    return d_ns / 1e3, c_ns / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pull-order", choices=("static", "staggered"), default="static")
    args = parser.parse_args()
    wall = time.perf_counter()
    print(
        f"DeepEP-Ascend low-latency kernels vs xds, {TOKENS} tokens/rank, INT8 dispatch, "
        f"BF16 combine ({args.pull_order} pull order); latency in us"
    )
    print(
        f"{'EP':>4} {'measured disp':>14} {'xds disp':>9} {'err':>6}   "
        f"{'measured comb':>14} {'xds comb':>9} {'err':>6}"
    )
    for ep, (md, mc) in MEASURED_US.items():
        d, c = latency(ep, pull_order=args.pull_order)
        print(
            f"{ep:>4} {md:>14} {d:9.1f} {(d - md) / md:+6.0%}   "
            f"{mc:>14} {c:9.1f} {(c - mc) / mc:+6.0%}"
        )
    print(f"\n{time.perf_counter() - wall:.1f} s wall")


if __name__ == "__main__":
    main()
