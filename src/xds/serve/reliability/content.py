"""A tiny greedy decoder whose tokens depend on the whole KV cache (content mode).

Rollback exactness (SPEC 11.3) is about state: a redo must start from exactly the KV of the
last committed iteration. This model makes every token a function of all KV rows of its
sequence (the last row plus the mean of all rows, then a small top-k MoE layer from
:class:`xds.model.ReferenceMoE`, then an argmax over the vocabulary), so a KV row left over
from a discarded attempt, or a missing one, changes the tokens that follow.
"""

from __future__ import annotations

import numpy as np

from ...model.reference_moe import ReferenceMoE, TinyMoE

HIDDEN = 16


class TinyDecoder:
    """Weights drawn once from ``gen``; float32 throughout, so runs compare bit for bit."""

    def __init__(self, vocab: int, gen: np.random.Generator):
        h = HIDDEN
        self.vocab = vocab
        self.embed = gen.standard_normal((vocab, h)).astype(np.float32)
        self.position = gen.standard_normal((h,)).astype(np.float32) * np.float32(0.05)
        self.head = gen.standard_normal((h, vocab)).astype(np.float32)
        self.moe = ReferenceMoE(TinyMoE(hidden=h, intermediate=8, n_experts=8, top_k=2), gen)

    def kv_row(self, token: int, position: int) -> np.ndarray:
        """The KV row attention writes for ``token`` at ``position``."""
        return np.tanh(self.embed[token] + np.float32(position % 97) * self.position)

    def next_token(self, rows: list[np.ndarray]) -> int:
        """Greedy next token from a sequence's KV rows."""
        kv = np.stack(rows)
        x = (kv[-1] + kv.mean(axis=0, dtype=np.float32))[None, :].astype(np.float32)
        idx, w = self.moe.route(x)
        x = x + self.moe.forward(x, idx, w)
        return int(np.argmax(x[0] @ self.head))
