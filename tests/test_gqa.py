"""GQA models (Qwen3-235B, GLM-4.5) through the cost model, prefill, colocated and
MoE-attention disaggregated decode and a PD replay; hybrid linear attention is refused by
name."""

from __future__ import annotations

import json

import msgspec
import pytest

import xds
from xds.cli.main import main
from xds.errors import ConfigError
from xds.hw import ASCEND_910C_DIE as DIE
from xds.hw import PodConfig
from xds.model import (
    DEEPSEEK_V3,
    GLM_45,
    MINIMAX_M1,
    QWEN3_235B,
    CostModel,
    KernelEfficiency,
    Precision,
)
from xds.serve.decode import CommCosts, DecodeConfig, DecodeInstance
from xds.serve.kv import kv_capacity_blocks
from xds.serve.ma_config import MADecodeConfig
from xds.serve.ma_decode import MADecodeInstance, ae_curve
from xds.serve.prefill import PrefillConfig
from xds.serve.prefill_cost import PrefillCost, prefill_hardware
from xds.serve.presets import pd_config
from xds.serve.replay import replay
from xds.trace.production import production_workload

EFF = KernelEfficiency()


def _ns(flops: float, nbytes: float, peak: float, compute: float, memory: float) -> int:
    return round(max(flops / (peak * compute), nbytes / (DIE.hbm_bandwidth * memory)) * 1e9)


def test_gqa_decode_kernels_match_hand_arithmetic():
    cm = CostModel(QWEN3_235B, DIE)  # 64 query heads, 4 KV heads of 128, hidden 4096
    att = cm.attention_core(32, 1.0, 4096)
    assert att.name == "gqa_attention"
    assert att.flops == 4.0 * 32 * 64 * 4096 * 128  # QK^T and PV, per head and cached token
    assert att.bytes == 32 * 4096 * (2 * 4 * 128)  # INT8 keys and values, read once a sequence
    bf16 = DIE.bf16_flops
    assert att.time_ns == _ns(
        att.flops, att.bytes, bf16, EFF.attention_compute, EFF.attention_memory
    )
    assert att.time_ns == _ns(0, att.bytes, bf16, 1, EFF.attention_memory)  # memory-bound
    # MTP tokens of a sequence share its KV read; a BF16 cache reads twice the bytes
    two = cm.attention_core(32, 2.0, 4096)
    assert (two.flops, two.bytes) == (2 * att.flops, att.bytes)
    bf16_cache = CostModel(QWEN3_235B, DIE, precision=Precision(kv_int8_nope=False))
    assert bf16_cache.attention_core(32, 1.0, 4096).bytes == 2 * att.bytes

    prolog = cm.attention_prolog(32.0)
    assert [k.name for k in prolog] == ["rmsnorm", "qkv_proj", "qk_norm"]
    qkv = prolog[1]
    assert qkv.engine == "cube_int8"  # W8A8 like MLA's projections
    assert qkv.flops == 2.0 * 32 * 4096 * (64 * 128 + 2 * 4 * 128)
    assert qkv.bytes == 4096 * 9216 + 32 * (4096 + 9216) * 2
    # one of 8 TP ranks: 8 query heads and one KV head (each of the 4 on two ranks), for
    # every token; it norms its eighth of the tokens
    rank = cm.gqa_prolog(32.0, tp=8)
    assert rank[1].flops == 2.0 * 32 * 4096 * (8 * 128 + 2 * 1 * 128)
    assert rank[0].flops == prolog[0].flops / 8
    assert cm.gqa_output(32.0, tp=8)[0].flops == 2.0 * 32 * 1024 * 4096
    (o_proj,) = cm.attention_output(32.0)
    assert (o_proj.name, o_proj.flops) == ("o_proj", 2.0 * 32 * 8192 * 4096)
    names = [k.name for k in cm.decode_layer(seqs=32, tokens_per_seq=1.0, context=4096)]
    assert "gqa_attention" in names and not any(n.startswith(("mla", "q_absorb")) for n in names)
    # DeepSeek's absorbed MLA does ~8.5x the FLOPs per cached token on twice the heads
    mla = CostModel(DEEPSEEK_V3, DIE).attention_core(32, 1.0, 4096)
    assert mla.name == "mla_attention" and mla.flops / att.flops == pytest.approx(8.5)


def test_gqa_weights_and_kv_split_over_attention_ranks():
    m, p = QWEN3_235B, Precision()
    assert m.mla_down_params == m.mla_head_params == m.kv_b_params == 0
    qo, kv = 2 * 4096 * 64 * 128, 2 * 4096 * 4 * 128
    assert m.attention_layer_params == qo + kv
    split = m.layers * qo + 2 * 2 * m.vocab * m.hidden  # INT8 projections, BF16 embeddings
    assert p.weight_bytes(m) == m.layers * kv + split
    # TP4: a quarter of q and o, one KV head's k and v each; TP8 replicates each KV head
    assert p.weight_bytes(m, tp=4) == m.layers * kv // 4 + split // 4
    assert p.weight_bytes(m, tp=8) == m.layers * kv // 4 + split // 8
    assert [m.kv_rank_share(tp) for tp in (1, 2, 4, 8)] == [1.0, 0.5, 0.25, 0.25]
    assert GLM_45.kv_rank_share(4) == 0.25 and DEEPSEEK_V3.kv_rank_share(4) == 1.0
    # a rank of a TP4 group holds a quarter of each token's KV: four times the tokens
    one = kv_capacity_blocks(m, DIE, weight_bytes=10 * 2**30)
    four = kv_capacity_blocks(m, DIE, weight_bytes=10 * 2**30, tp=4)
    assert 4 * one <= four < 4 * (one + 1)
    mla = kv_capacity_blocks(DEEPSEEK_V3, DIE, weight_bytes=10 * 2**30)
    assert kv_capacity_blocks(DEEPSEEK_V3, DIE, weight_bytes=10 * 2**30, tp=4) == mla


def test_gqa_prefill_attends_in_one_form_over_its_ranks_kv_heads():
    cfg = PrefillConfig()  # TP4 groups: 16 query heads and 1 KV head per rank
    die, link = prefill_hardware(cfg)
    cost = PrefillCost(QWEN3_235B, cfg, die, PodConfig().engines, link)
    index, form = cost._cheaper_form((4096, 8192), False)
    assert index == 0 and form.up_tokens == form.absorb_tokens == 0.0
    pairs = 2.0 * 4096 * (8192 + 4096 / 2) * 16
    assert form.flops == pairs * 2 * 128
    assert form.kv_bytes == (8192 + 4096) * 2 * 1 * 128  # INT8 K and V of one head
    short, long = cost.step_ns([[(1000, 0)]]), cost.step_ns([[(8000, 0)]])
    assert short < cost.step_ns([[(1000, 7000)]]) < long
    assert cost.step_ns(cost.sp_step(32_000, 0)) < cost.step_ns([[(32_000, 0)]])
    # the SP ring passes a rank's own KV heads only: a quarter of each token's KV here
    slow = PrefillCost(
        QWEN3_235B, cfg, die, PodConfig().engines, msgspec.structs.replace(link, bandwidth=1e6)
    )
    sp = cfg.dps_per_te
    ring = round(
        (sp - 1) * 8000 / sp * QWEN3_235B.kv_bytes_per_token_layer(int8_nope=True) / 4e6 * 1e9
    )
    assert ring in slow.layer_times(slow.sp_step(8000, 0))[0]
    # the fewer query heads make its prefill faster than DeepSeek-R1's on the same TE
    r1 = PrefillCost(DEEPSEEK_V3, cfg, die, PodConfig().engines, link)
    assert cost.step_ns([[(8000, 0)]]) < r1.step_ns([[(8000, 0)]])


SMALL = dict(dies=32, batch_per_die=6, input_tokens=256, output_tokens=24, shared_expert_dies=0)


def _decode(config: DecodeConfig):
    async def run():
        k = config.mtp_config.k
        comm = CommCosts(config.batch_per_die * (1 + k), 60_000, 110_000)
        inst = DecodeInstance(config, comm, CommCosts(6, 35_000, 60_000))
        return inst, await inst.serve(config.dies * config.batch_per_die)

    return xds.run(run, seed=0, event_log=False)


@pytest.mark.parametrize("model", ["qwen3-235b", "glm-4.5"])
def test_gqa_models_decode_every_token_and_free_their_kv(model):
    inst, res = _decode(DecodeConfig(model=model, **SMALL))
    assert (inst.streamed == SMALL["output_tokens"]).all()
    assert res.tokens == 32 * 6 * (SMALL["output_tokens"] - 1)
    assert all(kv.used == 0 for kv in inst.kv)
    assert res.breakdown.attention > 0 and res.breakdown.mla_other > 0
    # GLM-4.5 has an MTP layer and drafts by default; Qwen3-235B has none
    assert (res.mean_tokens_per_step > 1.0) == (model == "glm-4.5")
    longer = _decode(DecodeConfig(model=model, **{**SMALL, "input_tokens": 4096}))[1]
    assert longer.breakdown.attention > 4 * res.breakdown.attention  # memory-bound KV reads


def _decode_tier(config: DecodeConfig, tier: str):
    async def run():
        comm = CommCosts(config.batch_per_die, 60_000, 110_000)
        inst = DecodeInstance(config, comm, CommCosts(6, 35_000, 60_000), tier=tier)
        return await inst.serve(config.dies * config.batch_per_die, max_iterations=8)

    return xds.run(run, seed=0, event_log=False)


def test_gqa_layer_tier_matches_iteration_tier():
    cfg = DecodeConfig(model="qwen3-235b", **SMALL)
    a, b = _decode_tier(cfg, "iteration"), _decode_tier(cfg, "layer")
    assert a.iteration_ns == b.iteration_ns and a.breakdown == b.breakdown
    # the first dispatch of a model without dense layers (the layer tier once reported 0.0)
    assert a.first_dispatch_max_over_min == b.first_dispatch_max_over_min >= 1.0


def test_gqa_ma_decode_generates_every_token():
    cfg = MADecodeConfig(
        model="qwen3-235b",
        domains=3,
        attention_dies_per_domain=8,
        expert_dies=32,
        shared_expert_dies=0,
        batch_per_die=8,
        input_tokens=256,
        output_tokens=6,
    )

    curve = ae_curve(cfg)  # measured in its own run, on the fabric

    async def run():
        return await MADecodeInstance(cfg, curve, record=False).serve()

    res = xds.run(run, seed=0, event_log=False)
    assert res.tokens == 3 * 8 * 8 * (6 - 1)  # the first token of each came from prefill
    assert res.mean_tokens_per_step == 1.0  # no MTP layer


def test_gqa_pd_replay_completes_every_request():
    base = pd_config("production-4p1d")
    cfg = msgspec.structs.replace(
        base, decode=msgspec.structs.replace(base.decode, model="qwen3-235b", shared_expert_dies=0)
    )
    wl = production_workload(40, rate_per_s=2.0, seed=3)
    res = replay(wl, cfg)
    assert res.summary.completed == len(wl) and res.summary.failed == 0
    assert sum(r.output_tokens for r in res.records) == sum(r.output_tokens for r in wl.requests)
    r1 = replay(wl, base).summary
    assert res.summary.ttft_ms.mean < r1.ttft_ms.mean  # 22B active parameters against 37B


def test_a_prefill_rank_caches_its_kv_heads_only():
    from xds.serve.replay import _prefill_kv_blocks

    base = pd_config("production-4p1d")
    qwen = msgspec.structs.replace(base.decode, model="qwen3-235b", shared_expert_dies=0)
    die = prefill_hardware(base.prefill)[0]
    blocks = {}
    for tp in (1, 4):
        p = msgspec.structs.replace(base.prefill, attention_tp=tp)
        blocks[tp] = _prefill_kv_blocks(p, qwen, die)
        weights = p.precision.weight_bytes(QWEN3_235B, experts=128 // 32, tp=tp)
        assert blocks[tp] == kv_capacity_blocks(QWEN3_235B, die, weight_bytes=weights, tp=tp)
    assert blocks[4] > 3.5 * blocks[1]  # a quarter of each token's KV, less weight per rank


def test_spec_dimensions_are_checked_by_field():
    bad = [
        (QWEN3_235B, {"kv_heads": 0}, "kv_heads", ">= 1"),
        (QWEN3_235B, {"head_dim": 0}, "head_dim", ">= 1"),
        (QWEN3_235B, {"kv_heads": 3}, "kv_heads", "divisor of heads"),
        (QWEN3_235B, {"kv_heads": 128}, "kv_heads", "divisor of heads"),
        (QWEN3_235B, {"top_k": 200}, "top_k", "<= 128"),
        (QWEN3_235B, {"dense_layers": 94}, "dense_layers", "0..93"),
        (DEEPSEEK_V3, {"attention": "gqa", "kv_heads": 8, "head_dim": 128}, "q_lora_rank", "MLA"),
        (DEEPSEEK_V3, {"kv_lora_rank": 0}, "kv_lora_rank", ">= 1"),
        (MINIMAX_M1, {"softmax_layers": 0}, "softmax_layers", "1..80"),
    ]
    for spec, change, field, match in bad:
        with pytest.raises(ConfigError, match=match) as exc:
            msgspec.structs.replace(spec, **change)
        assert exc.value.field == field


def test_unmodelled_attention_and_mismatched_layouts_are_clear_errors():
    with pytest.raises(ConfigError, match="lightning") as exc:
        CostModel(MINIMAX_M1, DIE)
    assert exc.value.field == "model" and "MLA" in str(exc.value) and "GQA" in str(exc.value)
    with pytest.raises(ConfigError, match="lightning"):
        DecodeConfig(model="minimax-m1", dies=32, shared_expert_dies=0)
    with pytest.raises(ConfigError, match="no shared expert") as exc:
        DecodeConfig(model="qwen3-235b", dies=32, shared_expert_dies=4)
    assert exc.value.field == "shared_expert_dies"
    with pytest.raises(ConfigError, match="no shared expert"):
        MADecodeConfig(model="qwen3-235b")
    base = pd_config("production-4p1d")
    glm = msgspec.structs.replace(base.decode, model="glm-4.5")
    with pytest.raises(ConfigError, match="8 KV heads") as exc:
        msgspec.structs.replace(
            base, decode=glm, prefill=PrefillConfig(attention_tp=3, dies_per_te=24)
        )
    assert exc.value.field == "prefill.attention_tp"


def test_cli_decodes_a_gqa_deployment_file(tmp_path, capsys):
    dep = tmp_path / "qwen3.toml"
    dep.write_text(
        'model = "qwen3-235b"\ndies = 32\nbatch_per_die = 4\nshared_expert_dies = 0\n'
        "input_tokens = 512\noutput_tokens = 6\n"
    )
    assert main(["decode", "--deployment", str(dep)]) == 0
    out = capsys.readouterr().out
    assert "gqa_other" in out and "mla_other" not in out
    assert main(["decode", "--deployment", str(dep), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iterations"] >= 5
    dep.write_text('model = "minimax-m1"\ndies = 32\nshared_expert_dies = 0\n')
    assert main(["decode", "--deployment", str(dep)]) == 2
    assert "lightning" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "total_b", "active_b"),
    [  # the model cards' figures (REFERENCE.md 2); GLM-4.5's card leaves out its 1.55B of
        # embedding and LM head, which DeepSeek's counts (and xds does)
        (DEEPSEEK_V3, 671, 37),
        (QWEN3_235B, 235, 22),
        (GLM_45, 355, 32 + 1.55),
    ],
)
def test_parameter_counts_match_the_published_sizes(model, total_b, active_b):
    assert model.total_params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert model.active_params / 1e9 == pytest.approx(active_b, rel=0.05)


def test_cli_lists_the_models_and_which_are_served(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["qwen3-235b"]["attention"] == "gqa" and rows["qwen3-235b"]["not_served"] is None
    assert rows["qwen3-235b"]["kv_bytes_per_token_bf16"] == 192_512
    assert rows["kimi-k2"]["total_params"] == pytest.approx(1.03e12, rel=0.01)
    assert "lightning" in rows["minimax-m1"]["not_served"]
    assert rows["minimax-m1"]["total_params"] is None
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "235B / 22.1B" in out and "minimax-m1: not served" in out
    assert rows["deepseek-r1"]["max_context_tokens"] == 163_840


@pytest.mark.parametrize("model", ["kimi-k2", "qwen3-235b", "glm-4.5"])
def test_decode_refuses_a_sequence_longer_than_the_models_context(model):
    """Colocated and MA decode once served 150K-token sequences on 128K-context models (a
    PD replay fails them with a reason)."""
    from xds.serve.ma_config import MADecodeConfig

    kw = {"model": model, "input_tokens": 131_000, "output_tokens": 100}
    with pytest.raises(ConfigError, match="context of 131,072 tokens") as err:
        DecodeConfig(**{**SMALL, **kw, "shared_expert_dies": 0})
    assert err.value.field == "input_tokens"
    ma = {"attention_dies_per_domain": 8, "expert_dies": 32, "shared_expert_dies": 0}
    with pytest.raises(ConfigError, match="context of 131,072 tokens"):
        MADecodeConfig(**ma, **kw)
    DecodeConfig(**{**SMALL, **kw, "input_tokens": 130_000, "shared_expert_dies": 0})
