"""The TE-shell's decode DP routing (SPEC 6.3, P057/P059/P100).

Each request is routed once: DP groups at their batch limit (active + pending >= limit) are
excluded; among the rest the one with the lowest ``kv_used + kv_reserved + reservation`` wins,
ties to the lowest index. ``kv_used`` is the last snapshot the DP groups reported
(:meth:`DecodeRouter.snapshot_kv`; the paper collects it periodically, a PD replay's Decode
TE reports at every change); pending counts and reservations update immediately, so a burst
between snapshots still spreads. A reservation covers the output's KV until the DP group takes
the whole sequence's blocks (:meth:`DecodeRouter.kv_taken`), after which its KV figure counts
them. When no DP qualifies the router answers :data:`BACKPRESSURE` and the caller holds the
request until capacity frees (it is never dropped).

The choice among the eligible DPs is pluggable: pass ``routing=`` a function
``(eligible DP indices, every DP's DPLoad, this request's reservation in blocks) -> index``
(:func:`lowest_kv` is the paper's rule). The router keeps the bookkeeping and the invariants:
a policy only ever sees DPs below their batch limit (and copies of the loads), and an answer
outside them is a :class:`~xds.errors.ProtocolError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Sequence
from typing import Final

import msgspec

from ..config import require_int
from ..docfields import document_fields
from ..errors import ConfigError
from .policies import ask, offered_choice, require_callable, takes_arguments


class _Backpressure:
    def __repr__(self) -> str:
        return "BACKPRESSURE"


BACKPRESSURE: Final = _Backpressure()


class DPLoad(msgspec.Struct):
    """What the TE-shell knows of one DP group."""

    batch_limit: int
    active: int = 0
    pending: int = 0
    kv_used_blocks: int = 0
    """KV blocks held, as last reported (:meth:`DecodeRouter.snapshot_kv`)."""
    kv_reserved_blocks: int = 0
    """Output KV reserved for requests routed here whose blocks the DP has not taken yet."""


class RouteRequest(msgspec.Struct, frozen=True):
    """The request being routed, for policies that take a fourth argument."""

    request_id: object
    input_tokens: int
    """Prompt tokens (0 where the caller does not know them)."""
    output_tokens: int


DecodeRouting = Callable[..., int]
"""A decode routing policy: ``(eligible DP indices, every DP's load, the request's KV
reservation in blocks)`` or, with a fourth parameter, ``(..., RouteRequest)`` -> the chosen DP,
one of the eligible. It sees copies: changing them changes nothing."""


def lowest_kv(eligible: Sequence[int], dps: Sequence[DPLoad], reserve_blocks: int) -> int:
    """SPEC 6.3: the lowest ``kv_used + kv_reserved + reservation``, ties to the lowest index
    (the reservation is the same for every DP group, so the lowest ``kv_used + kv_reserved``)."""
    loads = [dps[i].kv_used_blocks + dps[i].kv_reserved_blocks for i in eligible]
    return min(zip(loads, eligible, strict=True))[1]


class DecodeRouter:
    """Routes decode requests across DP groups (the TE-shell's first duty, P055)."""

    def __init__(
        self,
        n_dp: int,
        batch_limit: int,
        *,
        block_tokens: int = 128,
        routing: DecodeRouting = lowest_kv,
    ):
        n_dp = require_int(n_dp, "n_dp", low=1)
        batch_limit = require_int(batch_limit, "batch_limit", low=1)
        block_tokens = require_int(block_tokens, "block_tokens", low=1)
        require_callable(routing, "decode_routing", arity=(3, 4))
        self._with_request = takes_arguments(routing, 4)
        self.routing = routing
        self.block_tokens = block_tokens
        self.dps = [DPLoad(batch_limit) for _ in range(n_dp)]
        self._reservations: dict[object, tuple[int, int]] = {}  # request -> (dp, blocks)
        self._admitted: set[object] = set()
        self._kv_used_total = 0
        """The DP groups' ``kv_used_blocks`` summed (kept as the figures change)."""

    @property
    def sequences(self) -> int:
        """Requests routed and not finished: every DP group's ``active + pending``."""
        return len(self._reservations)

    @property
    def kv_used_blocks(self) -> int:
        """KV blocks held over every DP group, as last reported."""
        return self._kv_used_total

    def reservation_blocks(self, max_output_tokens: int) -> int:
        """ESTIMATE_OUTPUT_KV: blocks for the request's longest output (A25)."""
        return math.ceil(max(0, max_output_tokens) / self.block_tokens)

    def route(
        self,
        request: object,
        max_output_tokens: int,
        *,
        exclude: Container[int] = (),
        input_tokens: int = 0,
    ) -> int | _Backpressure:
        """The DP for ``request`` (now pending there), or BACKPRESSURE. DPs in ``exclude``
        (e.g. too little KV left for this request) are never offered."""
        if request in self._reservations:
            raise ConfigError(f"request {request!r} was already routed", field="request")
        max_output_tokens = require_int(max_output_tokens, "max_output_tokens")
        input_tokens = require_int(input_tokens, "input_tokens")
        reserve = self.reservation_blocks(max_output_tokens)
        if self.routing is lowest_kv and not exclude:  # the built-in policy, in one walk
            found = self._lowest_kv()
            if found is None:
                return BACKPRESSURE
            best = found
        else:
            # a DP at its batch limit is never offered
            eligible = [
                i for i, dp in enumerate(self.dps) if dp.active + dp.pending < dp.batch_limit
            ]
            if exclude:
                eligible = [i for i in eligible if i not in exclude]
            if not eligible:
                return BACKPRESSURE
            if self.routing is lowest_kv:
                answer: object = lowest_kv(eligible, self.dps, reserve)
            else:  # a custom policy sees copies: it cannot change the router's bookkeeping
                loads = tuple(d.__copy__() for d in self.dps)
                args: tuple[object, ...] = (tuple(eligible), loads, reserve)
                if self._with_request:
                    args += (RouteRequest(request, input_tokens, max_output_tokens),)
                answer = ask(self.routing, "decode_routing", request, *args)
            best = offered_choice(
                self.routing,
                answer,
                eligible,
                "decode DP",
                request,
                "the DPs below their batch limit",
                field="decode_routing",
            )
        dp = self.dps[best]
        dp.pending += 1
        dp.kv_reserved_blocks += reserve
        self._reservations[request] = (best, reserve)
        return best

    def _lowest_kv(self) -> int | None:
        """:func:`lowest_kv` of the DP groups below their batch limit, ties to the lowest
        index (None: every one is at its limit)."""
        best, low = None, 0
        for i, dp in enumerate(self.dps):
            if dp.active + dp.pending < dp.batch_limit:
                load = dp.kv_used_blocks + dp.kv_reserved_blocks
                if best is None or load < low:
                    best, low = i, load
        return best

    def admitted(self, request: object) -> None:
        """The DP started serving the request: pending -> active."""
        dp_index, _ = self._reservation(request)
        if request in self._admitted:
            raise ConfigError(f"request {request!r} was already admitted", field="request")
        self._admitted.add(request)
        dp = self.dps[dp_index]
        dp.pending -= 1
        dp.active += 1

    def kv_taken(self, request: object) -> None:
        """The DP group now holds the request's whole sequence of KV, so its KV figure
        (:meth:`snapshot_kv`) counts the output too: the output reservation made at routing
        goes (it would count those blocks twice). The request stays pending until admitted."""
        dp_index, reserve = self._reservation(request)
        self.dps[dp_index].kv_reserved_blocks -= reserve
        self._reservations[request] = (dp_index, 0)

    def finished(self, request: object) -> None:
        """The request completed or failed (admitted or still pending): counts and its
        reservation return to baseline."""
        dp_index, reserve = self._reservations.pop(self._key(request))
        dp = self.dps[dp_index]
        if request in self._admitted:
            self._admitted.discard(request)
            dp.active -= 1
        else:
            dp.pending -= 1
        dp.kv_reserved_blocks -= reserve

    def remove(self, dp_index: int) -> list[object]:
        """Take DP group ``dp_index`` out of service for good (a Decode scale-down, P119): it
        is never offered again; returns the requests routed there, whose reservations go."""
        dp_index = require_int(dp_index, "dp_index", high=len(self.dps) - 1)
        gone = [r for r, (dp, _) in self._reservations.items() if dp == dp_index]
        for r in gone:
            del self._reservations[r]
            self._admitted.discard(r)
        self._kv_used_total -= self.dps[dp_index].kv_used_blocks
        self.dps[dp_index] = DPLoad(batch_limit=0)
        return gone

    def restore(self, dp_index: int, batch_limit: int) -> None:
        """Put a removed DP group back in service, empty (a Decode TE scaling back up)."""
        dp_index = require_int(dp_index, "dp_index", high=len(self.dps) - 1)
        batch_limit = require_int(batch_limit, "batch_limit", low=1)
        if self.dps[dp_index].batch_limit:
            raise ConfigError(f"DP group {dp_index} was not removed", field="dp_index")
        self._kv_used_total -= self.dps[dp_index].kv_used_blocks
        self.dps[dp_index] = DPLoad(batch_limit)

    def snapshot_kv(self, used_blocks: list[int]) -> None:
        """The KV metric collection (P059: periodic in the paper; callers choose when)."""
        if len(used_blocks) != len(self.dps):
            raise ConfigError(
                f"one KV figure per DP group: {len(self.dps)}, got {len(used_blocks)}",
                field="used_blocks",
            )
        self._kv_used([require_int(u, f"used_blocks[{i}]") for i, u in enumerate(used_blocks)])

    def _kv_used(self, used_blocks: list[int]) -> None:
        """:meth:`snapshot_kv` from the TE-shell's own block managers (figures known good)."""
        for dp, blocks in zip(self.dps, used_blocks, strict=True):
            dp.kv_used_blocks = blocks
        self._kv_used_total = sum(used_blocks)

    def _kv_used_of(self, dp_index: int, blocks: int) -> None:
        """:meth:`_kv_used` when only DP group ``dp_index``'s figure changed since the last
        one (the TE-shell reports after every admit and release)."""
        dp = self.dps[dp_index]
        self._kv_used_total += blocks - dp.kv_used_blocks
        dp.kv_used_blocks = blocks

    def _key(self, request: object) -> object:
        if request not in self._reservations:
            raise ConfigError(f"request {request!r} is not routed", field="request")
        return request

    def _reservation(self, request: object) -> tuple[int, int]:
        return self._reservations[self._key(request)]


document_fields(DPLoad)
