"""Encoding dispatch rows and combine copies as bytes (bytes payload mode)."""

from __future__ import annotations

import numpy as np

from ...model.numerics import (
    ScaleDtype,
    dequantize_int8,
    from_bf16_bits,
    quantize_int8,
    to_bf16_bits,
)
from .moe import WireDtype

_SCALE_FIELD = {"fp32": "<f4", "bf16": "<u2", "fp16": "<f2"}
"""How an INT8 row's scale is stored (BF16 as its bit pattern: numpy has no bfloat16)."""


def _payload_fields(
    hidden: int, dtype: WireDtype, scale_dtype: ScaleDtype
) -> list[tuple[str, str, tuple[int, ...]]]:
    if dtype == "fp32":
        return [("x", "<f4", (hidden,))]
    if dtype == "bf16":
        return [("x", "<u2", (hidden,))]
    return [("x", "i1", (hidden,)), ("scale", _SCALE_FIELD[scale_dtype], ())]


def dispatch_dtype(
    hidden: int, top_k: int, dtype: WireDtype, scale_dtype: ScaleDtype = "fp32"
) -> np.dtype:
    fields = _payload_fields(hidden, dtype, scale_dtype)
    return np.dtype([*fields, ("token", "<i4"), ("slots", "<i4", (top_k,))])


def combine_dtype(hidden: int, dtype: WireDtype, scale_dtype: ScaleDtype = "fp32") -> np.dtype:
    return np.dtype([*_payload_fields(hidden, dtype, scale_dtype), ("token", "<i4"), ("k", "<i4")])


def dispatch_side_dtype(top_k: int) -> np.dtype:
    """The routing side information of a dispatched row (travels in size mode too)."""
    return np.dtype([("token", "<i4"), ("slots", "<i4", (top_k,))])


def combine_side_dtype() -> np.dtype:
    return np.dtype([("token", "<i4"), ("k", "<i4")])


def encode_payload(
    rows: np.ndarray, x: np.ndarray, dtype: WireDtype, scale_dtype: ScaleDtype = "fp32"
) -> None:
    """Write float32 ``x`` [n, H] into the payload fields of structured ``rows``."""
    if dtype == "fp32":
        rows["x"] = x
    elif dtype == "bf16":
        rows["x"] = to_bf16_bits(x)
    else:
        q, scale = quantize_int8(x, scale_dtype)
        rows["x"] = q
        # exact in every scale dtype (quantize_int8 rounded it to one the dtype holds)
        rows["scale"] = to_bf16_bits(scale) if scale_dtype == "bf16" else scale


def decode_payload(rows: np.ndarray, dtype: WireDtype) -> np.ndarray:
    """The float32 values [n, H] carried by structured ``rows`` (the scale's dtype is read off
    the rows' own layout)."""
    if dtype == "fp32":
        return np.array(rows["x"], dtype=np.float32)
    if dtype == "bf16":
        return from_bf16_bits(rows["x"])
    scale = rows["scale"]
    if scale.dtype == np.uint16:  # BF16 bits
        scale = from_bf16_bits(scale)
    return dequantize_int8(rows["x"], scale)
