"""``xds reproduce``: rows, relations and the JSON object of ARCHITECTURE.md."""

from __future__ import annotations

import json

import pytest

from xds.cli.main import main
from xds.errors import ConfigError
from xds.reproduce import Row, run_target, target_names
from xds.reproduce.p2p import AIVS, PAYLOADS, measure
from xds.units import MiB


def test_row_relations():
    assert Row("a", 20, 17, "us", "lt").ok and not Row("a", 20, 21, "us", "lt").ok
    assert Row("b", 2.5, 2.7, "x", "gt").ok and not Row("b", 2.5, 2.4, "x", "gt").ok
    assert Row("c", 100, 109, "ms", "approx", 0.1).ok
    assert not Row("c", 100, 111, "ms", "approx", 0.1).ok


def test_p2p_meets_figure_5():
    result = run_target("p2p")
    rows = {r.name: r for r in result.rows}
    assert set(rows) == {"max_latency_us_below_1MiB_aiv2", "speedup_9MiB_aiv48_vs_aiv2"}
    assert all(r.ok for r in result.rows), result.rows
    assert len(result.tables[0].rows) == len(PAYLOADS)


def test_p2p_latency_grows_with_payload_and_falls_with_aivs_for_large_messages():
    lat = measure()
    for aivs in AIVS:
        series = [lat[(p, aivs)] for p in PAYLOADS]
        assert series == sorted(series)
    big = [lat[(9 * MiB, a)] for a in AIVS]
    assert big == sorted(big, reverse=True)


def test_reproduce_cli_json(capsys):
    assert main(["reproduce", "p2p", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["target"] == "p2p" and obj["wall_s"] > 0
    assert {"name", "paper", "xds", "unit", "relation", "tolerance"} <= set(obj["rows"][0])
    assert [r["ok"] for r in obj["rows"]] == [True, True]  # the verdict the table prints


def test_unknown_target_is_a_clear_error(capsys):
    with pytest.raises(ConfigError):
        run_target("nope")
    assert main(["reproduce", "nope"]) == 2
    assert "unknown target" in capsys.readouterr().err
    assert "p2p" in target_names()


def test_all_targets_are_registered():
    assert target_names() == [
        "p2p",
        "dispatch-combine",
        "a2e-e2a",
        "peak-decode",
        "ma-decode",
        "eplb",
        "production",
    ]


def test_production_rate_search_stops_at_the_first_rate_missing_the_sla():
    from test_replay import SMALL
    from xds.reproduce.production import TPOT_SLA_MS, TTFT_SLA_MS, measure
    from xds.serve.capacity import KEEP_UP

    res = measure(window_s=10.0, bisections=1, config=SMALL)
    seen = {p.scale: p for p in res.points}
    rate = res.found.scale

    def meets(r):
        p = seen[r]
        backlog = p.backlog_ratio > KEEP_UP and p.backlog_excess_ms > TTFT_SLA_MS / 4
        return p.tpot_ms <= TPOT_SLA_MS and p.ttft_ms <= TTFT_SLA_MS and not backlog

    assert rate in seen and meets(rate)
    assert all(meets(r) for r in seen if r <= rate)
    assert any(not meets(r) for r in seen if r > rate)  # the search bracketed the limit
    assert all(seen[r].meets == meets(r) for r in seen)
    assert all(0.0 <= p.prefix_hits <= 1.0 and 0.0 <= p.prefill_busy <= 1.0 for p in seen.values())
    # past the limit prefill is the bottleneck: busier than at the first (lightest) rate
    assert max(p.prefill_busy for r, p in seen.items() if r > rate) > seen[min(seen)].prefill_busy


def test_dispatch_combine_sweep_on_a_small_group():
    from xds.reproduce.dispatch_combine import crossover
    from xds.reproduce.dispatch_combine import measure as measure_dc

    lat = measure_dc([1, 64], ep=16)
    assert lat[64][0] > lat[1][0] and lat[64][1] > lat[1][1]
    assert lat[64][0] < lat[64][1]  # INT8 dispatch moves half the bytes of BF16 combine
    assert crossover({1: (10, 5), 8: (8, 8), 16: (6, 10)}) == 8.0
    assert crossover({1: (5, 10), 8: (6, 10)}) == 0.0
    assert crossover({1: (15, 10), 8: (16, 10)}) == 8.0


def test_a2e_and_e2a_move_the_same_int8_copies_at_the_p047_configuration():
    """Both directions carry every (token, expert) copy in INT8 over the same two hops, each
    DMA queue paying its start-up once: their latencies agree within a few %. (SPEC 5.6 asks
    for E2A > A2E, the paper's 193 vs 172 us; xds's E2A adds only the attention die's
    dequantisation and weighting, and its two hops' bottlenecks differ, so it does not
    reproduce that 12 % gap: README, "Reproducing the paper".)"""
    from xds.reproduce.a2e_e2a import measure as measure_ae

    lat = measure_ae()
    assert min(lat["a2e_us"], lat["e2a_us"]) > 100.0
    assert abs(lat["e2a_us"] - lat["a2e_us"]) < 0.05 * lat["a2e_us"]
    assert lat["attention_meta_writes"] == 1


def test_a_dma_queue_starts_no_descriptor_before_it_is_up():
    """A push's later blocks on a DMA queue wait for the queue's start-up, as its first does:
    no block lands before the DMA start-up has passed (a block behind another on its queue
    used to start at its descriptor's issue and land first)."""
    import anyio
    import numpy as np

    import xds
    from xds.fabric import UBFabric
    from xds.fabric.xccl.a2e import AEConfig, AEGroup
    from xds.fabric.xccl.moe import ExpertMap

    pod = xds.hw.CloudMatrix384(servers=1)

    def landing(experts: list[int]) -> dict[int, int]:
        async def main():
            fabric = UBFabric(pod, payload_mode="size")
            group = AEGroup(
                fabric,
                [0],
                list(range(1, 9)),
                ExpertMap(8, 8),
                AEConfig(hidden=7168, top_k=1, mode="direct"),
            )
            got = {}

            async def expert(j: int) -> None:
                if (await group.expert_receive(j, event_id=1)).n:
                    got[j] = xds.now_ns()

            async with anyio.create_task_group() as tg:
                tg.start_soon(group.a2e, 0, len(experts), np.array(experts).reshape(-1, 1), 1)
                for j in range(8):
                    tg.start_soon(expert, j)
            return got

        return xds.run(main)

    for experts in ([4], [0, 4]):
        got = landing(experts)
        assert sorted(got) == sorted(experts)
        assert min(got.values()) > pod.engines.dma_startup_ns
