"""Number formats used on the wire: BF16 rounding and token-wise INT8 (SPEC 9.3).

numpy has no bfloat16, so BF16 values are held as float32 arrays whose low 16 mantissa bits are
zero (round to nearest even), and as ``uint16`` bit patterns when they travel as bytes.

INT8 is symmetric and token-wise: one scale per token (row), ``s = max|x_t| / 127`` and
``q = round(x / s)``; the round-trip error per element is at most ``s / 2``.
"""

from __future__ import annotations

import numpy as np

INT8_MAX = 127
SCALE_DTYPE = np.dtype("<f4")
"""Dtype of a per-token scale on the wire (4 bytes; a parameter per SPEC 9.3)."""


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


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-wise symmetric INT8: (q int8 [T, H], scale float32 [T])."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1) if x.size else np.zeros(x.shape[:-1], np.float32)
    scale = (amax / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def int8_error_bound(x: np.ndarray) -> np.ndarray:
    """Per-token bound on the absolute round-trip error of :func:`quantize_int8` (s/2)."""
    return np.abs(np.asarray(x, np.float32)).max(axis=-1) / INT8_MAX / 2
