"""Expert routing statistics: skewed (calibrated to Figure 11), uniform, or loaded from a file.

A load tensor ``counts[t, l, e]`` holds the tokens routed to logical expert ``e`` of MoE layer
``l`` in time slice ``t`` (SPEC 7.2). The skewed generator draws each layer's expert popularity
from a log-normal whose spread matches the paper's ShareGPT sample (P065, Figure 11): about 20 %
of experts above the mean, the hottest about 30x the mean. With log-normal popularity
``P(x > mean) = P(Z > sigma / 2)``, so 20 % above the mean gives ``sigma = 2 * 0.8416``; the
expected maximum of 256 such draws is then ~27x the mean, matching "about 30x" without a second
knob. Popularity drifts between slices as a stationary AR(1) process in log space
(``drift_rho`` per slice, an emulator choice).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import TraceError

SIGMA_20_PERCENT_ABOVE_MEAN = 2 * 0.8416


def skewed_counts(
    rng: np.random.Generator,
    *,
    slices: int,
    layers: int,
    experts: int,
    tokens_per_slice: int,
    sigma: float = SIGMA_20_PERCENT_ABOVE_MEAN,
    drift_rho: float = 0.95,
) -> np.ndarray:
    """``counts[t, l, e]``: skewed, drifting routing of ``tokens_per_slice`` expert copies per
    layer and slice."""
    z = rng.standard_normal((layers, experts))
    out = np.zeros((slices, layers, experts), dtype=np.int64)
    for t in range(slices):
        if t:
            z = drift_rho * z + np.sqrt(1 - drift_rho**2) * rng.standard_normal(z.shape)
        pop = np.exp(sigma * z)
        p = pop / pop.sum(axis=1, keepdims=True)
        for layer in range(layers):
            out[t, layer] = rng.multinomial(tokens_per_slice, p[layer])
    return out


def uniform_counts(
    rng: np.random.Generator, *, slices: int, layers: int, experts: int, tokens_per_slice: int
) -> np.ndarray:
    p = np.full(experts, 1.0 / experts)
    return np.stack(
        [
            np.stack([rng.multinomial(tokens_per_slice, p) for _ in range(layers)])
            for _ in range(slices)
        ]
    )


def load_counts(path: str | Path) -> np.ndarray:
    """A ``[time_slice, layer, expert]`` token-count array from ``.npy`` or from a CSV with
    columns ``time_slice,layer,expert,count`` (one row per nonzero count)."""
    path = Path(path)
    if not path.exists():
        raise TraceError("file not found", path=str(path))
    if path.suffix == ".npy":
        arr = np.load(path)
        if arr.ndim != 3:
            raise TraceError(
                f"expected a [time_slice, layer, expert] array, got shape {arr.shape}",
                path=str(path),
            )
        if (arr < 0).any() or not np.issubdtype(arr.dtype, np.integer):
            raise TraceError("counts must be non-negative integers", path=str(path))
        return arr.astype(np.int64)
    rows: list[tuple[int, int, int, int]] = []
    with path.open() as f:
        header = f.readline().strip().split(",")
        want = ["time_slice", "layer", "expert", "count"]
        if header != want:
            raise TraceError(
                f"header must be {','.join(want)}, got {','.join(header)}", path=str(path), line=1
            )
        for line_no, line in enumerate(f, start=2):
            if not line.strip():
                continue
            parts = line.strip().split(",")
            if len(parts) != 4:
                raise TraceError(
                    f"expected 4 fields, got {len(parts)}", path=str(path), line=line_no
                )
            try:
                vals = tuple(int(p) for p in parts)
            except ValueError:
                bad = next(
                    n
                    for n, p in zip(want, parts, strict=True)
                    if not p.strip().lstrip("-").isdigit()
                )
                raise TraceError(
                    "not an integer", path=str(path), line=line_no, field=bad
                ) from None
            if min(vals) < 0:
                raise TraceError(
                    "must be non-negative",
                    path=str(path),
                    line=line_no,
                    field=want[int(np.argmin(vals))],
                )
            rows.append(vals)  # type: ignore[arg-type]
    if not rows:
        raise TraceError("no counts", path=str(path))
    shape = tuple(max(r[i] for r in rows) + 1 for i in range(3))
    out = np.zeros(shape, dtype=np.int64)
    for t, layer, e, c in rows:
        out[t, layer, e] += c
    return out


def hottest_over_mean(counts: np.ndarray) -> float:
    """Mean over (slice, layer) of the hottest expert's load over the mean load."""
    mean = counts.mean(axis=-1)
    return float((counts.max(axis=-1) / np.maximum(mean, 1e-12)).mean())


def share_above_mean(counts: np.ndarray) -> float:
    mean = counts.mean(axis=-1, keepdims=True)
    return float((counts > mean).mean())
