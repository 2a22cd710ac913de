"""P047: A2E and E2A latency under MoE-attention disaggregation on the whole SuperPod.

Configuration: 3 DP domains x 160 attention dies (TP=1), 288 expert dies (256 routed experts +
32 shared-expert instances, one per die), DeepSeek-R1 (hidden 7168, top-8), 96 tokens per
attention die; one domain is active at a time, so one A2E is 160 attention dies -> 288 expert
dies through 160 trampolines (the first 160 expert dies, A17). A2E carries INT8 (P087-P089) and
so does E2A (P089: expert outputs are quantised before they cross dies). Transfers are
NPU-Direct URMA pushes (P046). The 768-die pod runs on the collective tier.

A2E latency: from the domain's common start to the last expert die holding all its rows.
E2A latency: from the experts' common start to the last attention die holding its result.
"""

from __future__ import annotations

from ..fabric.xccl.a2e import Mode
from ..serve.ma_config import MADecodeConfig, measure_ae
from . import Row, TableData

BATCH = 96
"""Tokens per attention die (P047)."""


def measure(
    *, mode: Mode = "trampoline", tier: str = "collective", seed: int = 0, batch: int = BATCH
) -> dict[str, float]:
    """A2E and E2A at the P047 configuration (:class:`~xds.serve.ma_config.MADecodeConfig`'s
    defaults) with ``batch`` tokens per attention die."""
    c = measure_ae(MADecodeConfig(mode=mode), batch, seed=seed, tier=tier)
    return {
        "a2e_us": c.a2e_ns / 1e3,
        "e2a_us": c.e2a_ns / 1e3,
        "attention_meta_writes": c.attention_meta_writes,
    }


def reproduce() -> tuple[list[Row], list[TableData]]:
    tramp = measure()
    direct = measure(mode="direct")
    rows = [
        Row("a2e_latency_us", 172.0, round(tramp["a2e_us"], 1), "us", "approx", 0.15),
        Row("e2a_latency_us", 193.0, round(tramp["e2a_us"], 1), "us", "approx", 0.15),
    ]
    table = TableData(
        "P047: A2E / E2A, 160 attention dies -> 288 expert dies, batch 96, DeepSeek-R1",
        ["mode", "A2E us", "E2A us", "metadata writes per attention die"],
        [
            [m, f"{r['a2e_us']:.1f}", f"{r['e2a_us']:.1f}", f"{r['attention_meta_writes']:.0f}"]
            for m, r in (("trampoline", tramp), ("direct", direct))
        ],
        notes=[
            "paper (P047): A2E 172 us, E2A 193 us",
            "direct (every attention die pushes to all 288 expert dies) comes out faster here, "
            "unlike P044: per-destination scalar work (EngineSpec.meta_issue_ns) costs the same "
            "on an attention die as on a trampoline, whose second hop has the same fan-out (at "
            "1 us per destination: trampoline 241 us, direct 197 us). The paper's gain would "
            "come from attention dies' AIVs being taken by attention compute, not charged here",
        ],
    )
    return rows, [table]
