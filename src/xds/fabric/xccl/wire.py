"""Encoding dispatch rows and combine copies as bytes (bytes payload mode)."""

from __future__ import annotations

import numpy as np

from ...model.numerics import (
    dequantize_int8,
    from_bf16_bits,
    quantize_int8,
    to_bf16_bits,
)
from .moe import WireDtype


def _payload_fields(hidden: int, dtype: WireDtype) -> list[tuple[str, str, tuple[int, ...]]]:
    if dtype == "fp32":
        return [("x", "<f4", (hidden,))]
    if dtype == "bf16":
        return [("x", "<u2", (hidden,))]
    return [("x", "i1", (hidden,)), ("scale", "<f4", ())]


def dispatch_dtype(hidden: int, top_k: int, dtype: WireDtype) -> np.dtype:
    return np.dtype([*_payload_fields(hidden, dtype), ("token", "<i4"), ("slots", "<i4", (top_k,))])


def combine_dtype(hidden: int, dtype: WireDtype) -> np.dtype:
    return np.dtype([*_payload_fields(hidden, dtype), ("token", "<i4"), ("k", "<i4")])


def dispatch_side_dtype(top_k: int) -> np.dtype:
    """The routing side information of a dispatched row (travels in size mode too)."""
    return np.dtype([("token", "<i4"), ("slots", "<i4", (top_k,))])


def combine_side_dtype() -> np.dtype:
    return np.dtype([("token", "<i4"), ("k", "<i4")])


def encode_payload(rows: np.ndarray, x: np.ndarray, dtype: WireDtype) -> None:
    """Write float32 ``x`` [n, H] into the payload fields of structured ``rows``."""
    if dtype == "fp32":
        rows["x"] = x
    elif dtype == "bf16":
        rows["x"] = to_bf16_bits(x)
    else:
        q, scale = quantize_int8(x)
        rows["x"] = q
        rows["scale"] = scale


def decode_payload(rows: np.ndarray, dtype: WireDtype) -> np.ndarray:
    """The float32 values [n, H] carried by structured ``rows``."""
    if dtype == "fp32":
        return np.array(rows["x"], dtype=np.float32)
    if dtype == "bf16":
        return from_bf16_bits(rows["x"])
    return dequantize_int8(rows["x"], rows["scale"])
