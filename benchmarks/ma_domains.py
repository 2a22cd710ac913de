"""MoE-attention disaggregation design sweep: DP domains, microbatches and domain turns (a
what-if on SPEC 12.3).

    python benchmarks/ma_domains.py [--domains 2 3 4 5] [--microbatches 1 2 3]
                                    [--turns exclusive relaxed] [--iterations N]

The 480 attention dies of SPEC 12.3 are split into ``domains`` DP domains (480 / domains dies
each; batch 96 per die throughout, so the global batch stays 46,080), each die's batch into
``microbatches``, and the domains share the A2E/E2A path in ``exclusive`` or ``relaxed`` turns.
Each point is a window of iterations at the run's mean context on the collective tier (as
``xds reproduce ma-decode``); A2E/E2A are measured once per domain size on the 768-die pod. It
prints the iteration, TPOT, tokens/s per chip and the expert dies' kernel busy shares. No
``../shared`` needed; about 10 s per point.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from xds.errors import ConfigError
from xds.reproduce.ma_decode import measure
from xds.serve.ma_config import MADecodeConfig
from xds.serve.ma_decode import ae_curve

ATTENTION_DIES = 480


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--domains", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--turns", nargs="+", default=["exclusive", "relaxed"])
    ap.add_argument("--iterations", type=int, default=6)
    args = ap.parse_args()
    print(
        f"{'domains':>7} {'mb':>3} {'turns':>9} | {'iter ms':>8} {'TPOT ms':>8} "
        f"{'tok/s/chip':>10} | {'A2E':>4} {'MoE':>4} {'E2A':>4} busy | wall"
    )
    for domains in args.domains:
        base = MADecodeConfig(domains=domains, attention_dies_per_domain=ATTENTION_DIES // domains)
        curves = {}
        for mb in args.microbatches:
            for turns in args.turns:
                wall = time.perf_counter()
                try:
                    cfg = msgspec.structs.replace(base, microbatches=mb, domain_turns=turns)
                except ConfigError as exc:
                    print(f"{domains:>7} {mb:>3} {turns:>9} | {exc}")
                    continue
                key = tuple(cfg.microbatch_seqs)
                if key not in curves:
                    curves[key] = ae_curve(cfg)
                res = measure(cfg, iterations=args.iterations, curve=curves[key])
                busy = res.stream_busy
                print(
                    f"{domains:>7} {mb:>3} {turns:>9} | {res.mean_iteration_ns / 1e6:8.1f} "
                    f"{res.tpot_ns / 1e6:8.1f} {res.tokens_per_s_per_chip:10,.0f} | "
                    f"{busy['a2e']:4.0%} {busy['moe']:4.0%} {busy['e2a']:4.0%}      | "
                    f"{time.perf_counter() - wall:.1f} s"
                )


if __name__ == "__main__":
    main()
