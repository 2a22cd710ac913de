"""Multi-turn production workload (prefix structure) and prefix-cache accounting in a replay."""

from __future__ import annotations

import numpy as np
import pytest

from xds.errors import ConfigError
from xds.serve.decode import DecodeConfig
from xds.serve.jitter import JitterConfig
from xds.serve.prefill import PrefillConfig
from xds.serve.replay import PDConfig, replay
from xds.trace import Request, Workload
from xds.trace.production import (
    BLOCK_TOKENS,
    INPUT_MAX,
    NO_CONVERSATIONS,
    Conversations,
    prefix_reuse,
    production_workload,
)
from xds.units import S

SMALL = PDConfig(
    prefill=PrefillConfig(tes=2, long_pool_tes=0),
    decode=DecodeConfig(
        dies=32, batch_per_die=4, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
    ),
)


def _parents(w: Workload) -> dict[int, int]:
    """Request -> the latest earlier request sharing its longest run of leading blocks."""
    last_use: dict[tuple[int, ...], int] = {}
    out = {}
    for r in w.requests:
        for k in range(len(r.prefix_hashes), 0, -1):
            j = last_use.get(tuple(r.prefix_hashes[:k]))
            if j is not None:
                out[r.request_id] = j
                break
        for k in range(1, len(r.prefix_hashes) + 1):
            last_use[tuple(r.prefix_hashes[:k])] = r.request_id
    return out


def test_follow_ups_extend_an_earlier_prompt_by_its_full_blocks():
    w = production_workload(3_000, rate_per_s=5.0, seed=4)  # a 600 s window
    by_id = {r.request_id: r for r in w.requests}
    parents = _parents(w)
    assert 0.1 < len(parents) / len(w) < 0.341  # follow-ups whose parent is in the window
    for child, parent in parents.items():
        c, p = by_id[child], by_id[parent]
        full = p.input_tokens // BLOCK_TOKENS
        assert p.arrival_ns <= c.arrival_ns
        assert c.prefix_hashes[:full] == p.prefix_hashes[:full]
        assert c.input_tokens > full * BLOCK_TOKENS  # the earlier full blocks plus new tokens
        # nothing beyond the parent's full blocks is shared with anyone
        assert full == len(c.prefix_hashes) or c.prefix_hashes[full] not in p.prefix_hashes
    for r in w.requests:
        assert len(r.prefix_hashes) == -(-r.input_tokens // BLOCK_TOKENS)
        assert 1 <= r.input_tokens <= INPUT_MAX
    # each turn is continued at most once (a conversation is a chain)
    assert len(set(parents.values())) == len(parents)


def test_turn_gaps_follow_the_configured_distribution():
    conv = Conversations(gap_median_s=30.0, gap_sigma=0.0)  # every gap exactly 30 s
    w = production_workload(2_000, rate_per_s=10.0, seed=1, conversations=conv)
    by_id = {r.request_id: r for r in w.requests}
    gaps = [(by_id[c].arrival_ns - by_id[p].arrival_ns) / S for c, p in _parents(w).items()]
    # the nearest free earlier turn at or before 30 s back (a few arrivals at 10/s)
    assert gaps and min(gaps) >= 30.0 and np.median(gaps) < 31.0


def test_steady_state_reuse_is_near_the_mooncake_trace_without_being_fitted():
    w = production_workload(20_000, rate_per_s=10.0, seed=0)
    inputs = np.array([r.input_tokens for r in w.requests])
    assert abs(inputs.mean() / 13_000 - 1) < 0.03
    assert 0.2 < prefix_reuse(w) < 0.4  # Mooncake conversation trace: 0.374


def test_no_conversations_means_unique_prompts():
    w = production_workload(500, rate_per_s=10.0, seed=0, conversations=NO_CONVERSATIONS)
    assert prefix_reuse(w) == 0.0
    assert w.requests[0].arrival_ns == 0


def test_hashes_at_a_deployments_block_size_share_the_same_tokens():
    a = production_workload(2000, rate_per_s=10.0, seed=0)
    b = production_workload(2000, rate_per_s=10.0, seed=0, block_tokens=256)
    assert (a.hash_block_tokens, b.hash_block_tokens) == (512, 256)
    assert [r.input_tokens for r in a.requests] == [r.input_tokens for r in b.requests]
    assert all(len(r.prefix_hashes) == -(-r.input_tokens // 256) for r in b.requests)
    assert prefix_reuse(b, 256) == pytest.approx(prefix_reuse(a))  # 512-block sharing, halved


def test_prefix_reuse_counts_leading_blocks_seen_before():
    w = Workload(
        (
            Request(0, 0, 1024, 1, (1, 2)),
            Request(1, 1, 1500, 1, (1, 2, 3)),  # 1024 of 1500 reusable
            Request(2, 2, 600, 1, (9, 2)),  # the 2 is not leading: nothing
            Request(3, 3, 300, 1, (1,)),  # whole prompt (300 < one block)
        )
    )
    assert prefix_reuse(w) == pytest.approx((1024 + 300) / (1024 + 1500 + 600 + 300))


@pytest.mark.parametrize(
    ("field", "value"),
    [("follow_up", 1.0), ("gap_median_s", 0.0), ("new_sigma", -1.0), ("history_s", -1.0)],
)
def test_bad_conversation_shapes_name_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        Conversations(**{field: value})
    assert err.value.field == field


def test_replay_records_prefix_cache_hits_of_a_follow_up():
    first = Request(0, 0, 4096, 4, tuple(range(8)))
    # arrives with the first: nothing is cached yet
    racing = Request(1, 0, 4096 + 50, 4, (*range(8), 200))
    # arrives long after the first prompt was prefilled: its 8 blocks are cached
    follow = Request(2, 2 * S, 4096 + 700, 4, (*range(8), 100, 101))
    res = replay(Workload((first, racing, follow), hash_block_tokens=BLOCK_TOKENS), SMALL)
    rec = {r.request_id: r for r in res.records}
    assert rec[0].cached_tokens == 0 and rec[1].cached_tokens == 0
    assert rec[2].cached_tokens == 8 * BLOCK_TOKENS
    total = sum(r.input_tokens for r in (first, follow, racing))
    assert res.summary.prefix_hit_ratio == pytest.approx(8 * BLOCK_TOKENS / total)
    # the hit shortens the follow-up's prefill against an uncached prompt of its length
    cold_prompt = Request(0, 0, 4096 + 700, 4, (*range(500, 508), 100, 101))
    cold = replay(Workload((cold_prompt,), hash_block_tokens=BLOCK_TOKENS), SMALL)
    assert rec[2].ttft_ns < cold.records[0].ttft_ns


def test_cli_built_in_workload_with_and_without_conversations(tmp_path, capsys, monkeypatch):
    import json

    import xds.trace.production as production
    from xds.cli.main import main

    used = []

    def spy(*args, **kwargs):
        used.append(kwargs["conversations"])
        return production_workload(*args, **kwargs)

    monkeypatch.setattr(production, "production_workload", spy)
    for flag in ([], ["--unique-prompts"]):
        out = tmp_path / str(len(used))
        argv = ["replay", "--synthetic", "6", "--rate", "3", "--out", str(out), "--json"]
        assert main(argv + flag) == 0
        assert json.loads(capsys.readouterr().out)["requests"] == 6
    assert used == [production.MOONCAKE_CONVERSATIONS, NO_CONVERSATIONS]
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert all(r["cached_tokens"] == 0 for r in recs)  # unique prompts never hit
    # the flag belongs to the built-in workload
    assert main(["replay", str(tmp_path / "t.jsonl"), "--unique-prompts"]) == 2
    assert "--unique-prompts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "conv",
    [NO_CONVERSATIONS, Conversations(history_s=0.0)],  # (no parents hidden before time 0)
    ids=["unique", "chat"],
)
def test_one_seed_gives_the_same_requests_at_every_rate_and_length(conv):
    """Common random numbers: a rate only scales the gaps between arrivals; outputs and first
    turns are the same requests, and a shorter workload is the longer one's prefix."""
    slow = production_workload(400, rate_per_s=2.0, seed=5, conversations=conv)
    fast = production_workload(400, rate_per_s=8.0, seed=5, conversations=conv)
    assert [r.output_tokens for r in slow.requests] == [r.output_tokens for r in fast.requests]
    gaps = np.diff([r.arrival_ns for r in slow.requests])
    assert np.allclose(gaps, 4 * np.diff([r.arrival_ns for r in fast.requests]), atol=4)
    followups = _parents(slow).keys() | _parents(fast).keys()
    firsts = [i for i in range(len(slow)) if i not in followups]  # a first turn at both rates
    assert len(firsts) > 200
    same = [slow.requests[i].input_tokens == fast.requests[i].input_tokens for i in firsts]
    assert np.mean(same) > 0.95  # (a follow-up of a prompt under one block shares no hash)
    if conv is NO_CONVERSATIONS:
        assert [r.input_tokens for r in slow.requests] == [r.input_tokens for r in fast.requests]
    short = production_workload(100, rate_per_s=2.0, seed=5, conversations=conv)
    assert short.requests == slow.requests[:100]
    other = production_workload(400, rate_per_s=2.0, seed=6, conversations=conv)
    assert [r.output_tokens for r in other.requests] != [r.output_tokens for r in slow.requests]


def test_a_rate_whose_history_is_too_long_to_draw_is_a_clear_error():
    """Conversations under way before the first request cover history_s of arrivals: at an
    absurd rate that is billions of draws (it used to end in a numpy MemoryError)."""
    with pytest.raises(ConfigError, match=r"rate_per_s.*up to 1,667 req/s") as err:
        production_workload(3, rate_per_s=1e9)
    assert err.value.field == "rate_per_s"
    assert len(production_workload(3, rate_per_s=1e9, conversations=NO_CONVERSATIONS)) == 3
