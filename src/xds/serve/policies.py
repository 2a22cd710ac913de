"""Checks shared by the pluggable serving policies (routing, placement, TE choice).

A policy is a plain function; xds offers it only the choices that keep its invariants and
accepts an answer only if it is one of them (an ``int``-like index; never a ``bool``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from ..errors import ConfigError, ProtocolError


def require_callable(policy: object, field: str) -> None:
    """A policy argument must be a function (named ``field`` in the error)."""
    if not callable(policy):
        raise ConfigError(f"{field} must be a function, got {policy!r}", field=field)


def offered_choice(
    policy: Callable[..., object],
    answer: object,
    offered: Sequence[int],
    what: str,
    request: object,
    offered_as: str = "",
) -> int:
    """``answer`` as one of ``offered`` (``what`` names the choice in the error, and
    ``offered_as`` says which ones were offered, e.g. "below their batch limit")."""
    try:
        if isinstance(answer, bool):
            raise TypeError
        choice = operator.index(answer)  # type: ignore[arg-type]
    except TypeError:
        choice = None
    if choice is None or choice not in offered:
        shown = ", ".join(map(str, offered[:12])) + (", ..." if len(offered) > 12 else "")
        raise ProtocolError(
            f"policy {getattr(policy, '__name__', policy)!r} chose {what} {answer!r} for request "
            f"{request!r}, which was not offered; it must pick one of the {len(offered)} "
            f"offered{f' ({offered_as})' if offered_as else ''}: [{shown}]"
        )
    return choice
