"""A tiny numeric reference MoE (numpy) for checking dispatch/combine end to end.

``y_t = sum_j W[t, j] * Expert_{I[t, j]}(x_t)`` (SPEC 4.1): top-k gating over ``n_experts``
experts, each a small SwiGLU MLP. Computed in float32 with a fixed accumulation order (top-k
order), so a distributed implementation that accumulates in the same order reproduces it
exactly. Token routing can also be supplied directly (including ``-1`` for "no expert").
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from ..config import require_int
from ..errors import ConfigError


class TinyMoE(msgspec.Struct, frozen=True, kw_only=True):
    """Shapes of the reference model (small enough for unit tests)."""

    hidden: int = 64
    intermediate: int = 32
    n_experts: int = 16
    top_k: int = 4

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "n_experts", "top_k"):
            require_int(getattr(self, name), name, low=1)
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"top-{self.top_k} routing needs at least {self.top_k} experts, got "
                f"{self.n_experts}",
                field="top_k",
            )


class ReferenceMoE:
    """Weights and the dense reference forward pass."""

    def __init__(self, shape: TinyMoE, rng: np.random.Generator):
        self.shape = shape
        h, i, e = shape.hidden, shape.intermediate, shape.n_experts
        scale = 1.0 / np.sqrt(h)
        self.w_gate = rng.standard_normal((h, e)).astype(np.float32) * scale
        self.w1 = rng.standard_normal((e, h, i)).astype(np.float32) * scale
        self.w3 = rng.standard_normal((e, h, i)).astype(np.float32) * scale
        self.w2 = rng.standard_normal((e, i, h)).astype(np.float32) / np.sqrt(i)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k experts and their normalised softmax weights: (idx int64 [T,k], w f32 [T,k])."""
        logits = x.astype(np.float32) @ self.w_gate
        logits -= logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        k = self.shape.top_k
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, idx, axis=-1)
        w = (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)
        return idx.astype(np.int64), w

    def expert(self, e: int, x: np.ndarray) -> np.ndarray:
        """Expert ``e``'s SwiGLU MLP applied to rows ``x`` (float32).

        Computed row by row so that a row's result never depends on which other rows share
        the batch (BLAS blocking would otherwise change the last bits): the distributed run and
        the dense reference group tokens differently and must still agree exactly.
        """
        x = np.asarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.shape.hidden), dtype=np.float32)
        w1, w3, w2 = self.w1[e], self.w3[e], self.w2[e]
        for i, row in enumerate(x):
            a = row @ w1
            g = a / (np.float32(1.0) + np.exp(-a))
            out[i] = (g * (row @ w3)) @ w2
        return out

    def forward(
        self,
        x: np.ndarray,
        idx: np.ndarray,
        w: np.ndarray,
        *,
        round_input: Callable[[np.ndarray], np.ndarray] | None = None,
        round_output: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """Dense reference: accumulate expert outputs in top-k order, in float32.

        ``round_input`` / ``round_output`` apply a wire format (e.g. BF16 rounding) to what an
        expert receives and returns, to model dispatch and combine precision exactly.
        """
        x = np.asarray(x, dtype=np.float32)
        xin = round_input(x) if round_input is not None else x
        out = np.zeros_like(x)
        for j in range(idx.shape[1]):
            for e in np.unique(idx[:, j]):
                if e < 0:
                    continue
                rows = np.nonzero(idx[:, j] == e)[0]
                y = self.expert(int(e), xin[rows])
                if round_output is not None:
                    y = round_output(y)
                out[rows] += w[rows, j, None] * y
        return out
