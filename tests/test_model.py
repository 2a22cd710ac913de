"""Model specs, wire numerics and the kernel cost model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds.hw import ASCEND_910C_DIE
from xds.model import (
    DEEPSEEK_V3,
    GLM_45,
    KIMI_K2,
    MINIMAX_M1,
    QWEN3_235B,
    CostModel,
    Precision,
    dequantize_int8,
    from_bf16_bits,
    int8_error_bound,
    quantize_int8,
    round_bf16,
    to_bf16_bits,
)


def test_kv_bytes_match_the_published_derivations():
    # REFERENCE.md 2.1
    assert DEEPSEEK_V3.kv_bytes_per_token() == 70_272
    assert DEEPSEEK_V3.kv_bytes_per_token(int8_nope=True) == 39_040
    assert KIMI_K2.kv_bytes_per_token() == 70_272
    assert QWEN3_235B.kv_bytes_per_token() == 192_512
    assert GLM_45.kv_bytes_per_token() == 376_832
    assert MINIMAX_M1.kv_bytes_per_token() == 40_960
    assert DEEPSEEK_V3.expert_params == 44_040_192
    assert DEEPSEEK_V3.moe_layers == 58
    # a deployment that drafts caches the MTP layer's KV as well (61 + 1 layers)
    assert DEEPSEEK_V3.kv_bytes_per_token(mtp=True) == 70_272 // 61 * 62
    assert KIMI_K2.kv_bytes_per_token(mtp=True) == 70_272  # no MTP layer


@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=64))
def test_bf16_rounding_is_nearest_and_idempotent(values):
    x = np.array(values, np.float32)
    b = round_bf16(x)
    assert np.array_equal(round_bf16(b), b)
    assert np.all(np.abs(b - x) <= np.abs(x) * 2.0**-8 + 1e-38)
    assert np.array_equal(from_bf16_bits(to_bf16_bits(b)), b)


@given(
    st.lists(
        st.lists(st.floats(-100, 100, width=32), min_size=4, max_size=4), min_size=1, max_size=8
    )
)
def test_int8_round_trip_error_is_within_half_a_scale(rows):
    x = np.array(rows, np.float32)
    q, s = quantize_int8(x)
    assert q.dtype == np.int8 and s.shape == (len(rows),)
    err = np.abs(dequantize_int8(q, s) - x).max(axis=1)
    assert np.all(err <= int8_error_bound(x) * (1 + 1e-5) + 1e-6)


@given(
    st.lists(st.floats(0, 6.5e4, width=32), min_size=1, max_size=16),
    st.sampled_from(["bf16", "fp16"]),
)
def test_a_narrow_int8_scale_is_rounded_up_to_a_value_its_dtype_holds(scales, scale_dtype):
    from xds.model import round_scale_up

    s = np.array(scales, np.float32)
    up = round_scale_up(s, scale_dtype)
    assert np.all(up >= s)  # never smaller: x / s stays within +-127, nothing clips
    if scale_dtype == "bf16":
        assert np.array_equal(from_bf16_bits(to_bf16_bits(up)), up)  # held exactly
        assert np.all(up <= s * (1 + 2.0**-7) + 1e-38)  # at most one BF16 step up
    else:
        assert np.array_equal(up.astype(np.float16).astype(np.float32), up)


@given(
    st.lists(
        st.lists(st.floats(-100, 100, width=32), min_size=4, max_size=4), min_size=1, max_size=8
    ),
    st.sampled_from(["fp32", "bf16", "fp16"]),
)
def test_int8_with_any_scale_dtype_stays_within_half_its_scale(rows, scale_dtype):
    x = np.array(rows, np.float32)
    q, s = quantize_int8(x, scale_dtype)
    assert np.all(np.abs(q.astype(np.int32)) <= 127)
    err = np.abs(dequantize_int8(q, s) - x).max(axis=1)
    assert np.all(err <= int8_error_bound(x, scale_dtype) * (1 + 1e-5) + 1e-6)


def test_a_scale_beyond_fp16_range_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds FP16's range"):
        quantize_int8(np.array([[1e7, 0.0]], np.float32), "fp16")


CM = CostModel(DEEPSEEK_V3, ASCEND_910C_DIE)


def test_kernel_time_is_the_slower_of_compute_and_memory():
    k = CM.kernel("k", 1e12, 0, "cube_bf16")
    assert k.time_ns == round(1e12 / (ASCEND_910C_DIE.bf16_flops * 0.80) * 1e9)
    m = CM.kernel("m", 0, 1.6e9, "vector")
    assert m.time_ns == round(1.6e9 / (1.6e12 * 0.841) * 1e9)


def test_attention_grows_with_batch_and_sequence_length():
    base = CM.mla_attention(30, 1, 2048).time_ns
    assert CM.mla_attention(60, 1, 2048).time_ns > base
    assert CM.mla_attention(30, 1, 4096).time_ns > base
    # MTP tokens of a sequence share the KV read, not the compute
    one, two = CM.mla_attention(60, 1, 3072), CM.mla_attention(60, 2, 3072)
    assert two.bytes == one.bytes and two.flops == 2 * one.flops


def test_int8_switches_change_only_cost():
    bf16 = CostModel(DEEPSEEK_V3, ASCEND_910C_DIE, precision=Precision(moe_int8=False))
    assert CM.expert(0).bytes == 0  # an idle expert reads no weights
    e8, e16 = CM.expert(1), bf16.expert(1)
    assert e16.bytes > 1.9 * e8.bytes - 1e5  # weights dominate at 1 token: half the bytes
    kv8 = CostModel(DEEPSEEK_V3, ASCEND_910C_DIE, precision=Precision(kv_int8_nope=True))
    kv16 = CostModel(DEEPSEEK_V3, ASCEND_910C_DIE, precision=Precision(kv_int8_nope=False))
    assert kv8.mla_attention(60, 1, 2048).bytes / kv16.mla_attention(
        60, 1, 2048
    ).bytes == pytest.approx(640 / 1152)


def test_decode_layer_has_the_expected_kernels():
    dense = [k.name for k in CM.decode_layer(seqs=8, tokens_per_seq=1, context=512, dense=True)]
    moe = [
        k.name for k in CM.decode_layer(seqs=8, tokens_per_seq=1, context=512, expert_tokens=[64.0])
    ]
    assert "dense_mlp" in dense and "gating" not in dense
    assert "gating" in moe and "routed_expert" in moe and "mla_attention" in moe


def test_graph_mode_pays_one_launch_and_eager_mode_idles_on_short_operators():
    ks = [CM.kernel(f"op{i}", 0, 1_000, "vector") for i in range(10)]  # ~1 ns each
    assert CM.graph_time_ns(ks) == 700_000 + sum(k.time_ns for k in ks)
    eager = CM.eager_time_ns(ks)
    assert eager >= 10 * 30_000  # the device idles waiting for host dispatch


def test_hybrid_linear_attention_is_refused_clearly():
    from xds.errors import ConfigError

    with pytest.raises(ConfigError, match="lightning"):
        CostModel(MINIMAX_M1, ASCEND_910C_DIE)
    assert CostModel(QWEN3_235B, ASCEND_910C_DIE).attention_core(1, 1.0, 10).time_ns > 0
