"""Checks shared by the pluggable serving policies (routing, placement, TE choice).

A policy is a plain (synchronous) function, called inline where the decision is made; xds
offers it only the choices that keep its invariants, as copies it cannot change, and accepts
an answer only if it is one of them (an ``int``-like index; never a ``bool``). Errors name the
policy's slot (``decode_routing``, ``prefill_placement``, ...).
"""

from __future__ import annotations

import inspect
import numbers
import operator
from collections.abc import Callable, Sequence

from ..errors import ConfigError, ProtocolError


def policy_name(policy: object) -> str:
    """How errors call a policy: its function name, quoted."""
    return repr(getattr(policy, "__name__", policy))


def binds(fn: object, n: int, *, as_wrapped: bool = False) -> bool | None:
    """Whether ``fn`` can be called with ``n`` positional arguments; None when its signature
    cannot be read (a builtin). A decorated function (``functools.wraps``) binds if either
    the wrapper's own parameters or the wrapped function's do (a decorator may supply or add
    arguments). ``as_wrapped``: judge a wrapper that only passes ``*args`` on by the wrapped
    function alone (whether to offer an optional extra argument: the wrapper would take
    anything)."""
    own, wrapped = (_signature(fn, follow) for follow in (False, True))
    if as_wrapped and own is not None and wrapped is not None and _passes_on(own):
        own = wrapped
    answer: bool | None = None
    for sig in dict.fromkeys(x for x in (own, wrapped) if x is not None):
        try:
            sig.bind(*range(n))
        except TypeError:
            answer = False
            continue
        return True
    return answer


def _passes_on(sig: inspect.Signature) -> bool:
    """A wrapper's ``(*args, **kwargs)``: no parameter of its own."""
    kinds = {p.kind for p in sig.parameters.values()}
    return bool(kinds) and kinds <= {
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    }


def _signature(fn: object, follow_wrapped: bool) -> inspect.Signature | None:
    try:
        return inspect.signature(fn, follow_wrapped=follow_wrapped)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def require_callable(
    policy: object,
    field: str,
    *,
    arity: int | tuple[int, ...] | None = None,
    kind: str = "policy",
) -> None:
    """A policy argument (or another ``kind`` of function: a progress callback) must be a
    function (named ``field`` in the error) taking ``arity`` positional arguments (one of
    them, for a tuple); synchronous unless ``arity`` is None (a KV mover is async). A
    signature that cannot be read is tried at the call."""
    if not callable(policy):
        raise ConfigError(f"{field} must be a function, got {policy!r}", field=field)
    if arity is None:
        return
    if inspect.iscoroutinefunction(policy):
        raise ConfigError(
            f"{field} {kind} {policy_name(policy)} is async; xds calls it inline, as a plain "
            "function (drop the `async`)",
            field=field,
        )
    counts = (arity,) if isinstance(arity, int) else arity
    if any(binds(policy, n) is not False for n in counts):
        return
    takes = " or ".join(map(str, counts))
    raise ConfigError(
        f"{field} {kind} {policy_name(policy)}{inspect.signature(policy)} must take {takes} "  # type: ignore[arg-type]
        + ("positional argument" if counts == (1,) else "positional arguments"),
        field=field,
    )


def takes_arguments(policy: object, n: int) -> bool:
    """Whether ``policy`` is a plain function that can take ``n`` positional arguments (a
    policy with an optional extra parameter gets the extra information)."""
    return (
        callable(policy)
        and not inspect.iscoroutinefunction(policy)
        and binds(policy, n, as_wrapped=True) is True
    )


def ask(policy: Callable[..., object], field: str, request: object, *args: object) -> object:
    """``policy(*args)``; an error it raises says which policy slot and request it was, and an
    awaitable answer (an async function slipped through) is refused."""
    try:
        answer = policy(*args)
    except (StopIteration, StopAsyncIteration) as stop:  # would turn into "coroutine raised
        # StopIteration" on its way out of xds's tasks, losing the note: say it as it is
        exc = RuntimeError(
            f"{type(stop).__name__} escaped the policy (a next() over nothing matching?)"
        ).with_traceback(stop.__traceback__)
        exc.add_note(
            f"(raised by the {field} policy {policy_name(policy)} for request {request!r})"
        )
        exc.xds_policy = field  # type: ignore[attr-defined]
        raise exc from None
    except Exception as exc:
        exc.add_note(
            f"(raised by the {field} policy {policy_name(policy)} for request {request!r})"
        )
        exc.xds_policy = field  # type: ignore[attr-defined]  # the CLI reports it briefly
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
        index = next(
            (n for n in ("dp", "te") if type(getattr(answer, n, None)) is int), None
        )  # a view (GroupView, PrefillTEView...) returned whole
        hint = f" (a view was returned: return its .{index})" if index else ""
        if type(answer).__name__ == "DPLoad":  # (its index is its place in the list shown)
            hint = " (a DPLoad was returned: return its index in the list of loads)"
        if isinstance(answer, bool):
            hint = " (a bool is not an index: return the number itself)"
        elif isinstance(answer, numbers.Real) and not isinstance(answer, numbers.Integral):
            hint = " (a float is not an index: return an int)"
        raise ProtocolError(
            f"{field + ' ' if field else ''}policy {policy_name(policy)} chose {what} {answer!r} "
            f"for request "
            f"{request!r}, which was not offered; it must pick one of the {len(offered)} "
            f"offered{f' ({offered_as})' if offered_as else ''}: [{shown}]{hint}"
        )
    return choice
