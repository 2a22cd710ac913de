"""Number formats used on the wire: BF16 rounding and token-wise INT8 (SPEC 9.3).

numpy has no bfloat16, so BF16 values are held as float32 arrays whose low 16 mantissa bits are
zero (round to nearest even), and as ``uint16`` bit patterns when they travel as bytes.

INT8 is symmetric and token-wise: one scale per token (row), ``s = max|x_t| / 127`` and
``q = round(x / s)``; the round-trip error per element is at most ``s / 2``. The scale travels
as FP32 (4 bytes) by default, or as BF16 or FP16 (2 bytes; SPEC 9.3: "the scale dtype is a
parameter"): then ``s`` is rounded *up* to the next value that format holds, so no element
clips, and the bound ``s / 2`` holds with the rounded ``s`` (for BF16 up to 2**-7 larger).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

INT8_MAX = 127
ScaleDtype = Literal["fp32", "bf16", "fp16"]
"""How an INT8 row's per-token scale travels (SPEC 9.3)."""
SCALE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
FP16_MAX = 65504.0


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (``uint16``), rounding to nearest even."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (``uint16``) -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest BF16 value (result stays float32)."""
    return from_bf16_bits(to_bf16_bits(x))


def round_scale_up(scale: np.ndarray, scale_dtype: ScaleDtype) -> np.ndarray:
    """Non-negative float32 ``scale`` rounded up to values ``scale_dtype`` holds exactly (still
    float32): a scale never shrinks, so ``x / s`` stays within +-127."""
    scale = np.ascontiguousarray(scale, dtype=np.float32)
    if scale_dtype == "fp32":
        return scale
    if scale_dtype == "bf16":
        bits = scale.view(np.uint32)
        up = (bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)  # truncate after adding ulp-1
        return up.view(np.float32)
    if scale_dtype == "fp16":
        if scale.size and not float(scale.max()) <= FP16_MAX:
            raise ValueError(
                "an INT8 scale exceeds FP16's range (a token with max|x| over 8.3e6): use "
                "scale_dtype 'fp32' or 'bf16'"
            )
        half = scale.astype(np.float16)
        low = half.astype(np.float32) < scale
        half[low] = np.nextafter(half[low], np.float16(np.inf))
        return half.astype(np.float32)
    raise ValueError(f"unknown scale dtype {scale_dtype!r}; known: fp32, bf16, fp16")


def quantize_int8(x: np.ndarray, scale_dtype: ScaleDtype = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """Token-wise symmetric INT8: (q int8 [T, H], scale float32 [T]), the scale representable
    in ``scale_dtype`` (:func:`round_scale_up`)."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1) if x.size else np.zeros(x.shape[:-1], np.float32)
    scale = round_scale_up((amax / INT8_MAX).astype(np.float32), scale_dtype)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def int8_error_bound(x: np.ndarray, scale_dtype: ScaleDtype = "fp32") -> np.ndarray:
    """Per-token bound on the absolute round-trip error of :func:`quantize_int8` (s/2, with
    the scale as ``scale_dtype`` holds it)."""
    amax = np.abs(np.asarray(x, np.float32)).max(axis=-1)
    return round_scale_up((amax / INT8_MAX).astype(np.float32), scale_dtype) / 2
