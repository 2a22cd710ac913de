"""Checks shared by the pluggable serving policies (routing, placement, TE choice).

A policy is a plain (synchronous) function, called inline where the decision is made; xds
offers it only the choices that keep its invariants, as copies it cannot change, and accepts
an answer only if it is one of them (an ``int``-like index; never a ``bool``). Errors name the
policy's slot (``decode_routing``, ``prefill_placement``, ...).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Sequence

from ..errors import ConfigError, ProtocolError


def policy_name(policy: object) -> str:
    """How errors call a policy: its function name, quoted."""
    return repr(getattr(policy, "__name__", policy))


def require_callable(policy: object, field: str, *, arity: int | None = None) -> None:
    """A policy argument must be a function (named ``field`` in the error) taking ``arity``
    positional arguments; synchronous unless ``arity`` is None (a KV mover is async)."""
    if not callable(policy):
        raise ConfigError(f"{field} must be a function, got {policy!r}", field=field)
    if arity is None:
        return
    if inspect.iscoroutinefunction(policy):
        raise ConfigError(
            f"{field} policy {policy_name(policy)} is async; policies are plain functions that "
            "xds calls inline where the decision is made (drop the `async`)",
            field=field,
        )
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin without a signature: try it at the call
        return
    try:
        signature.bind(*range(arity))
    except TypeError:
        raise ConfigError(
            f"{field} policy {policy_name(policy)}{signature} must take {arity} positional "
            "arguments",
            field=field,
        ) from None


def takes_arguments(policy: object, n: int) -> bool:
    """Whether ``policy`` is a plain function that can take exactly ``n`` positional arguments
    (a policy with an optional extra parameter gets the extra information)."""
    if not callable(policy) or inspect.iscoroutinefunction(policy):
        return False
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def ask(policy: Callable[..., object], field: str, request: object, *args: object) -> object:
    """``policy(*args)``; an error it raises says which policy slot and request it was, and an
    awaitable answer (an async function slipped through) is refused."""
    try:
        answer = policy(*args)
    except Exception as exc:
        exc.add_note(
            f"(raised by the {field} policy {policy_name(policy)} for request {request!r})"
        )
        raise
    if inspect.isawaitable(answer):
        close = getattr(answer, "close", None)
        if close is not None:
            close()  # no "never awaited" warning
        raise ConfigError(
            f"{field} policy {policy_name(policy)} returned an awaitable; policies are plain "
            "functions (drop the `async`)",
            field=field,
        )
    return answer


def offered_choice(
    policy: Callable[..., object],
    answer: object,
    offered: Sequence[int],
    what: str,
    request: object,
    offered_as: str = "",
    *,
    field: str = "",
) -> int:
    """``answer`` as one of ``offered`` (``what`` names the choice in the error, ``offered_as``
    says which ones were offered, e.g. "below their batch limit", and ``field`` the slot)."""
    try:
        if isinstance(answer, bool):
            raise TypeError
        choice = operator.index(answer)  # type: ignore[arg-type]
    except TypeError:
        choice = None
    if choice is None or choice not in offered:
        shown = ", ".join(map(str, offered[:12])) + (", ..." if len(offered) > 12 else "")
        raise ProtocolError(
            f"{field + ' ' if field else ''}policy {policy_name(policy)} chose {what} {answer!r} "
            f"for request "
            f"{request!r}, which was not offered; it must pick one of the {len(offered)} "
            f"offered{f' ({offered_as})' if offered_as else ''}: [{shown}]"
        )
    return choice
