"""Trace loaders: Mooncake JSONL, Azure LLM inference CSV, the Vidur/Frontier request CSV,
lengths-only CSVs with a chosen arrival process, and generic CSV/JSONL with a column mapping.

Malformed input fails with :class:`xds.errors.TraceError` naming the file, the line and the
field (a missing column, a column or key given twice, a negative, non-integer or implausibly
large length, timestamps out of order when sorting was not asked for). Nothing is dropped
silently: every line becomes a request or an error. Blank lines are skipped, leading ones
included (format guessing reads the first line that is not blank).
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import math
import re
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..config import require_instance, require_int, require_positive
from ..errors import ConfigError, TraceError
from .workload import Request, Workload, gamma_arrivals, hash_problem, poisson_arrivals

_json = msgspec.json.Decoder()
_BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark, which some editors put at the start of a file."""


def _open(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TraceError(not_a_file(p), path=str(p))
    return p


def not_a_file(p: Path) -> str:
    """Why ``p`` cannot be read as a file: missing, a directory, or something else."""
    if p.is_dir():
        return "is a directory, not a file (a ServeGen dataset directory takes --format servegen)"
    if p.exists():
        return "is not a regular file"
    return "file not found"


MAX_ARRIVAL_NS = 2**63 - 1
MAX_SPAN_NS = 2**62
"""Arrivals, measured from the first, stay well inside int64 nanoseconds (about 146 years)."""
"""Arrivals are int64 nanoseconds (about 292 years)."""


_DECIMAL = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")
"""A number as text: decimal digits, an optional fraction and exponent (not Python's ``1_000``)."""


def _arrival_ns(
    value: Any, unit_ns: float, *, path: str, line: int, field: str, json: bool = False
) -> int:
    """A finite, non-negative arrival time in ``unit_ns`` units, as integer nanoseconds; from
    JSON (``json``) a number, not a string holding one (as token counts there)."""
    if json and isinstance(value, str):
        raise TraceError(
            f"expected a number, got the string {value!r:.40}", path=path, line=line, field=field
        )
    try:
        if (
            isinstance(value, str)
            and not _DECIMAL.fullmatch(value)
            and value.strip().lower().lstrip("+-") not in ("nan", "inf", "infinity")
        ):
            raise ValueError(value)
        t = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise TraceError(f"not a number: {value!r}", path=path, line=line, field=field) from None
    if isinstance(value, bool) or not math.isfinite(t):
        raise TraceError(
            f"must be a finite number, got {value!r}", path=path, line=line, field=field
        )
    if t < 0:
        raise TraceError(f"must be >= 0, got {value!r}", path=path, line=line, field=field)
    ns = t * unit_ns
    if ns > MAX_ARRIVAL_NS:
        raise TraceError(
            f"{value!r} is beyond the int64 nanosecond clock (about 292 years)",
            path=path,
            line=line,
            field=field,
        )
    return round(ns)


def _not_utf8(p: Path) -> TraceError:
    """The error for a file that is not UTF-8, at the line of its first bad byte."""
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return TraceError(
            f"not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8",
            path=str(p),
            line=raw.count(b"\n", 0, exc.start) + 1,
        )
    return TraceError("not UTF-8 text; save the file as UTF-8", path=str(p))


MAX_TOKENS = 1_000_000_000
"""Largest token count a trace may give (a billion: far beyond any context window, so a larger
number is a corrupt or mis-scaled field; the bound the CLI puts on its whole numbers too)."""

_PLAIN_INT = re.compile(r"\s*(-?[0-9]+)(?:\.0*)?\s*")
"""An integer as text: decimal digits (``10.0`` too, as JSON's ``10.0``); no ``1_000``, ``1e3``
or ``+5``."""


def _int_field(
    value: Any,
    *,
    path: str,
    line: int,
    field: str,
    minimum: int = 0,
    maximum: int = MAX_TOKENS,
    json: bool = False,
) -> int:
    """A token count in ``minimum..maximum``: an integer, written as plain digits in a CSV
    field, or a JSON number of integral value (``json``: a JSON string is refused)."""
    if isinstance(value, bool) or (json and isinstance(value, str)):
        shown = f"{value!r} (a string)" if isinstance(value, str) else repr(value)
        what = "a number" if json else "an integer"
        raise TraceError(f"expected {what}, got {shown}", path=path, line=line, field=field)
    if isinstance(value, int):
        out = value
    elif isinstance(value, float) and value.is_integer():
        out = int(value)
    elif isinstance(value, str) and (m := _PLAIN_INT.fullmatch(value)):
        out = int(m[1])
    else:
        what = "an integer (plain decimal digits)" if isinstance(value, str) else "an integer"
        raise TraceError(f"expected {what}, got {value!r}", path=path, line=line, field=field)
    if out < minimum:
        raise TraceError(f"must be >= {minimum}, got {out}", path=path, line=line, field=field)
    if out > maximum:
        raise TraceError(
            f"must be at most {maximum:,} (a token count), got {value!r}",
            path=path,
            line=line,
            field=field,
        )
    return out


def _check_limit(limit: object) -> int | None:
    """``limit``: None (every request) or a count of requests >= 1."""
    return None if limit is None else require_int(limit, "limit", low=1)


def _reached(rows: list[Any], limit: int | None, sort: bool) -> bool:
    """A loader has read ``limit`` requests and may stop (the rows after them are not read,
    nor checked); never when sorting, which needs every row first."""
    return limit is not None and not sort and len(rows) >= limit


def _finish(
    rows: list[tuple[int, int, int, tuple[int, ...], int]],
    path: str,
    sort: bool,
    field: str = "timestamp",
    limit: int | None = None,
) -> Workload:
    """Order by arrival (or check the order), rebase arrivals to 0, number the requests; the
    first ``limit`` of them, named so in the workload's source."""
    if not isinstance(sort, bool):  # "no" would be truthy
        raise ConfigError(f"sort must be True or False, got {sort!r:.40}", field="sort")
    if not rows:
        raise TraceError("no requests in the file", path=path)
    if not sort:
        for (a, *_), (b, *rest) in itertools.pairwise(rows):
            if b < a:
                raise TraceError(
                    "timestamps go backwards (sort the file, or let xds sort it: "
                    "sort=True, or --sort on the command line)",
                    path=path,
                    line=rest[-1],
                    field=field,
                )
    else:
        rows = sorted(rows, key=lambda r: (r[0], r[4]))
    source = path
    if limit is not None and len(rows) >= limit:  # read up to it, or sorted and cut to it
        rows, source = rows[:limit], f"{path}, first {limit}"
    base = rows[0][0] if rows else 0
    far = next((r for r in rows if r[0] - base >= MAX_SPAN_NS), None)
    if far is not None:  # beyond int64 nanoseconds
        raise TraceError(
            f"arrives {(far[0] - base) / 86_400e9 / 365.25:,.0f} years after the first request "
            f"(line {rows[0][4]}): beyond the clock's range (int64 nanoseconds, about 146 years)",
            path=path,
            line=far[4],
            field=field,
        )
    return Workload(
        tuple(Request(i, a - base, x, y, h, line) for i, (a, x, y, h, line) in enumerate(rows)),
        source,
    )


MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in Mooncake traces (its README: one hash per 512-token block)."""
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _block_hashes(
    raw: object, input_tokens: int, block_tokens: int, *, path: str, line: int, field: str
) -> tuple[int, ...]:
    """A request's prefix block hashes: a list of integers >= 0 (no bools, no floats: a
    truncated 1.9 would collide with 1 and fake a cache hit), at most one per ``block_tokens``
    of its ``input_tokens``."""
    if not isinstance(raw, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in raw
    ):
        raise TraceError("expected a list of integers", path=path, line=line, field=field)
    problem = hash_problem(raw, input_tokens, block_tokens)
    if problem:
        raise TraceError(problem, path=path, line=line, field=field)
    return tuple(int(h) for h in raw)


def load_mooncake(path: str | Path, *, sort: bool = False, limit: int | None = None) -> Workload:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    limit = _check_limit(limit)
    p = _open(path)
    rows = []
    for line_no, obj in _json_objects(p, MOONCAKE_KEYS):
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceError("missing", path=str(p), line=line_no, field=key)
        ts_ns = _arrival_ns(
            obj["timestamp"], 1_000_000, path=str(p), line=line_no, field="timestamp", json=True
        )
        x, y = (
            _int_field(obj[key], path=str(p), line=line_no, field=key, minimum=1, json=True)
            for key in ("input_length", "output_length")
        )
        hashes = _block_hashes(
            obj.get("hash_ids", []),
            x,
            MOONCAKE_BLOCK_TOKENS,
            path=str(p),
            line=line_no,
            field="hash_ids",
        )
        rows.append((ts_ns, x, y, hashes, line_no))
        if _reached(rows, limit, sort):
            break
    workload = _finish(rows, str(p), sort, limit=limit)
    if any(r.prefix_hashes for r in workload.requests):
        workload = msgspec.structs.replace(workload, hash_block_tokens=MOONCAKE_BLOCK_TOKENS)
    return workload


def _json_objects(p: Path, keys: Collection[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The JSON object on each non-blank line of a JSONL file (a leading BOM is fine); one of
    ``keys`` (those the loader reads) given twice on a line is an error."""
    with p.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            raw = raw.removeprefix(_BOM) if line_no == 1 else raw
            if not raw.strip():
                continue
            try:
                obj = _json.decode(raw)
            except msgspec.DecodeError as exc:
                # msgspec says "(byte N)" for the position in the line: say so plainly
                why = re.sub(r"\(byte (\d+)\)", r"at position \1 of the line", str(exc))
                hint = ""
                if line_no == 1 and not raw.lstrip().startswith(b"{"):
                    hint = "; a JSONL trace has one JSON object per line: is --format right?"
                raise TraceError(f"invalid JSON ({why}){hint}", path=str(p), line=line_no) from None
            except RecursionError:
                raise TraceError(
                    "invalid JSON (nested too deeply to read)", path=str(p), line=line_no
                ) from None
            if not isinstance(obj, dict):
                raise TraceError("expected a JSON object", path=str(p), line=line_no)
            if (key := _key_twice(raw, keys)) is not None:
                raise TraceError(
                    "key given twice on the line (which value is meant?)",
                    path=str(p),
                    line=line_no,
                    field=key,
                )
            yield line_no, obj


def _key_twice(raw: bytes, keys: Collection[str]) -> str | None:
    """The first of ``keys`` that the JSON object ``raw`` has twice at its top level (a
    decoder keeps the last silently). Without a backslash a key is spelt exactly as its name,
    so counting its quoted name finds every candidate; only then is the line parsed again."""
    if b"\\" not in raw and all(raw.count(b'"' + k.encode() + b'"') < 2 for k in keys):
        return None
    seen: set[str] = set()
    for key, _ in json.loads(raw, object_pairs_hook=lambda pairs: pairs):
        if key in keys and key in seen:
            return key
        seen.add(key)
    return None


_CSV_FIELD_BYTES = 1 << 30
"""The longest CSV field a trace may hold (the csv module's own limit is 128 KiB)."""


def _csv_rows(
    p: Path, required: list[str], also: Collection[str] = ()
) -> Iterator[tuple[int, dict[str, str]]]:
    """The rows of a UTF-8 CSV (a leading byte-order mark and leading blank lines are fine)
    with ``required`` columns; a column it reads (``required`` or ``also``) named twice in
    the header is an error. A field may be long (request logs carry prompt text): the csv
    module's 128 KiB field limit is lifted while the file is read."""
    limit = csv.field_size_limit()
    with p.open(newline="", encoding="utf-8-sig") as f:
        csv.field_size_limit(max(limit, _CSV_FIELD_BYTES))
        reader = None
        skipped = 0
        try:
            first = f.readline()
            while first and not first.strip():
                skipped += 1
                first = f.readline()
            if not first:
                raise TraceError(
                    "no requests in the file (empty, or only blank lines)", path=str(p)
                )
            reader = csv.DictReader(itertools.chain([first], f))
            yield from _checked_rows(p, reader, required, also, skipped)
        except UnicodeDecodeError:
            raise _not_utf8(p) from None
        except csv.Error as exc:
            line = None if reader is None else reader.line_num + 1 + skipped  # the row it was on
            raise TraceError(f"not readable as CSV: {exc}", path=str(p), line=line) from None
        finally:
            csv.field_size_limit(limit)


def _line_breaks(value: object) -> int:
    """Line breaks (``\\r\\n``, ``\\n`` or ``\\r``) inside a CSV field's text (a list: the
    fields past the header's)."""
    if isinstance(value, list):
        return sum(map(_line_breaks, value))
    if not isinstance(value, str) or not ("\n" in value or "\r" in value):
        return 0
    return value.count("\n") + value.count("\r") - value.count("\r\n")


def _checked_rows(
    p: Path, reader: csv.DictReader, required: list[str], also: Collection[str], skipped: int
) -> Iterator[tuple[int, dict[str, str]]]:
    if reader.fieldnames:  # names are trimmed as values are ("arrived_at , num_..." reads)
        reader.fieldnames = [name.strip() for name in reader.fieldnames]
    header = reader.fieldnames or []
    header_line = skipped + 1
    for col in required:
        if col not in header:
            looks_json = bool(header) and header[0].lstrip().startswith(("{", "["))
            raise TraceError(
                f"missing column (header has {', '.join(header)})"
                + ("; this looks like JSON lines: is --format right?" if looks_json else ""),
                path=str(p),
                line=header_line,
                field=col,
            )
    for col in (*required, *also):
        if header.count(col) > 1:
            at = [i + 1 for i, name in enumerate(header) if name == col]
            raise TraceError(
                f"column named twice in the header (columns {at[0]} and {at[1]}; which is meant?)",
                path=str(p),
                line=header_line,
                field=col,
            )
    for row in reader:
        # the physical line the record starts on: the reader stands on its last line, below
        # any line breaks inside its quoted fields (blank lines before it are skipped)
        line_no = reader.line_num + skipped - sum(map(_line_breaks, row.values()))
        present = [v for v in row.values() if v is not None]
        if len(present) == 1 and isinstance(present[0], str) and not present[0].strip():
            continue  # a line of spaces only: blank, as the csv module skips empty ones
        if None in row or any(v is None for v in row.values()):
            raise TraceError("wrong number of fields", path=str(p), line=line_no)
        yield line_no, row


def load_azure(path: str | Path, *, sort: bool = False, limit: int | None = None) -> Workload:
    """Azure LLM inference trace CSV: ``TIMESTAMP`` (date-time), ``ContextTokens``,
    ``GeneratedTokens``."""
    limit = _check_limit(limit)
    p = _open(path)
    rows = []
    for line_no, row in _csv_rows(p, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]):
        raw = row["TIMESTAMP"].strip()
        try:
            ns = _timestamp_ns(raw)
        except ValueError:
            raise TraceError(
                f"not a timestamp: {raw!r}", path=str(p), line=line_no, field="TIMESTAMP"
            ) from None
        x = _int_field(
            row["ContextTokens"], path=str(p), line=line_no, field="ContextTokens", minimum=1
        )
        y = _int_field(
            row["GeneratedTokens"], path=str(p), line=line_no, field="GeneratedTokens", minimum=1
        )
        rows.append((ns, x, y, (), line_no))
        if _reached(rows, limit, sort):
            break
    return _finish(rows, str(p), sort, "TIMESTAMP", limit)


_STAMP = re.compile(r"(?P<head>[^.,]*?)(?:[.,](?P<frac>\d+))?(?P<tz>Z|[+-]\d\d:?\d\d)?")


def _timestamp_ns(raw: str) -> int:
    """An ISO date-time with up to nanosecond digits (Azure writes 7; a decimal point or an
    ISO comma) and an optional UTC offset (none means UTC), as nanoseconds since the epoch."""
    m = _STAMP.fullmatch(raw)
    if m is None or not m["head"]:
        raise ValueError(raw)
    tz = m["tz"] or ""
    stamp = dt.datetime.fromisoformat(m["head"] + ("+00:00" if tz == "Z" else tz))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    frac = int(((m["frac"] or "") + "0" * 9)[:9])
    return int(stamp.timestamp()) * 1_000_000_000 + frac


def load_request_csv(path: str | Path, *, sort: bool = False, limit: int | None = None) -> Workload:
    """The request CSV of Vidur and Frontier: ``arrived_at`` (s), ``num_prefill_tokens``,
    ``num_decode_tokens``."""
    limit = _check_limit(limit)
    p = _open(path)
    rows = []
    for line_no, row in _csv_rows(p, ["arrived_at", "num_prefill_tokens", "num_decode_tokens"]):
        arrival = _arrival_ns(row["arrived_at"], 1e9, path=str(p), line=line_no, field="arrived_at")
        x = _int_field(
            row["num_prefill_tokens"],
            path=str(p),
            line=line_no,
            field="num_prefill_tokens",
            minimum=1,
        )
        y = _int_field(
            row["num_decode_tokens"],
            path=str(p),
            line=line_no,
            field="num_decode_tokens",
            minimum=1,
        )
        rows.append((arrival, x, y, (), line_no))
        if _reached(rows, limit, sort):
            break
    return _finish(rows, str(p), sort, "arrived_at", limit)


def load_lengths(
    path: str | Path,
    *,
    input_column: str,
    output_column: str,
    rng: np.random.Generator,
    rate_per_s: float,
    cv: float = 1.0,
    invalid: str = "error",
    limit: int | None = None,
) -> Workload:
    """A lengths-only CSV (e.g. ShareGPT or Vidur's processed lengths) with arrivals from a
    Poisson (``cv = 1``) or Gamma process at ``rate_per_s``. ``invalid="drop"`` leaves out
    rows with unusable lengths (e.g. ShareGPT's empty turns) and lists them in
    ``Workload.dropped``; the default raises."""
    if invalid not in ("error", "drop"):
        raise TraceError(f"invalid must be 'error' or 'drop', got {invalid!r}", field="invalid")
    require_instance(rng, np.random.Generator, "rng")
    require_positive(cv, "cv")
    limit = _check_limit(limit)
    if input_column == output_column:
        raise TraceError(
            f"input_column and output_column both name {input_column!r}: each length needs "
            "its own column",
            field="output_column",
        )
    p = _open(path)
    lengths = []
    lines = []
    dropped: list[tuple[int, str]] = []
    for line_no, row in _csv_rows(p, [input_column, output_column]):
        try:
            x = _int_field(
                row[input_column], path=str(p), line=line_no, field=input_column, minimum=1
            )
            y = _int_field(
                row[output_column], path=str(p), line=line_no, field=output_column, minimum=1
            )
        except TraceError as exc:
            if invalid == "error":
                exc.args = (
                    f"{exc} (to leave such rows out: --drop-invalid; in Python invalid='drop')",
                )
                raise
            dropped.append((line_no, str(exc)))
            continue
        lengths.append((x, y))
        lines.append(line_no)
        if _reached(lengths, limit, False):
            break
    n = len(lengths)
    if not n:
        why = f" ({len(dropped):,} rows had unusable lengths)" if dropped else ""
        raise TraceError(f"no requests in the file{why}", path=str(p))
    arrivals = (
        poisson_arrivals(rng, n, rate_per_s)
        if cv == 1.0
        else gamma_arrivals(rng, n, rate_per_s, cv)
    )
    process = "Poisson" if cv == 1.0 else f"Gamma cv {cv:g}"
    first = f", first {limit}" if limit is not None and n >= limit else ""
    return Workload(
        tuple(
            Request(i, int(arrivals[i] - arrivals[0]) if n else 0, x, y, (), lines[i])
            for i, (x, y) in enumerate(lengths)
        ),
        f"{p}{first} (columns {input_column}/{output_column}, {process} at {rate_per_s:g} req/s)",
        tuple(dropped),
    )


GENERIC_KEYS = ("arrival", "input", "output", "hashes")
"""What :func:`load_generic`'s ``mapping`` may map to the file's columns."""


def load_generic(
    path: str | Path,
    *,
    mapping: dict[str, str],
    time_unit_ns: int = 1,
    sort: bool = False,
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
) -> Workload:
    """A CSV, or JSONL (suffix .jsonl, .json or .ndjson, any case), with your column names:
    ``mapping`` maps ``arrival``, ``input``, ``output`` (and optionally ``hashes``) to the
    file's columns; arrivals are multiplied by
    ``time_unit_ns`` (e.g. 1_000_000 for milliseconds). ``hashes`` holds each request's prefix
    block hashes (a JSON list, or integers separated by spaces or semicolons in a CSV), one per
    ``hash_block_tokens`` of its input (default 512, Mooncake's block); a replay checks that
    the deployment's prefix cache uses the same block size."""
    hash_block_tokens = require_int(hash_block_tokens, "hash_block_tokens", low=1)
    require_positive(time_unit_ns, "time_unit_ns")
    limit = _check_limit(limit)
    p = _open(path)
    for key in ("arrival", "input", "output"):
        if key not in mapping:
            raise TraceError(f"mapping needs {key!r}", path=str(p), field=key)
    for key in mapping:
        if key not in GENERIC_KEYS:
            raise TraceError(
                f"unknown mapping key {key!r} (known: {', '.join(GENERIC_KEYS)})",
                path=str(p),
                field=key,
            )
    records: Iterator[tuple[int, dict[str, Any]]]
    mapped = [mapping[k] for k in GENERIC_KEYS if k in mapping]
    named_by: dict[str, str] = {}  # column -> the first key naming it
    for key in (k for k in GENERIC_KEYS if k in mapping):
        first = named_by.setdefault(mapping[key], key)
        if first != key:
            raise TraceError(
                f"mapping: {first!r} and {key!r} both name column {mapping[key]!r} (each "
                "quantity needs its own column)",
                path=str(p),
                field=key,
            )
    from_json = p.suffix.lower() in (".jsonl", ".json", ".ndjson")
    # a CSV's header must have a mapped hashes column too (a row may leave it empty)
    records = _json_objects(p, set(mapped)) if from_json else _csv_rows(p, mapped, set(mapped))
    hashes_seen = False
    get: Callable[[dict[str, Any], str, int], Any] = _getter(str(p))
    rows = []
    for line_no, row in records:
        arrival = _arrival_ns(
            get(row, mapping["arrival"], line_no),
            time_unit_ns,
            path=str(p),
            line=line_no,
            field=mapping["arrival"],
            json=from_json,
        )
        x = _int_field(
            get(row, mapping["input"], line_no),
            path=str(p),
            line=line_no,
            field=mapping["input"],
            minimum=1,
            json=from_json,
        )
        y = _int_field(
            get(row, mapping["output"], line_no),
            path=str(p),
            line=line_no,
            field=mapping["output"],
            minimum=1,
            json=from_json,
        )
        hashes: tuple[int, ...] = ()
        if "hashes" in mapping and mapping["hashes"] in row:
            hashes_seen = True
            raw = row[mapping["hashes"]]
            if isinstance(raw, str) and not from_json:  # CSV: integers, space or ; apart
                words = raw.replace(";", " ").split()
                if not all(w.isascii() and w.isdigit() for w in words):
                    raise TraceError(
                        "expected integers >= 0 separated by spaces or semicolons",
                        path=str(p),
                        line=line_no,
                        field=mapping["hashes"],
                    )
                raw = [int(w) for w in words]
            hashes = _block_hashes(
                raw, x, hash_block_tokens, path=str(p), line=line_no, field=mapping["hashes"]
            )
        rows.append((arrival, x, y, hashes, line_no))
        if _reached(rows, limit, sort):
            hashes_seen = True  # read only up to the limit: later rows may have them
            break
    # the whole file read: a mapped hashes field that no row has is a misspelling
    if "hashes" in mapping and rows and not hashes_seen:
        raise TraceError(
            f"no row has the hashes field {mapping['hashes']!r} the mapping names",
            path=str(p),
            field=mapping["hashes"],
        )
    workload = _finish(rows, str(p), sort, mapping["arrival"], limit)
    if any(r.prefix_hashes for r in workload.requests):
        workload = msgspec.structs.replace(workload, hash_block_tokens=hash_block_tokens)
    return workload


def _getter(path: str) -> Callable[[dict[str, Any], str, int], Any]:
    def get(row: dict[str, Any], key: str, line: int) -> Any:
        if key not in row:
            raise TraceError("missing", path=path, line=line, field=key)
        return row[key]

    return get


FORMATS: dict[str, Callable[..., Workload]] = {
    "mooncake": load_mooncake,
    "azure": load_azure,
    "request-csv": load_request_csv,
}


FORMAT_NAMES = (*FORMATS, "servegen")
"""What ``load(path, fmt=...)`` takes (a lengths-only CSV has no arrival times:
:func:`load_lengths`)."""


def _first_line(p: Path) -> str | None:
    """The first line of ``p`` that is not blank (as the loaders skip blank lines), or None."""
    with p.open("rb") as f:
        for raw in f:
            line = raw.removeprefix(_BOM).decode("utf-8", errors="replace")
            if line.strip():
                return line
    return None


def guess_format(path: str | Path) -> str:
    """The format of a trace, from its first line that is not blank: ``mooncake``, ``azure``
    or ``request-csv`` (``servegen`` for a directory)."""
    if Path(path).is_dir():
        return "servegen"
    p = _open(path)
    first = _first_line(p)
    if first is None:
        raise TraceError("no requests in the file (empty, or only blank lines)", path=str(p))
    if first.lstrip().startswith("{") and "input_length" in first:
        return "mooncake"
    columns = {name.strip().strip('"') for name in first.split(",")}
    if "TIMESTAMP" in columns:
        return "azure"
    if "arrived_at" in columns:
        return "request-csv"
    if re.fullmatch(r"chunk-\d+-(trace\.csv|dataset\.json)", p.name):
        raise TraceError(
            "a file of a ServeGen client pool: pass the pool's directory "
            f"({p.parent}), which xds reads whole",
            path=str(p),
        )
    if {"prompt_tokens", "completion_tokens"} <= columns:
        raise TraceError(
            "this looks like a lengths-only CSV (prompt_tokens, completion_tokens, no arrival "
            "times): --format lengths --rate R draws Poisson arrivals at R req/s (in Python "
            "load_lengths(path, rng=..., rate_per_s=...))",
            path=str(p),
        )
    raise TraceError(
        "cannot tell the trace format from its first line; name it (--format mooncake, azure, "
        "request-csv, servegen or lengths on the command line; in Python fmt='mooncake', "
        "'azure', 'request-csv' or 'servegen', and load_lengths(...) for a lengths-only CSV) "
        "or map its columns with load_generic",
        path=str(p),
    )


def load(path: str | Path, fmt: str | None = None, **options: Any) -> Workload:
    """Load a trace, guessing the format from its first line that is not blank when ``fmt``
    is None (a directory is a ServeGen client pool:
    :func:`~xds.trace.servegen.load_servegen`)."""
    if fmt == "servegen" or (fmt is None and Path(path).is_dir()):
        from .servegen import load_servegen

        return load_servegen(path, **options)
    if fmt == "lengths":
        raise TraceError(
            "a lengths-only CSV has no arrival times: load it with load_lengths(path, "
            "input_column=..., output_column=..., rng=..., rate_per_s=...), which draws them",
            path=str(path),
        )
    if fmt is not None and fmt not in FORMATS:
        raise TraceError(
            f"unknown format {fmt!r}; known: {', '.join(FORMAT_NAMES)} (and load_lengths for a "
            "lengths-only CSV)",
            path=str(path),
        )
    p = _open(path)
    return FORMATS[fmt or guess_format(p)](p, **options)
