"""Dispatch/combine pull order (static vs staggered, :data:`xds.fabric.xccl.moe.PullOrder`):
what the simulated exchange realises against DeepEP-Ascend's measured bandwidths, and how the
order moves Figure 6 and the peak-decode run.

1. **Bandwidth.** DeepEP-Ascend's normal kernels on the A3 SuperPOD (4096 tokens per rank,
   hidden 7168, top-8, INT8 dispatch, BF16 combine; sgl-project/sgl-kernel-npu README,
   REFERENCE.md DEEPEP-ASC) give the bottleneck bandwidth per rank at EP8..128. xds's
   ``a2a_congestion`` was fitted to the combine column through the formula
   ``196 GB/s / (1 + c log2 F)``; the table shows what the simulated collective (ports,
   per-AIV pulls, incast) actually realises on the same experiment, per pull order: remote
   bytes a rank receives over the collective's latency. The dispatch column was not fitted.
2. **Figure 6** (EP128, batch 1..128) and **peak decode** (SPEC 12.2, 288 dies) with each
   order: the sensitivity of those reproductions to a protocol detail the paper leaves open.

Run: ``python benchmarks/a2a_pull_order.py [--tokens 4096] [--skip-decode]`` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np

from xds.fabric import UBFabric
from xds.fabric.xccl.moe import combine_row_bytes, dispatch_row_bytes
from xds.hw import CloudMatrix384, EngineSpec, collective_efficiency
from xds.model import DEEPSEEK_V3
from xds.reproduce import dispatch_combine, peak_decode
from xds.runtime import rng, run
from xds.serve.decode import DecodeConfig

ORDERS = ("static", "staggered")
DEEPEP_ASCEND_GBPS = {  # EP: (dispatch, combine) bottleneck bandwidth, normal kernels
    8: (146, 125),
    16: (107, 103),
    32: (102, 95),
    64: (81, 91),
    128: (57, 81),
}
UB_GBPS = 196.0


def exchange(ep: int, tokens: int, order: str) -> tuple[float, float]:
    """(dispatch, combine) remote receive bandwidth per rank in GB/s, uniform top-8 routing."""
    model = DEEPSEEK_V3
    pod = CloudMatrix384(servers=max(1, ep // 16))

    async def main() -> tuple[int, int]:
        fabric = UBFabric(pod, payload_mode="size")
        group = dispatch_combine.deepseek_ep_group(fabric, ep, tokens, pull_order=order)
        pick = rng("benchmark/a2a-routing")
        # top-8 of 256 without replacement: the 8 smallest of uniform keys per token
        routes = [
            np.argpartition(pick.random((tokens, model.routed_experts)), model.top_k, axis=1)[
                :, : model.top_k
            ]
            for _ in range(ep)
        ]
        # combine's common start long after dispatch drained
        return await dispatch_combine.timed_exchange(
            group, tokens, routes, start_in_ns=1_000, combine_after_ns=100_000_000
        )

    d_ns, c_ns = run(main, seed=0, event_log=False)
    remote = (ep - 1) / ep
    # dispatch: a row per (token, destination rank); combine: a row per (token, expert)
    d_bytes = (
        tokens
        * _ranks_per_token(ep)
        * remote
        * dispatch_row_bytes(model.hidden, model.top_k, "int8")
    )
    c_bytes = tokens * model.top_k * remote * combine_row_bytes(model.hidden, "bf16")
    return d_bytes / d_ns, c_bytes / c_ns


def _ranks_per_token(ep: int, experts: int = 256, k: int = 8) -> float:
    """Expected distinct destination ranks of a token's top-k (experts spread evenly)."""
    per = experts // ep
    miss = 1.0
    for i in range(k):  # P(no chosen expert on a given rank)
        miss *= (experts - per - i) / (experts - i)
    return ep * (1 - miss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    wall = time.perf_counter()
    c = EngineSpec().a2a_congestion
    print(f"1. exchange bandwidth per rank, {args.tokens} tokens/rank (GB/s)")
    print(
        f"{'EP':>4} {'fit: combine':>13} {'DeepEP-A disp/comb':>19} "
        + " ".join(f"{o + ' disp/comb':>20}" for o in ORDERS)
    )
    for ep, (dd, dc) in DEEPEP_ASCEND_GBPS.items():
        fit = UB_GBPS * collective_efficiency(EngineSpec(), ep - 1)
        cells = []
        for order in ORDERS:
            d, cc = exchange(ep, args.tokens, order)
            cells.append(f"{d:9.1f} /{cc:6.1f}")
        print(f"{ep:>4} {fit:13.1f} {dd:>10} / {dc:>4}  " + " ".join(f"{x:>20}" for x in cells))
    print(f"   (fit: 196 GB/s / (1 + {c} log2(EP - 1)), the formula a2a_congestion was fitted by)")

    print("\n2. Figure 6 at EP128: dispatch / combine latency (us)")
    lat = {o: dispatch_combine.measure(pull_order=o) for o in ORDERS}
    print(f"{'batch':>6} " + " ".join(f"{o:>20}" for o in ORDERS))
    for b in dispatch_combine.BATCHES:
        print(
            f"{b:>6} "
            + " ".join(f"{lat[o][b][0] / 1e3:9.1f} /{lat[o][b][1] / 1e3:7.1f}" for o in ORDERS)
        )
    for o in ORDERS:
        faster = {d < c for d, c in lat[o].values()}  # dispatch faster, per batch
        where = (
            f"at batch {dispatch_combine.crossover(lat[o]):.1f}"
            if len(faster) == 2
            else f"none: {'dispatch' if True in faster else 'combine'} is faster at every batch"
        )
        print(f"   {o}: crossover {where} (paper 32)")

    if not args.skip_decode:
        print("\n3. peak decode (SPEC 12.2), full run")
        for o in ORDERS:
            cfg = msgspec.structs.replace(DecodeConfig(), pull_order=o)
            res = peak_decode.measure(cfg)
            bd = res.breakdown
            total = bd.total()
            it = (res.mean_iteration_ns - cfg.scheduler_gap_ns) / 1e6
            tpot = res.mean_iteration_ns / 1e6 / res.mean_tokens_per_step
            print(
                f"   {o:9s}: iteration {it:.1f} ms (paper 93), TPOT {tpot:.1f} ms (50), "
                f"attention {bd.attention / total:.3f} (0.218), "
                f"dispatch+combine {(bd.dispatch + bd.combine) / total:.3f} (0.36)"
            )
    print(f"\n{time.perf_counter() - wall:.0f} s wall")


if __name__ == "__main__":
    main()
