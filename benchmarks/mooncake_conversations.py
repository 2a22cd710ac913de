"""Multi-turn statistics of Mooncake's Kimi conversation trace: the source of the defaults of
:class:`xds.trace.production.Conversations`.

    python benchmarks/mooncake_conversations.py [--trace PATH] [--min-blocks N]

For every request it finds the longest run of leading ``hash_ids`` that an earlier request
also had (an infinite prefix cache). A request whose shared run is longer than
``--min-blocks`` blocks (default 2, i.e. more than a system prompt) counts as a **follow-up**
of the latest earlier request with that run. Printed: the follow-up share, the gap between a
follow-up and that request (log-normal fit: median, sigma from p10/p90), the new tokens a
follow-up adds (median, mean, log-normal sigma from mean/median) and the infinite-cache prefix
reuse. Then the same statistics of xds's generated production workload, measured the same way
(a round trip: the generator takes the trace's numbers as parameters; its output is not fitted
to them). Needs ``../shared/data``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from _data import MOONCAKE_CONVERSATION
from xds.trace import load_mooncake
from xds.trace.production import PrefixTrie, prefix_reuse, production_workload
from xds.trace.workload import Workload

DEFAULT = MOONCAKE_CONVERSATION
Z90 = 1.2816  # standard normal quantile of 0.9


def follow_ups(w: Workload, min_blocks: int, block_tokens: int = 512) -> dict[str, np.ndarray]:
    trie = PrefixTrie()
    last_seen: dict[int, int] = {}  # trie node -> arrival of the latest request through it
    gaps, new, shared_frac = [], [], []
    for r in w.requests:
        k, nodes = trie.match(r.prefix_hashes)
        if k > min_blocks:
            shared = min(k * block_tokens, r.input_tokens)
            gaps.append((r.arrival_ns - last_seen[nodes[k - 1]]) / 1e9)
            new.append(r.input_tokens - shared)
            shared_frac.append(shared / r.input_tokens)
        for node in nodes:
            last_seen[node] = r.arrival_ns
    return {"gap_s": np.array(gaps), "new": np.array(new), "shared": np.array(shared_frac)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--min-blocks", type=int, default=2)
    args = ap.parse_args()
    report(f"trace: {args.trace}", load_mooncake(args.trace), args.min_blocks)
    print()
    gen = production_workload(20_000, rate_per_s=10.0, seed=0)
    report("xds production workload at 10/s, measured the same way", gen, 2)


def report(title: str, w: Workload, min_blocks: int) -> None:
    f = follow_ups(w, min_blocks)
    p10, p50, p90 = np.percentile(f["gap_s"], [10, 50, 90])
    new_pos = np.maximum(f["new"], 1)
    new_median, new_mean = float(np.median(new_pos)), float(new_pos.mean())
    print(f"{title} ({len(w):,} requests)")
    share = len(f["gap_s"]) / len(w)
    print(f"  follow-up share (shared run > {min_blocks} blocks): {share:.3f}")
    print(
        f"  turn gap: p10 {p10:.0f} s, p50 {p50:.0f} s, p90 {p90:.0f} s; "
        f"log-normal sigma {(math.log(p90) - math.log(p10)) / (2 * Z90):.3f}"
    )
    print(
        f"  new tokens per follow-up: p50 {new_median:.0f}, mean {new_mean:.0f}; "
        f"log-normal sigma {math.sqrt(2 * math.log(new_mean / new_median)):.2f}"
    )
    print(f"  shared share of a follow-up's prompt: mean {f['shared'].mean():.3f}")
    print(f"  infinite-cache prefix reuse (tokens): {prefix_reuse(w):.3f}")


if __name__ == "__main__":
    main()
