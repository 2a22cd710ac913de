"""Argument checks of the fabric's and XCCL's public calls: each bad argument is one
:class:`~xds.errors.ConfigError` naming it as the function spells it (``field``).

Integers are Python or numpy integers (returned as plain ``int``; :func:`xds.config.require_int`,
re-exported as ``integer``); bools, floats, ``None`` and strings are refused, never truncated.
:mod:`xds.fabric.xccl.args` builds on these.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from ..config import is_integer
from ..config import require_int as integer
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..hw import CloudMatrix384

ENGINES: tuple[str, ...] = ("mte", "dma")


def die(pod: CloudMatrix384, value: object, field: str) -> int:
    """A die index of ``pod``, named ``field`` in the error."""
    return pod.check_die(value, what=field)  # type: ignore[arg-type]


def aiv_count(pod: CloudMatrix384, die_index: int, value: object, field: str) -> int:
    """A number of AIVs of die ``die_index`` (1..its AIVs)."""
    limit = pod.spec_of(die_index).aiv
    if is_integer(value) and 1 <= int(value) <= limit:  # type: ignore[call-overload]
        return int(value)  # type: ignore[call-overload]
    raise ConfigError(
        f"must be an integer in 1..{limit} (the AIVs of die {die_index}), got {value!r}",
        field=field,
    )


def engine(value: object, field: str = "engine") -> str:
    """A data mover: ``"mte"`` or ``"dma"``."""
    if not isinstance(value, str) or value not in ENGINES:
        raise ConfigError(f"unknown engine {value!r}; choose one of {ENGINES}", field=field)
    return value


def byte_range(
    offset: object, nbytes: object, region_bytes: int, *, fields: tuple[str, str], what: str
) -> tuple[int, int]:
    """(offset, nbytes) of a range inside a region of ``region_bytes``; ``fields`` names the
    two arguments."""
    off = integer(offset, fields[0])
    n = integer(nbytes, fields[1])
    if off + n > region_bytes:
        field = fields[1] if n > region_bytes else fields[0]
        raise ConfigError(
            f"{what} of {n} bytes at offset {off} falls outside the application region "
            f"({region_bytes} bytes)",
            field=field,
        )
    return off, n


def data_bytes(data: object, field: str = "data") -> memoryview:
    """``data`` as a flat byte view: bytes, bytearray, memoryview or a C-contiguous array."""
    if data is None or isinstance(data, (numbers.Number, str)):
        raise ConfigError(
            f"must be bytes-like (bytes, bytearray, memoryview, a contiguous array), got "
            f"{type(data).__name__} {data!r}"[:200],
            field=field,
        )
    try:
        return memoryview(data).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"must be bytes-like and contiguous ({exc}), got {type(data).__name__}", field=field
        ) from None
