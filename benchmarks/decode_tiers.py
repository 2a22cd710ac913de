"""Peak decode (SPEC 12.2, 288 dies): layer tier vs iteration tier on the first iterations,
and the wall time of the full run on the iteration tier.

Run: ``python benchmarks/decode_tiers.py [--iterations 20] [--full]``
"""

from __future__ import annotations

import argparse
import time

from xds.reproduce.peak_decode import measure
from xds.serve.decode import DecodeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--full", action="store_true", help="also time the full run")
    args = parser.parse_args()
    cfg = DecodeConfig()
    rows = []
    for tier in ("layer", "iteration"):
        wall = time.perf_counter()
        res = measure(cfg, iterations=args.iterations, tier=tier)
        rows.append((tier, res.mean_iteration_ns / 1e6, res.tokens, time.perf_counter() - wall))
    for tier, ms, tokens, wall in rows:
        print(
            f"{tier:9s} first {args.iterations} iterations: {ms:.3f} ms/iteration, "
            f"{tokens} tokens, {wall:.1f} s wall"
        )
    (_, a, _, _), (_, b, _, _) = rows
    print(f"difference: {abs(a - b) / a:.4%}")
    if args.full:
        wall = time.perf_counter()
        res = measure(cfg)
        print(
            f"full run: {res.iterations} iterations, {res.tokens:,} tokens, "
            f"{res.mean_iteration_ns / 1e6:.2f} ms/iteration, "
            f"{time.perf_counter() - wall:.1f} s wall"
        )


if __name__ == "__main__":
    main()
