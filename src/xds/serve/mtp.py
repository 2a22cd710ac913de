"""Multi-token prediction: drafts, verification and commit (SPEC 8).

Each decode step: the MTP layer drafts ``k`` tokens, the main model verifies them, and the step
commits the longest accepted prefix of drafts **plus one main-model token**, so 1..k+1 tokens
(SPEC 8.1). Under greedy sampling the committed stream is exactly what greedy decoding without
MTP would produce, whatever the acceptance pattern: a rejected draft is replaced by the main
model's own token and everything after it is discarded.

Acceptance is drawn from a seeded model: per-depth conditional probabilities
``p[0], p[1], ...`` (the probability that draft ``d`` is right given drafts ``< d`` were).
``k = 1, p = [0.9]`` gives 1.9 tokens per step on average.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ..config import check_fields
from ..docfields import document_fields
from ..errors import ConfigError
from ..runtime.rng import UniformDraws

MAX_DRAFTS = 8
"""The most draft tokens per step xds models: each draft is a sequential MTP forward, while
the chance that all of them are accepted compounds away (0.9^8 = 0.43), and the decode batch's
dispatch/combine grid grows with 1 + k."""


class MTPConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    k: int = 1
    """Draft tokens per step (MTP layers), 0..8."""
    acceptance: tuple[float, ...] = (0.9,)
    """Per-depth conditional acceptance; the last value repeats for deeper drafts, and values
    past depth ``k`` are unused (one profile serves a sweep over ``k``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 <= self.k <= MAX_DRAFTS:
            raise ConfigError(f"k must be in 0..{MAX_DRAFTS}, got {self.k}", field="mtp.k")
        if not self.acceptance:
            raise ConfigError(
                "acceptance needs at least one probability (the first draft's)",
                field="mtp.acceptance",
            )
        if any(not 0 <= p <= 1 for p in self.acceptance):
            raise ConfigError("acceptance probabilities must be in [0, 1]", field="mtp.acceptance")

    def p(self, depth: int) -> float:
        return self.acceptance[min(depth, len(self.acceptance) - 1)]

    @property
    def expected_tokens_per_step(self) -> float:
        """1 + sum over d of the probability that drafts 0..d are all accepted."""
        total, run = 1.0, 1.0
        for d in range(self.k):
            run *= self.p(d)
            total += run
        return total


def accepted_drafts(config: MTPConfig, rng: np.random.Generator) -> int:
    """How many of this step's ``k`` drafts the main model accepts (a prefix)."""
    n = 0
    while n < config.k and rng.random() < config.p(n):
        n += 1
    return n


def tokens_per_step(config: MTPConfig, rng: np.random.Generator, steps: int) -> np.ndarray:
    """Committed tokens of ``steps`` steps (vectorised; same law as :func:`accepted_drafts`)."""
    if not config.k:
        return np.ones(steps, dtype=np.int64)
    alive = rng.random(steps) < config.p(0)
    out = np.add(alive, 1, dtype=np.int64)
    for d in range(1, config.k):
        alive &= rng.random(steps) < config.p(d)
        out += alive
    return out


def committed_tokens(config: MTPConfig, draws: UniformDraws, steps: int) -> list[int]:
    """:func:`tokens_per_step` as a list, from the same draws (``steps`` per draft depth, in
    depth order) read off ``draws``: the same values, without a Generator call per step (for
    a few dozen steps in plain Python, for more with numpy: each is cheaper there)."""
    if steps >= _NUMPY_FROM and config.k:
        alive = draws.take(steps) < config.p(0)
        counts = np.add(alive, 1, dtype=np.int64)
        for depth in range(1, config.k):
            alive &= draws.take(steps) < config.p(depth)
            counts += alive
        return counts.tolist()
    if config.k == 1:
        p = config.p(0)
        return [2 if u < p else 1 for u in draws.take(steps).tolist()]
    out = [1] * steps
    alive = [True] * steps
    for depth in range(config.k):
        p = config.p(depth)
        alive = [a and u < p for a, u in zip(alive, draws.take(steps).tolist(), strict=True)]
        out = [n + a for n, a in zip(out, alive, strict=True)]
    return out


_NUMPY_FROM = 64
"""Steps from which :func:`committed_tokens` draws with numpy (its per-call cost pays)."""


def mtp_step(
    context: Sequence[int],
    greedy_next: Callable[[Sequence[int]], int],
    draft: Callable[[Sequence[int], int], list[int]],
    k: int,
) -> list[int]:
    """One MTP decode step on token ids: draft ``k`` tokens, verify them with the main model
    (greedy), commit the accepted prefix plus the main model's next token.

    ``greedy_next(prefix)`` is the main model's greedy token after ``prefix``; ``draft(prefix,
    k)`` the MTP layer's ``k`` guesses. Returns the committed tokens (1..k+1 of them).
    """
    drafts = draft(context, k)[:k]
    committed: list[int] = []
    prefix = list(context)
    for guess in drafts:
        truth = greedy_next(prefix)  # the verification of this position
        if guess != truth:
            committed.append(truth)  # the main model's token replaces the rejected draft
            return committed
        committed.append(guess)
        prefix.append(guess)
    committed.append(greedy_next(prefix))  # all drafts accepted: one more main-model token
    return committed


document_fields(MTPConfig)
