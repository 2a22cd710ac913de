"""Time and size units. Virtual time is an integer number of nanoseconds (SPEC 0.4)."""

from __future__ import annotations

NS = 1
US = 1_000
MS = 1_000_000
S = 1_000_000_000

KiB = 1024
MiB = 1024**2
GiB = 1024**3
KB = 1000
MB = 1000**2
GB = 1000**3
TB = 1000**4


def ns_to_s(t_ns: int) -> float:
    """Nanoseconds to float seconds (the unit of anyio/asyncio/trio clocks)."""
    return t_ns / 1e9


def s_to_ns(t_s: float) -> int:
    """Float seconds to the nearest integer nanosecond."""
    return round(t_s * 1e9)


def fmt_ns(t_ns: int) -> str:
    """Human-readable duration: ``1.500 ms``, ``12.0 us``, ``3.25 s``."""
    a = abs(t_ns)
    if a >= S:
        return f"{t_ns / S:.3f} s"
    if a >= MS:
        return f"{t_ns / MS:.3f} ms"
    if a >= US:
        return f"{t_ns / US:.1f} us"
    return f"{t_ns} ns"


def fmt_bytes(n: float) -> str:
    """Human-readable byte count with binary prefixes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
