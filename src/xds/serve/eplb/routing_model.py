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

import io
import numbers
from pathlib import Path

import numpy as np

from ...config import require_int
from ...errors import ConfigError, TraceError

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
    _check_shape(rng, slices=slices, layers=layers, experts=experts, tokens=tokens_per_slice)
    for name, value, low, high in (("sigma", sigma, 0.0, 10.0), ("drift_rho", drift_rho, 0.0, 1.0)):
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not low <= float(value) <= high
        ):
            raise ConfigError(
                f"must be a number in {low:g}..{high:g}, got {value!r:.40}", field=name
            )
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
    """``counts[t, l, e]``: ``tokens_per_slice`` expert copies per layer and slice, every
    expert equally likely."""
    _check_shape(rng, slices=slices, layers=layers, experts=experts, tokens=tokens_per_slice)
    p = np.full(experts, 1.0 / experts)
    return np.stack(
        [
            np.stack([rng.multinomial(tokens_per_slice, p) for _ in range(layers)])
            for _ in range(slices)
        ]
    )


def _check_shape(rng: object, *, slices: int, layers: int, experts: int, tokens: int) -> None:
    """The generators' arguments: a numpy Generator, at least one slice, layer and expert,
    a non-negative token count per slice, and at most :data:`MAX_CELLS` cells."""
    if not isinstance(rng, np.random.Generator):
        raise ConfigError(
            f"must be a numpy Generator (xds.rng(name) or numpy.random.default_rng(seed)), got "
            f"{type(rng).__name__}",
            field="rng",
        )
    for name, value, low in (
        ("slices", slices, 1),
        ("layers", layers, 1),
        ("experts", experts, 1),
        ("tokens_per_slice", tokens, 0),
    ):
        require_int(value, name, low=low)
    if slices * layers * experts > MAX_CELLS:
        raise ConfigError(
            f"{slices} x {layers} x {experts} counts exceed {MAX_CELLS:,} cells", field="slices"
        )


MAX_CELLS = 2**27
"""Largest ``[time_slice, layer, expert]`` array a counts file may describe (1 GiB of int64;
DeepSeek-R1 over a day of one-minute slices is ~21 M cells)."""

_INT64_MAX = int(np.iinfo(np.int64).max)
_FIELDS = ("time_slice", "layer", "expert", "count")


def load_counts(path: str | Path) -> np.ndarray:
    """A ``[time_slice, layer, expert]`` token-count array from ``.npy`` or from a CSV with
    columns ``time_slice,layer,expert,count`` (one row per nonzero count; rows for the same
    cell add up). Any other suffix is read as CSV.

    Counts are whole numbers >= 0 (a ``.npy`` may hold them as integers or as whole-valued
    floats). A file that cannot be read, is truncated or corrupt, or holds anything else is a
    :class:`~xds.errors.TraceError` naming the file, and for CSV the line and field."""
    path = Path(path)
    if not path.exists():
        raise TraceError("file not found", path=str(path))
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TraceError(f"cannot read: {err.strerror or err}", path=str(path)) from None
    if path.suffix.lower() == ".npy":
        return _npy_counts(data, str(path))
    return _csv_counts(data, str(path))


def _npy_counts(data: bytes, where: str) -> np.ndarray:
    if not data:
        raise TraceError("empty file (expected a .npy array)", path=where)
    if data.startswith(b"PK\x03\x04"):
        raise TraceError(
            "an .npz archive, not one .npy array (save the counts with numpy.save)", path=where
        )
    if not data.startswith(b"\x93NUMPY"):
        raise TraceError(
            "not a .npy file (it lacks the .npy header; counts files are .npy, or CSV)",
            path=where,
        )
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as err:
        if "pickle" in str(err):
            raise TraceError(
                "holds Python objects, not numbers (save an integer array)", path=where
            ) from None
        raise TraceError(_unreadable(err), path=where) from None
    except (EOFError, OSError) as err:
        raise TraceError(_unreadable(err), path=where) from None
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number):
        raise TraceError(f"counts must be numbers, got {arr.dtype} values", path=where)
    if arr.ndim != 3:
        raise TraceError(
            f"expected a [time_slice, layer, expert] array, got shape {arr.shape}", path=where
        )
    if arr.size == 0:
        raise TraceError(f"no counts (shape {arr.shape})", path=where)
    if np.issubdtype(arr.dtype, np.complexfloating):
        raise TraceError(f"counts must be real numbers, got {arr.dtype} values", path=where)

    def at(mask: np.ndarray) -> tuple[str, object]:
        index = np.unravel_index(int(np.argmax(mask)), arr.shape)
        return f"count at [{', '.join(str(int(i)) for i in index)}]", arr[index]

    if np.issubdtype(arr.dtype, np.floating):
        whole = np.isfinite(arr) & (arr == np.floor(arr))
        if not whole.all():
            cell, value = at(~whole)
            raise TraceError(f"{cell} is {value}, not a whole number", path=where)
    if (arr < 0).any():
        cell, value = at(arr < 0)
        raise TraceError(f"{cell} is {value}, must be >= 0", path=where)
    # a float compares with 2**63 - 1 as 2.0**63, which int64 cannot hold: refuse from there
    too_big = arr >= 2.0**63 if np.issubdtype(arr.dtype, np.floating) else arr > _INT64_MAX
    if too_big.any():
        cell, value = at(too_big)
        raise TraceError(f"{cell} is {value}, too large (at most {_INT64_MAX})", path=where)
    return arr.astype(np.int64)


def _unreadable(err: BaseException) -> str:
    detail = " ".join(str(err).split()) or type(err).__name__
    return f"not a readable .npy array (truncated or corrupt: {detail})"


def _csv_counts(data: bytes, where: str) -> np.ndarray:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise TraceError(
            f"not UTF-8 text (byte {data[err.start]:#04x}); counts files are .npy, or CSV",
            path=where,
            line=line,
        ) from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if not text.strip():
        raise TraceError(
            f"empty file (expected the header {','.join(_FIELDS)})", path=where, line=1
        )
    header = [h.strip() for h in lines[0].split(",")]
    if header != list(_FIELDS):
        shown = lines[0] if len(lines[0]) <= 60 else lines[0][:57] + "..."
        raise TraceError(
            f"header must be {','.join(_FIELDS)}, got {shown} (counts files are .npy, or CSV "
            "with that header)",
            path=where,
            line=1,
        )
    cells: dict[tuple[int, int, int], int] = {}
    extent = [0, 0, 0]
    widest = [0, 0, 0]  # the line that last grew each dimension
    for line_no, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        parts = line.split(",")
        if len(parts) != 4:
            raise TraceError(f"expected 4 fields, got {len(parts)}", path=where, line=line_no)
        vals = []
        for name, part in zip(_FIELDS, parts, strict=True):
            p = part.strip()
            digits = p[1:] if p.startswith("-") else p
            if not (digits.isascii() and digits.isdigit()):
                raise TraceError("not an integer", path=where, line=line_no, field=name)
            if p.startswith("-"):
                raise TraceError(f"must be >= 0, got {p}", path=where, line=line_no, field=name)
            if len(digits.lstrip("0")) > 19 or int(digits) > _INT64_MAX:
                raise TraceError(
                    f"{p} is too large (at most {_INT64_MAX})", path=where, line=line_no, field=name
                )
            vals.append(int(digits))
        t, layer, e, count = vals
        for i, v in enumerate((t, layer, e)):
            if v + 1 > extent[i]:
                extent[i], widest[i] = v + 1, line_no
        size = extent[0] * extent[1] * extent[2]
        if size > MAX_CELLS:  # the line that grew the array past the limit names the index
            k = max((k for k in range(3) if widest[k] == line_no), key=vals.__getitem__)
            raise TraceError(
                f"{vals[k]} would make a counts array of {size:,} cells (at most "
                f"{MAX_CELLS:,}); indices count from 0",
                path=where,
                line=line_no,
                field=_FIELDS[k],
            )
        key = (t, layer, e)
        total = cells.get(key, 0) + count
        if total > _INT64_MAX:
            raise TraceError(
                f"the counts for {key} add up to more than {_INT64_MAX}",
                path=where,
                line=line_no,
                field="count",
            )
        cells[key] = total
    if not cells:
        raise TraceError("no counts", path=where)
    out = np.zeros(tuple(extent), dtype=np.int64)
    for key, count in cells.items():
        out[key] = count
    return out


def hottest_over_mean(counts: np.ndarray) -> float:
    """Mean over (slice, layer) of the hottest expert's load over the mean load."""
    mean = counts.mean(axis=-1)
    return float((counts.max(axis=-1) / np.maximum(mean, 1e-12)).mean())


def share_above_mean(counts: np.ndarray) -> float:
    mean = counts.mean(axis=-1, keepdims=True)
    return float((counts > mean).mean())
