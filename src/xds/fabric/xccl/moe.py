"""Expert placement and token layout for dispatch/combine (SPEC 4.1-4.3, 7.5).

* :class:`ExpertMap` - the logical-to-physical expert table: each logical expert has one or more
  physical replicas, each living on one rank of the EP group. A token picks a replica by its
  position (``physical(i, e) = R_e[i mod |R_e|]``, SPEC 7.5). EPLB replaces the table later
  (``version`` counts replacements).
* :func:`route` - where each (token, top-k slot) goes: destination rank and physical slot, ``-1``
  for slots routed to no expert (never sent).
* :class:`Layout` - per destination rank, the tokens it receives (each token once per
  destination rank, in source order), as DeepEP's ``get_dispatch_layout``.
* :func:`pull_lanes` - which peers each AIV of a rank pulls from, and in what order (step 6).
* Wire formats: bytes per row for each payload dtype, with the side information that travels
  with a row.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from ...config import is_integer
from ...errors import ConfigError
from ...model.numerics import SCALE_BYTES, ScaleDtype

WireDtype = Literal["fp32", "bf16", "int8"]
PAYLOAD_BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "int8": 1}


PullOrder = Literal["static", "staggered"]
"""How a rank spreads its pulls over its AIVs (SPEC 4.3 step 6 pulls "every peer in parallel"
and leaves the order open once peers outnumber AIVs):

* ``static`` (default): AIV ``a`` pulls peers ``a, a + n_aiv, ...`` in rank order, the
  pseudocode's ``for peer in 0 .. world_size - 1`` with a fixed AIV-to-peer map. Every rank
  starts on the same ``n_aiv`` peers, whose egress then serves all the pullers at once
  (incast) while the other peers wait for a later round.
* ``staggered``: rank ``r`` takes its own block first, then ``r+1, r+2, ...`` (mod the group),
  dealt to its AIVs in turn: the rank-rotated schedule all-to-all libraries use, so the
  ranks' first pulls spread over every peer.

The two differ only when the group is larger than the AIVs that pull (EP > 48 on 910C)."""


def pull_lanes(rank: int, n_ranks: int, n_aiv: int, order: PullOrder) -> list[list[int]]:
    """Per AIV (lane) of ``rank``, the peers it pulls from, in issue order."""
    lanes: list[list[int]] = [[] for _ in range(min(n_aiv, n_ranks))]
    for i in range(n_ranks):
        peer = i if order == "static" else (rank + i) % n_ranks
        lanes[i % len(lanes)].append(peer)
    return lanes


def payload_bytes(hidden: int, dtype: WireDtype, scale_dtype: ScaleDtype = "fp32") -> int:
    """Bytes of one token's hidden state on the wire (INT8 adds its per-token scale, of
    ``scale_dtype``)."""
    if dtype not in PAYLOAD_BYTES_PER_ELEMENT:
        raise ConfigError(f"unknown wire dtype {dtype!r}", field="dtype")
    scale = SCALE_BYTES[scale_dtype] if dtype == "int8" else 0
    return hidden * PAYLOAD_BYTES_PER_ELEMENT[dtype] + scale


def dispatch_row_bytes(
    hidden: int, top_k: int, dtype: WireDtype, scale_dtype: ScaleDtype = "fp32"
) -> int:
    """A dispatched row: payload + source token index (4 B) + k local expert slots (4 B each)."""
    return payload_bytes(hidden, dtype, scale_dtype) + 4 + 4 * top_k


def combine_row_bytes(hidden: int, dtype: WireDtype, scale_dtype: ScaleDtype = "fp32") -> int:
    """A combined copy: payload + source token index (4 B) + top-k position (4 B)."""
    return payload_bytes(hidden, dtype, scale_dtype) + 8


class ExpertMap:
    """Logical experts -> physical replicas -> ranks of an EP group.

    ``slots_rank[p]`` is the rank of physical slot ``p``; ``replicas[e]`` the physical slots of
    logical expert ``e``. The default places ``n_experts`` experts in contiguous blocks, one
    replica each: expert ``e`` on rank ``e * n_ranks // n_experts``.
    """

    def __init__(
        self,
        n_experts: int,
        n_ranks: int,
        *,
        replicas: Sequence[Sequence[int]] | None = None,
        slots_rank: Sequence[int] | None = None,
    ):
        for name, value in (("n_experts", n_experts), ("n_ranks", n_ranks)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(
                    f"an expert map needs a positive integer here, got {value!r}", field=name
                )
        n_experts, n_ranks = int(n_experts), int(n_ranks)
        self.n_experts = n_experts
        self.n_ranks = n_ranks
        if replicas is None:
            if n_experts < n_ranks:
                raise ConfigError(
                    f"{n_experts} experts cannot cover {n_ranks} ranks without replicas",
                    field="n_ranks",
                )
            replicas = [[e] for e in range(n_experts)]
            slots_rank = [e * n_ranks // n_experts for e in range(n_experts)]
        if slots_rank is None:
            raise ConfigError("slots_rank is required with replicas", field="slots_rank")
        self.slots_rank = np.asarray(slots_rank, dtype=np.int64)
        if len(replicas) != n_experts:
            raise ConfigError(
                f"replicas lists {len(replicas)} experts, expected {n_experts}", field="replicas"
            )
        for e, reps in enumerate(replicas):
            if not reps:
                raise ConfigError(f"logical expert {e} has no physical replica", field="replicas")
            for p in reps:
                if not is_integer(p) or not 0 <= p < len(self.slots_rank):
                    raise ConfigError(
                        f"expert {e}: physical slot {p} does not exist", field="replicas"
                    )
        if self.slots_rank.size and not (
            (self.slots_rank >= 0).all() and (self.slots_rank < n_ranks).all()
        ):
            raise ConfigError(f"slots_rank must name ranks 0..{n_ranks - 1}", field="slots_rank")
        self.replicas = [np.asarray(r, dtype=np.int64) for r in replicas]
        self.n_replicas = np.array([len(r) for r in self.replicas], dtype=np.int64)
        width = int(self.n_replicas.max())
        self._table = np.full((n_experts, width), -1, dtype=np.int64)
        for e, reps in enumerate(self.replicas):
            self._table[e, : len(reps)] = reps
        self.version = 0
        # local slot index of each physical slot within its rank
        self.local_index = np.zeros(len(self.slots_rank), dtype=np.int64)
        counts = np.zeros(n_ranks, dtype=np.int64)
        for p, r in enumerate(self.slots_rank):
            self.local_index[p] = counts[r]
            counts[r] += 1
        self.slots_per_rank = counts
        self._slot_expert: np.ndarray | None = None  # physical slot -> logical expert

    def expert_at(self, rank: int, local_slot: int) -> int:
        """The logical expert that ``rank``'s local slot ``local_slot`` holds (what an expert
        die computes for a received row's ``recv_local_slots`` entry, whatever the map)."""
        rank = _map_index(rank, self.n_ranks, "rank")
        local_slot = _map_index(local_slot, int(self.slots_per_rank[rank]), "local_slot")
        if self._slot_expert is None:
            self._slot_expert = np.empty(len(self.slots_rank), dtype=np.int64)
            for e, reps in enumerate(self.replicas):
                self._slot_expert[reps] = e
        (slot,) = np.flatnonzero((self.slots_rank == rank) & (self.local_index == local_slot))
        return int(self._slot_expert[slot])

    def physical(self, topk_idx: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Physical slot of each (token, k) entry; replica chosen by token position."""
        topk_idx = np.asarray(topk_idx, dtype=np.int64)
        if topk_idx.size and (topk_idx.max() >= self.n_experts or topk_idx.min() < -1):
            raise ConfigError(f"expert ids must be in -1..{self.n_experts - 1}", field="topk_idx")
        if positions is None:
            positions = np.arange(topk_idx.shape[0], dtype=np.int64)
        else:
            positions = _positions(positions, topk_idx.shape[0])
        safe = np.where(topk_idx >= 0, topk_idx, 0)
        pick = positions[:, None] % self.n_replicas[safe]
        phys = self._table[safe, pick]
        return np.where(topk_idx >= 0, phys, -1)


def _positions(positions: object, n_tokens: int) -> np.ndarray:
    """Token positions (which replica each token's copies go to) as ``n_tokens`` integers
    >= 0; else ConfigError."""
    arr = np.asarray(positions)
    if arr.shape != (n_tokens,):
        raise ConfigError(
            f"must be one position per token, shape ({n_tokens},), got {arr.shape}",
            field="positions",
        )
    if n_tokens and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"positions must be integers, got {arr.dtype} values", field="positions")
    if n_tokens and arr.min() < 0:
        raise ConfigError(f"positions must be >= 0, got {int(arr.min())}", field="positions")
    return arr.astype(np.int64)


class Routed(msgspec.Struct, frozen=True):
    """Where each (token, top-k slot) of one source rank goes."""

    dest_rank: np.ndarray  # [B, k], -1 for no expert
    local_slot: np.ndarray  # [B, k], slot index on the destination rank, -1 for none


def route(
    topk_idx: np.ndarray, expert_map: ExpertMap, positions: np.ndarray | None = None
) -> Routed:
    phys = expert_map.physical(topk_idx, positions)
    valid = phys >= 0
    safe = np.where(valid, phys, 0)
    dest = np.where(valid, expert_map.slots_rank[safe], -1)
    local = np.where(valid, expert_map.local_index[safe], -1)
    return Routed(dest, local)


class Layout(msgspec.Struct, frozen=True):
    """The dispatch layout of one source rank (DeepEP's ``get_dispatch_layout``)."""

    tokens_for_rank: list[np.ndarray]
    """Per destination rank, the source token indices it receives, ascending."""
    is_token_in_rank: np.ndarray  # [B, R] bool
    num_tokens_per_rank: np.ndarray  # [R]
    num_copies_per_rank: np.ndarray  # [R]: (token, slot) pairs per destination rank

    @property
    def total_rows(self) -> int:
        return int(self.num_tokens_per_rank.sum())


def layout(routed: Routed, n_ranks: int) -> Layout:
    dest = routed.dest_rank
    n_tokens = dest.shape[0]
    in_rank = np.zeros((n_tokens, n_ranks), dtype=bool)
    copies = np.zeros(n_ranks, dtype=np.int64)
    if dest.size:
        rows, cols = np.nonzero(dest >= 0)
        in_rank[rows, dest[rows, cols]] = True
        copies = np.bincount(dest[dest >= 0], minlength=n_ranks).astype(np.int64)
    per_rank = in_rank.sum(axis=0).astype(np.int64)
    # every destination's tokens at once: destination-major, tokens ascending; rank r's are
    # the r-th run of per_rank[r] entries
    token_ids = np.nonzero(in_rank.T)[1]
    cuts = [0, *np.cumsum(per_rank).tolist()]
    tokens = [token_ids[lo:hi] for lo, hi in itertools.pairwise(cuts)]
    return Layout(tokens, in_rank, per_rank, copies)


def _map_index(value: object, n: int, field: str) -> int:
    if not is_integer(value) or not 0 <= int(value) < n:  # type: ignore[call-overload]
        raise ConfigError(f"must be an integer in 0..{n - 1}, got {value!r}", field=field)
    return int(value)  # type: ignore[call-overload]
