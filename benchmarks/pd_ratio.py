"""The production rate search for other prefill:decode ratios (a what-if on SPEC 12.4).

    python benchmarks/pd_ratio.py [--prefill-tes 4 5 6 8] [--window S] [--bisections N]
                                  [--microbatches 2]

``production-4p1d`` is prefill-bound on the SPEC 12.4 mix (``xds reproduce production``).
This runs the same search (highest rate with mean TPOT <= 35 ms and mean TTFT <= 2 s) with
more Prefill TEs of the same shape in front of the same Decode TE, and prints, per ratio, the
rate found, its TPOT, TTFT, decode sequences per die, prefill busy share, which bound stopped
it, and the rate per chip. ``--microbatches 2`` turns on the prefill two-batch overlap
(``PrefillConfig.microbatches``, P052). No ``../shared`` needed; each ratio takes about two
minutes.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from xds.reproduce.production import measure
from xds.serve.presets import pd_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-tes", type=int, nargs="+", default=[4, 5, 6, 8])
    ap.add_argument("--window", type=float, default=300.0)
    ap.add_argument("--bisections", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=1, choices=[1, 2])
    args = ap.parse_args()
    base = pd_config("production-4p1d")
    print(
        f"{'deployment':>10} {'chips':>5} {'rate':>6} {'req/s/chip':>10} {'TPOT ms':>8} "
        f"{'TTFT ms':>8} {'seqs/die':>8} {'P busy':>6}  bound"
    )
    for tes in args.prefill_tes:
        prefill = msgspec.structs.replace(base.prefill, tes=tes, microbatches=args.microbatches)
        cfg = msgspec.structs.replace(base, prefill=prefill)
        wall = time.perf_counter()
        res = measure(window_s=args.window, bisections=args.bisections, config=cfg)
        found = res.found or res.points[0]
        rate = found.scale
        bound = "none below the cap" if res.capped else res.binding
        print(
            f"{f'{tes}P1D':>10} {cfg.chips:>5} {rate:>6g} {rate / cfg.chips:>10.3f} "
            f"{found.tpot_ms:>8.2f} {found.ttft_ms:>8,.0f} {found.decode_seqs_per_die:>8.1f} "
            f"{found.prefill_busy:>6.0%}  {bound} ({time.perf_counter() - wall:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
