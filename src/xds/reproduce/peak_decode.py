"""SPEC 12.2 (P122-P123, Figure 20): peak decode, PD colocated, DP288/EP288.

18 servers = 288 dies; every die is a DP group (batch 60) and an EP rank (256 dies hold a routed
expert, 32 a shared-expert instance, each with a redundant slot); 1 MTP layer accepted ~90 %;
fixed 2K prompts and 2K outputs, ignore-eos, greedy; all prefills done before decode starts.
Iterations run on the iteration tier (the layer tier agrees exactly, see the tests).

Costs: kernel times from :mod:`xds.model.costs` (efficiencies measured by CloudMatrix-Infer
on the same chip), dispatch/combine from the collective tier of :mod:`xds.fabric.xccl.ep`
(all-to-all efficiency fitted on DeepEP-Ascend; the static pull order, see
:data:`xds.fabric.xccl.moe.PullOrder`: the staggered one gives 76.5 ms iterations), graph
launch 0.7 ms per graph (CMI), the 2 ms scheduler gap (P123), jitter sources with the paper's
mitigations on. Nothing here was fitted to the rows below.
"""

from __future__ import annotations

import numpy as np

from ..runtime import run
from ..serve.decode import Breakdown, DecodeConfig, DecodeInstance, DecodeResult, measure_comm
from . import Row, TableData


def measure(
    config: DecodeConfig | None = None,
    *,
    iterations: int | None = None,
    seed: int = 0,
    tier: str = "iteration",
) -> DecodeResult:
    cfg = config or DecodeConfig()
    comm = measure_comm(cfg, cfg.batch_per_die * (1 + cfg.mtp_config.k), seed=seed)
    comm_mtp = measure_comm(cfg, cfg.batch_per_die, seed=seed)

    async def main() -> DecodeResult:
        instance = DecodeInstance(cfg, comm, comm_mtp, tier=tier)
        result = await instance.serve(cfg.dies * cfg.batch_per_die, max_iterations=iterations)
        if iterations is None:
            for kv in instance.kv:
                kv.check()
                assert kv.free == kv.capacity, "KV blocks leaked"
            assert (instance.streamed == cfg.output_tokens).all(), "tokens lost or duplicated"
        return result

    return run(main, seed=seed, event_log=False)


def _labels() -> dict[str, str]:
    return {
        "attention": "MLA attention",
        "mla_other": "MLA prolog/output + norms",
        "gating": "gating",
        "dispatch": "dispatch",
        "experts": "expert GEMMs (slowest die)",
        "combine": "combine",
        "dense_mlp": "dense MLP (3 layers)",
        "lm_head": "LM heads",
        "sampling": "sampling",
        "launch": "graph launches",
        "jitter_wait": "jitter at dispatch",
    }


def reproduce(quick: bool = False) -> tuple[list[Row], list[TableData]]:
    cfg = DecodeConfig()
    res = measure(cfg, iterations=40 if quick else None)
    gap = cfg.scheduler_gap_ns
    iteration_ms = (res.mean_iteration_ns - gap) / 1e6
    tpot_ms = res.mean_iteration_ns / 1e6 / res.mean_tokens_per_step
    total = res.tokens / (res.elapsed_ns / 1e9)
    per_chip = total / (cfg.dies / 2)
    bd: Breakdown = res.breakdown
    kernel_total = bd.total()
    rows = [
        Row("iteration_ms", 93.0, round(iteration_ms, 2), "ms", "approx", 0.10),
        Row("tpot_ms", 50.0, round(tpot_ms, 2), "ms", "approx", 0.10),
        Row("tokens_per_s_per_chip", 2400.0, round(per_chip, 1), "tokens/s", "approx", 0.10),
        Row("total_tokens_per_s", 345600.0, round(total), "tokens/s", "approx", 0.10),
        Row(
            "attention_share",
            0.218,
            round(bd.attention / kernel_total, 4),
            "fraction",
            "approx",
            0.15,
        ),
        Row(
            "dispatch_combine_share",
            0.36,
            round((bd.dispatch + bd.combine) / kernel_total, 4),
            "fraction",
            "approx",
            0.15,
        ),
        Row(
            "dispatch_max_over_min",
            10.0,
            round(res.first_dispatch_max_over_min, 2),
            "x",
            "approx",
            0.5,
        ),
    ]
    per_iter = [(name, getattr(bd, name) / res.iterations / 1e6) for name in _labels()]
    table = TableData(
        f"Figure 20: decode iteration by kernel ({res.iterations} iterations, "
        f"{res.requests} requests{', quick prefix' if quick else ''})",
        ["kernel", "ms / iteration", "share"],
        [[_labels()[n], f"{v:.2f}", f"{getattr(bd, n) / kernel_total:.1%}"] for n, v in per_iter],
        notes=[
            f"iteration {iteration_ms:.1f} ms + {gap / 1e6:.0f} ms gap, "
            f"{res.mean_tokens_per_step:.3f} tokens/step, TPOT {tpot_ms:.1f} ms",
            f"virtual time {res.elapsed_ns / 1e9:.1f} s, {res.tokens:,} tokens; "
            f"iteration p50 {np.percentile(res.iteration_ns, 50) / 1e6:.1f} ms",
            f"dispatch/combine pull order: {cfg.pull_order} (SPEC 4.3 leaves it open; "
            "benchmarks/a2a_pull_order.py runs both)",
        ],
    )
    return rows, [table]
