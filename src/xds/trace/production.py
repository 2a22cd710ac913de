"""The synthetic workload of SPEC 12.4's production deployment (P126-P127).

Inputs 0-64K tokens with mean 13K, outputs with mean 2.1K, Poisson arrivals. The paper gives
only these ranges and means (no rate, no cache hit rate); everything else is taken from the one
public production chat trace that carries prompt block hashes, Mooncake's Kimi conversation
trace (FAST'25; statistics measured by ``benchmarks/mooncake_conversations.py``):

**Conversations.** Chat traffic is multi-turn: a follow-up turn's prompt is an earlier turn's
whole prompt plus new tokens (the previous answer and the new message), so its leading blocks
can hit a prefix cache that still holds the earlier turn. Measured on the Mooncake trace:

==========================  =========================  =====================================
quantity                    value                      used as
==========================  =========================  =====================================
follow-up share             34.1 % of requests extend  ``follow_up``: each request is a
                            an earlier prompt by more  follow-up with this probability
                            than 2 blocks              (when a parent is available)
turn gap                    p10 42 s, p50 126 s,       ``gap_median_s``, ``gap_sigma``:
                            p90 486 s                  log-normal, sigma 0.955
new tokens per follow-up    p50 838, mean 3,155        ``new_median``, ``new_sigma``:
(beyond the shared blocks)                             log-normal, sigma 1.63
==========================  =========================  =====================================

A follow-up's parent is the nearest earlier turn, at or before its arrival minus the drawn gap,
that has not been continued yet and leaves room under 64K (up to ``search_back`` requests
further back); without one, the request is a first turn. Its prompt is the parent's full
blocks plus the new tokens (the parent's partial last block is part of what is new, as the
trace's hashes count it).

The trace's infinite-cache prefix reuse is 37.4 % of prompt tokens; the generator's comes out
at 29 % (:func:`prefix_reuse`; the trace also shares short system prompts, which the generator
leaves out). Measured with the same script, the generated follow-up share is about 30 %
(follow-ups that find no parent, or extend a prompt of at most two blocks, drop out) and the
turn gaps are somewhat shorter (gaps past ``history_s`` find no parent). Nothing was fitted to
the trace's reuse or to any replay result. Whether a follow-up *hits* in a replay is the
prefill TEs' business: their caches are finite per DP group, evict LRU, and the Job Executor
routes by cache state. A replay starts with cold caches, so follow-ups of turns from before
its first request cannot hit: early in a replay, hits are a lower bound.

**Lengths.** First turns are log-normal (sigma 1) [emulator choice], clipped to 64K, with the
location chosen (by bisection on a fixed reference run of this generator) so the mean over
*all* requests lands on 13K; a follow-up never passes 64K (the context limit). Outputs are
log-normal (sigma 1) with mean 2.1K.

**Common random numbers.** Every request's draws come from per-quantity streams of the seed,
indexed by the request, so one seed at two rates gives the same requests arriving faster or
slower: the same outputs, first-turn prompts, follow-up flags, turn gaps and new tokens. Only
which earlier turn a follow-up extends (the one its gap reaches at that rate), and so its
prompt length, depends on the rate. Comparing rates, or a capacity search's points, compares
the deployment's answers to one workload.
"""

from __future__ import annotations

import functools
from typing import Annotated, NamedTuple

import msgspec
import numpy as np
from msgspec import Meta

from ..config import check_fields, require_int, require_positive
from ..errors import ConfigError
from ..units import S
from .workload import Request, Workload, arrival_times

INPUT_MEAN = 13_000
INPUT_MAX = 65_536
OUTPUT_MEAN = 2_100
OUTPUT_MAX = 32_768
BLOCK_TOKENS = 512
"""Tokens per prefix hash, as in Mooncake's ``hash_ids``."""


class Conversations(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Multi-turn structure of chat traffic (defaults measured on Mooncake's Kimi trace)."""

    follow_up: Annotated[float, Meta(ge=0, lt=1)] = 0.341
    gap_median_s: Annotated[float, Meta(gt=0)] = 126.0
    gap_sigma: Annotated[float, Meta(ge=0)] = 0.955
    new_median: Annotated[float, Meta(gt=0)] = 838.0
    new_sigma: Annotated[float, Meta(ge=0)] = 1.63
    search_back: Annotated[int, Meta(ge=1)] = 64
    """How many requests before its target time a follow-up may try as its parent."""
    history_s: Annotated[float, Meta(ge=0)] = 600.0
    """Conversations already under way when the workload starts: the generator runs this long
    before time 0 and keeps only what arrives after, so lengths and the follow-up share are
    stationary from the first request (turns whose parent came before time 0 find nothing
    cached: a replay starts with cold caches)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def max_rate_per_s(self) -> float:
        """The highest rate a workload with these conversations can be drawn at: the
        history before its first request is capped at :data:`MAX_HISTORY` requests."""
        if self.follow_up == 0.0 or self.history_s == 0:
            return float("inf")
        return MAX_HISTORY / self.history_s


MAX_HISTORY = 1_000_000
"""Most conversation-history requests a built-in workload draws (see production_workload)."""

MOONCAKE_CONVERSATIONS = Conversations()
NO_CONVERSATIONS = Conversations(follow_up=0.0)


@functools.cache
def _location(mean: float, cap: int, sigma: float) -> float:
    """Location of a log-normal whose values clipped to [1, ``cap``] average ``mean`` (by
    bisection on a fixed reference sample, so it does not depend on the workload's size)."""
    spread = sigma * np.random.default_rng(12_4).standard_normal(200_000)
    values = np.empty_like(spread)  # each try's lengths, in one buffer
    lo, hi = np.log(1.0), np.log(float(cap))
    for _ in range(60):
        mu = (lo + hi) / 2
        np.exp(np.add(mu, spread, out=values), out=values)
        m = np.clip(values, 1, cap, out=values).mean()
        lo, hi = (mu, hi) if m < mean else (lo, mu)
    return (lo + hi) / 2


def _lengths(z: np.ndarray, mu: float, cap: int, sigma: float = 1.0) -> np.ndarray:
    """Log-normal lengths ``exp(mu + sigma z)`` rounded and clipped to [1, cap]."""
    return np.clip(np.rint(np.exp(mu + sigma * z)), 1, cap).astype(np.int64)


class _Draws(msgspec.Struct):
    """The random draws behind a run of requests, one row per request. Each column comes from
    its own seeded stream, so request ``i``'s draws are the ``i``-th of every stream: the same
    whatever the rate (which only scales ``interval``) and however many requests follow. Two
    workloads of one seed at different rates are the same requests, arriving faster or slower
    (common random numbers: rate comparisons are paired)."""

    interval: np.ndarray
    """Exp(1) gap to the previous request (times 1/rate)."""
    first_z: np.ndarray
    """Standard normal of the first-turn prompt length."""
    follow_u: np.ndarray
    """Uniform: the request is a follow-up turn below ``follow_up``."""
    gap_z: np.ndarray
    """Standard normal of the turn gap it looks back over."""
    new_z: np.ndarray
    """Standard normal of a follow-up's new tokens."""
    output_z: np.ndarray
    """Standard normal of the output length."""

    @classmethod
    def of(cls, n: int, *key: int) -> _Draws:
        def stream(column: int) -> np.random.Generator:
            return np.random.default_rng(np.random.SeedSequence([*key, column]))

        return cls(
            stream(0).exponential(1.0, n),
            *(stream(c).standard_normal(n) for c in (1,)),
            stream(2).random(n),
            *(stream(c).standard_normal(n) for c in (3, 4, 5)),
        )

    def then(self, later: _Draws) -> _Draws:
        """These requests followed by ``later``'s."""
        return _Draws(
            *(np.concatenate([getattr(self, f), getattr(later, f)]) for f in self.__struct_fields__)
        )

    def reversed(self) -> _Draws:
        return _Draws(*(getattr(self, f)[::-1] for f in self.__struct_fields__))


class _Turns(msgspec.Struct):
    inputs: np.ndarray
    parent: np.ndarray
    """Index of the request whose prompt this one extends, -1 for a first turn."""


class _Links(NamedTuple):
    """What decides a follow-up's parent but the first-turn lengths, in arrival order."""

    follow: list[int]
    """The requests that are follow-ups (if they find a parent)."""
    targets: list[int]
    """Per request, the last one arrived by its arrival minus its drawn turn gap."""
    new: list[int]
    """Per request, the new tokens it adds to its parent's full blocks as a follow-up."""


def _links(draws: _Draws, arrivals: np.ndarray, conv: Conversations) -> _Links:
    follow = draws.follow_u < conv.follow_up
    gaps = np.exp(np.log(conv.gap_median_s * S) + conv.gap_sigma * draws.gap_z)
    new = np.maximum(1, np.rint(np.exp(np.log(conv.new_median) + conv.new_sigma * draws.new_z)))
    new = new.astype(np.int64)
    targets = np.searchsorted(arrivals, arrivals - gaps, side="right") - 1
    return _Links(np.nonzero(follow)[0].tolist(), targets.tolist(), new.tolist())


def _turns(draws: _Draws, arrivals: np.ndarray, first_mu: float, conv: Conversations) -> _Turns:
    """Input lengths and parents, in arrival order (a parent always arrived earlier)."""
    first = _lengths(draws.first_z, first_mu, INPUT_MAX)
    return _walk(first, _links(draws, arrivals, conv), conv.search_back)


def _walk(first: np.ndarray, links: _Links, search_back: int) -> _Turns:
    """:func:`_turns` from the first-turn lengths ``first``: each follow-up in arrival order
    takes its parent (on plain Python ints: the same values, without numpy's per-element
    cost)."""
    inputs: list[int] = first.tolist()
    full: list[int] = (first // BLOCK_TOKENS * BLOCK_TOKENS).tolist()  # in a prompt's full blocks
    parent = [-1] * len(inputs)
    continued = [False] * len(inputs)
    targets, more = links.targets, links.new
    for i in links.follow:
        j = targets[i]
        stop = j - search_back if j - search_back > -1 else -1
        while j > stop:  # the nearest earlier turn, not yet continued, that leaves room
            if not continued[j] and full[j] + more[i] <= INPUT_MAX:
                break
            j -= 1
        if j > stop:
            continued[j] = True
            parent[i] = j
            inputs[i] = full[j] + more[i]
            full[i] = inputs[i] // BLOCK_TOKENS * BLOCK_TOKENS
    return _Turns(np.array(inputs, dtype=np.int64), np.array(parent, dtype=np.int64))


@functools.cache
def _first_turn_location(conv: Conversations) -> float:
    """Location of the first-turn log-normal that puts the mean over all requests on 13K,
    by bisection on a fixed reference run (at 10/s, 1,000 s or more after its history)."""
    n = max(20_000, round(10 * (conv.history_s + 1_000)))
    ref = _Draws.of(n, 12_4, 1)
    arrivals = np.cumsum(ref.interval) * (S / 10.0)
    kept = arrivals >= arrivals[0] + conv.history_s * S
    links = _links(ref, arrivals, conv)  # the same at every location
    lo, hi = np.log(1.0), np.log(float(INPUT_MAX))
    for _ in range(40):
        mu = (lo + hi) / 2
        first = _lengths(ref.first_z, mu, INPUT_MAX)
        m = _walk(first, links, conv.search_back).inputs[kept].mean()
        lo, hi = (mu, hi) if m < INPUT_MEAN else (lo, mu)
    return (lo + hi) / 2


def production_workload(
    n: int,
    *,
    rate_per_s: float,
    seed: int = 0,
    conversations: Conversations = MOONCAKE_CONVERSATIONS,
    block_tokens: int = BLOCK_TOKENS,
) -> Workload:
    """``n`` requests of the SPEC 12.4 mix arriving as a Poisson process at ``rate_per_s``,
    with the multi-turn prefix structure of ``conversations`` (``NO_CONVERSATIONS``: every
    prompt unique). One seed gives the same requests at every rate (their draws do not
    depend on it; only the gaps between arrivals scale, and with them which earlier turn a
    follow-up extends), and its first ``k`` requests for any ``n >= k``; the conversations
    already under way before the first request are drawn from a stream of their own.
    ``block_tokens`` is the tokens each prefix hash covers (a deployment's
    ``prefill.prefix_block_tokens``); the conversations themselves are built on Mooncake's
    512-token blocks (a follow-up repeats its parent's full 512-token blocks) whatever it is."""
    n = require_int(n, "n", low=1)
    seed = require_int(seed, "seed")
    rate_per_s = require_positive(rate_per_s, "rate_per_s")
    block_tokens = require_int(block_tokens, "block_tokens", low=1)
    conv = conversations
    if rate_per_s > conv.max_rate_per_s:
        raise ConfigError(
            f"{rate_per_s:g} req/s with conversations needs the "
            f"{round(rate_per_s * conv.history_s):,} requests of the {conv.history_s:g} s before "
            f"the first one (follow-ups extend them); at most {MAX_HISTORY:,}, i.e. up to "
            f"{conv.max_rate_per_s:,.0f} req/s: use a "
            "lower rate, or unique prompts (NO_CONVERSATIONS, --unique-prompts)",
            field="rate_per_s",
        )
    history = 0 if conv.follow_up == 0.0 else round(rate_per_s * conv.history_s)
    ahead = _Draws.of(n, seed, 124, 0)  # the workload's requests
    before = _Draws.of(history, seed, 124, 1)  # under way before them, most recent first
    draws = before.reversed().then(ahead)
    unit = S / rate_per_s
    gaps = ahead.interval * unit
    gaps[0] = 0.0  # the first request arrives at 0
    times = arrival_times(gaps, rate_per_s)
    past = -np.cumsum(before.interval * unit)[::-1]  # before 0, in arrival order
    arrivals = np.concatenate([np.rint(past).astype(np.int64), times])
    if conv.follow_up == 0.0:
        inputs = _lengths(ahead.first_z, _location(INPUT_MEAN, INPUT_MAX, 1.0), INPUT_MAX)
        turns = _Turns(inputs, np.full(n, -1))
    else:
        turns = _turns(draws, arrivals, _first_turn_location(conv), conv)
    outputs = _lengths(ahead.output_z, _location(OUTPUT_MEAN, OUTPUT_MAX, 1.0), OUTPUT_MAX)
    hashes = _block_hashes(turns, block_tokens)[history:]
    inputs = turns.inputs[history:]
    requests = tuple(
        Request(i, int(times[i]), int(inputs[i]), int(outputs[i]), hashes[i]) for i in range(n)
    )
    follow = "" if conv.follow_up == 0.0 else ", conversations"
    return Workload(
        requests,
        f"production(n={n}, rate={rate_per_s:g}/s{follow})",
        hash_block_tokens=block_tokens if any(r.prefix_hashes for r in requests) else 0,
    )


def _block_hashes(turns: _Turns, block_tokens: int) -> list[tuple[int, ...]]:
    """Prompt block hashes, one per ``block_tokens``: a follow-up repeats the hashes of the
    blocks its parent's full 512-token blocks cover, then new ones."""
    out: list[tuple[int, ...]] = []
    next_id = 0
    for i, length in enumerate(turns.inputs.tolist()):
        blocks = -(-length // block_tokens)
        p = int(turns.parent[i])
        shared_tokens = int(turns.inputs[p]) // BLOCK_TOKENS * BLOCK_TOKENS if p >= 0 else 0
        shared = out[p][: shared_tokens // block_tokens] if p >= 0 else ()
        fresh = blocks - len(shared)
        out.append((*shared, *range(next_id, next_id + fresh)))
        next_id += fresh
    return out


class PrefixTrie:
    """Every prompt seen so far, as a trie of block hashes (an infinite prefix cache)."""

    def __init__(self) -> None:
        self._child: dict[tuple[int, int], int] = {}  # (node, block hash) -> node; root 0

    def match(self, hashes: tuple[int, ...]) -> tuple[int, list[int]]:
        """Blocks of ``hashes``' longest leading run seen before, and the nodes of the whole
        prompt (inserting the rest): node ``i`` stands for the first ``i + 1`` blocks."""
        nodes: list[int] = []
        node = 0
        for h in hashes:
            child = self._child.get((node, h))
            if child is None:
                break
            node = child
            nodes.append(node)
        k = len(nodes)
        for h in hashes[k:]:
            node = self._child.setdefault((node, h), len(self._child) + 1)
            nodes.append(node)
        return k, nodes


def prefix_reuse(workload: Workload, block_tokens: int = BLOCK_TOKENS) -> float:
    """Share of prompt tokens an infinite prefix cache would serve: each request's longest run
    of leading block hashes seen in any earlier request (as Mooncake's README measures it)."""
    trie = PrefixTrie()
    hit = total = 0
    for r in workload.requests:
        total += r.input_tokens
        k, _ = trie.match(r.prefix_hashes)
        hit += min(k * block_tokens, r.input_tokens)
    return hit / max(1, total)
