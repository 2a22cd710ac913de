"""Argument checks shared by XCCL's operations: one ConfigError naming the argument, the same
on the protocol and the collective tier (integers, dies, AIV counts, byte ranges and engines:
:mod:`xds.fabric.checks`, which the fabric's own calls use too)."""

from __future__ import annotations

import itertools

import numpy as np

from ...errors import ConfigError
from ..checks import aiv_count, byte_range, die, engine, integer, is_integer

__all__ = [
    "MAX_EVENT_ID",
    "aiv_count",
    "byte_range",
    "die",
    "dies",
    "engine",
    "event_id",
    "expert_ids",
    "group_serial",
    "index",
    "integer",
    "is_integer",
    "outputs",
    "tokens",
]

MAX_EVENT_ID = 2**64 - 1

_SERIALS = itertools.count()


def group_serial() -> int:
    """A number for a new collective group, unique in this process: the handles its
    operations return name their group, so a handle passed to another group is refused."""
    return next(_SERIALS)


def event_id(value: object) -> int:
    """An eventID: an integer in 1..2**64-1 (numpy integers too; not a bool)."""
    if not is_integer(value):
        raise ConfigError(
            f"eventID must be an integer in 1..2**64-1, got {value!r}", field="event_id"
        )
    value = int(value)
    if not 0 < value <= MAX_EVENT_ID:
        raise ConfigError(
            f"eventID must be an integer in 1..2**64-1, got {value}", field="event_id"
        )
    return value


def dies(values: object, field: str) -> list[int]:
    """A list of die numbers (a list, tuple, range or 1-D array of integers >= 0; each die's
    range is the pod's to check); else ConfigError."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if not isinstance(values, (list, tuple, range)):
        raise ConfigError(
            f"must be a list of dies, got {type(values).__name__} {values!r:.40}", field=field
        )
    return [integer(v, field) for v in values]


def index(value: object, n: int, field: str) -> int:
    """An index into ``n`` things (0..n-1; negative ones do not wrap)."""
    return integer(value, field, low=0, high=n - 1)


def tokens(x: object, *, bytes_mode: bool, hidden: int) -> tuple[int, np.ndarray | None]:
    """The token count and (bytes mode) the float32 ``[B, hidden]`` data of ``x``: an array in
    bytes mode; an array or a non-negative count in size mode."""
    if is_integer(x):
        if bytes_mode:
            raise ConfigError("bytes payload mode needs token data, got a count", field="x")
        if x < 0:
            raise ConfigError(f"a token count must be >= 0, got {x}", field="x")
        return int(x), None
    if not bytes_mode and isinstance(x, (float, np.floating)):
        raise ConfigError(f"a token count must be an integer, got {x!r}", field="x")
    try:
        arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        raise ConfigError(
            f"x must be a [tokens, {hidden}] float array (or a count in size mode), got "
            f"{type(x).__name__}",
            field="x",
        ) from None
    if arr.ndim != 2 or arr.shape[1] != hidden:
        raise ConfigError(f"x must have shape (tokens, {hidden}), got {arr.shape}", field="x")
    return int(arr.shape[0]), (arr if bytes_mode else None)


def expert_ids(topk_idx: object, shape: tuple[int, int], field: str = "topk_idx") -> np.ndarray:
    """``topk_idx`` as an int64 array of ``shape`` (integers only: no silent truncation)."""
    arr = np.asarray(topk_idx)
    if arr.shape != shape:
        raise ConfigError(f"must have shape {shape}, got {arr.shape}", field=field)
    integral = np.issubdtype(arr.dtype, np.integer) or (
        np.issubdtype(arr.dtype, np.floating) and bool(np.all(arr == np.round(arr)))
    )
    if arr.size and not integral:
        raise ConfigError(f"expert ids must be integers, got {arr.dtype} values", field=field)
    if arr.size and (arr.max() >= 2**62 or arr.min() < -1):  # before the cast could wrap them
        bad = arr.max() if arr.max() >= 2**62 else arr.min()
        raise ConfigError(f"expert id {bad} is out of range (-1 is an empty slot)", field=field)
    return arr.astype(np.int64)


def outputs(values: object, shape: tuple[int, ...], field: str) -> np.ndarray:
    """A float array argument (expert outputs, gate weights) as float32 of exactly ``shape``."""
    try:
        arr = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise ConfigError(f"must be a float array of shape {shape}", field=field) from None
    if arr.shape != shape:
        raise ConfigError(f"must have shape {shape}, got {arr.shape}", field=field)
    return arr
