"""Models: specs of the served models, kernel cost functions, and a tiny numeric reference MoE."""

from .costs import CostModel, Kernel, KernelEfficiency, Precision, check_attention
from .numerics import (
    dequantize_int8,
    from_bf16_bits,
    int8_error_bound,
    quantize_int8,
    round_bf16,
    round_scale_up,
    to_bf16_bits,
)
from .reference_moe import ReferenceMoE, TinyMoE
from .specs import (
    DEEPSEEK_V3,
    GLM_45,
    KIMI_K2,
    MINIMAX_M1,
    MODELS,
    QWEN3_235B,
    ModelSpec,
    check_context,
)

__all__ = [
    "DEEPSEEK_V3",
    "GLM_45",
    "KIMI_K2",
    "MINIMAX_M1",
    "MODELS",
    "QWEN3_235B",
    "CostModel",
    "Kernel",
    "KernelEfficiency",
    "ModelSpec",
    "Precision",
    "ReferenceMoE",
    "TinyMoE",
    "check_attention",
    "check_context",
    "dequantize_int8",
    "from_bf16_bits",
    "int8_error_bound",
    "quantize_int8",
    "round_bf16",
    "round_scale_up",
    "to_bf16_bits",
]
