"""The structured event log of a run.

Components append :class:`Event` records (virtual time, component, event, fields) with
:meth:`EventLog.emit`. Appending is one list append of a ``msgspec.Struct``; a disabled log costs
one attribute test. The log can be written as JSON Lines and hashed: two runs of the same model
and seed give byte-identical logs, which is how determinism is tested.

``emit`` checks its arguments at the call, so a field the log cannot encode fails there, naming
the field and the event, rather than when the log is written. Plain values (ints, floats, strs,
bools, None, numpy numbers), and flat lists, tuples and dicts of them, pass type tests; anything
else is encoded once on the spot. A set's iteration order depends on the process's hash seed, so
a set, wherever it sits (a field, a list, a dict, a Struct), is recorded as a sorted list, its
JSON form; a set whose elements do not sort together is refused. JSON has no NaN or infinity
(it would write them as null, as it writes None), so a NaN or infinite float is recorded as the
string ``"nan"``, ``"inf"`` or ``"-inf"``. JSON keys are strings: an int dict key is written
as its digits, and a dict whose keys would be written alike (``1`` and ``"1"``) is refused
rather than recorded with one entry lost. A field is recorded as a snapshot: a list, dict or
array the caller changes after ``emit`` does not change the event.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from math import isfinite
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np

from xds.errors import ConfigError


class Event(msgspec.Struct, frozen=True, gc=False):
    """One record of the event log."""

    t_ns: int
    component: str
    event: str
    fields: dict[str, Any] = {}


def _short(obj: Any, width: int = 60) -> str:
    """``repr(obj)``, cut to ``width`` characters."""
    text = repr(obj)
    return text if len(text) <= width else text[: width - 3] + "..."


class _Unencodable(NotImplementedError):
    """A value JSON cannot carry (``obj``), found while encoding the log."""

    def __init__(self, obj: Any):
        super().__init__(f"cannot encode {type(obj).__name__} {_short(obj)} in the event log")
        self.obj = obj


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        item = obj.item()
        if isinstance(item, np.generic):  # no Python equivalent (np.longdouble's is itself)
            if isinstance(item, np.floating):
                return float(item)
            raise _Unencodable(obj)
        return item
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise _Unencodable(obj)


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.json.Decoder(Event)

_PLAIN: frozenset[type] = frozenset(
    {int, float, str, bool, type(None), np.bool_, np.float16, np.float32, np.float64}
    | {np.longdouble}
    | {np.dtype(f"{kind}{size}").type for kind in "iu" for size in (1, 2, 4, 8)}
)
"""Field types that always encode: ``emit`` checks nothing else about them."""
_KEYS: frozenset[type] = frozenset({str, int})
"""Dict key types that always encode."""
_FLOATS: frozenset[type] = frozenset({float, np.float16, np.float32, np.float64, np.longdouble})


def _finite(values: Any) -> bool:
    """No NaN or infinity among ``values``."""
    return all(isfinite(v) for v in values if type(v) in _FLOATS)


def _nonfinite(value: Any) -> bool:
    """``value`` is a NaN or infinite float (JSON would write it as null, like None)."""
    return type(value) in _FLOATS and not isfinite(value)


def _flat(value: Any) -> bool:
    """A list or tuple of plain values, or a dict of them under str or int keys, with no NaN or
    infinity: encodes as it is, holds no set (type tests in C: emit's path for such fields)."""
    kind = type(value)
    if kind is list or kind is tuple:
        return _PLAIN.issuperset(map(type, value)) and _finite(value)
    if kind is dict:
        keys = set(map(type, value))
        return (
            len(keys) < 2  # str and int keys together might collide: the slow path checks
            and _KEYS.issuperset(keys)
            and _PLAIN.issuperset(map(type, value.values()))
            and _finite(value.values())
        )
    return False


def _key_text(key: object) -> str:
    """The JSON object key the log writes for a non-str dict key (e.g. ``1e16`` for 1e16)."""
    try:
        return next(iter(msgspec.json.decode(_encoder.encode({key: None}))))
    except (TypeError, ValueError, msgspec.MsgspecError):
        return repr(key)  # the encoder refuses it: the caller's encode reports it


def _check_keys(value: dict) -> None:
    """JSON object keys are strings: an int key is written as its digits. Raises ValueError if
    two keys of ``value`` would be written alike (``1`` and ``"1"``), one entry lost."""
    if len(set(map(type, value))) > 1:
        seen: dict[str, object] = {}
        for k in value:
            text = k if isinstance(k, str) else _key_text(k)
            if text in seen:
                raise ValueError(f"keys {seen[text]!r} and {k!r} are both written as {text!r}")
            seen[text] = k


def _nonfinite_text(value: Any) -> str:
    """How the log records a NaN or infinite float: ``"nan"``, ``"inf"`` or ``"-inf"``."""
    return "nan" if value != value else "inf" if value > 0 else "-inf"


def _nonfinite_last(value: Any) -> tuple[bool, Any]:
    """Sort key of a set's recorded elements: a NaN or infinity (recorded as its text) after
    the numbers it was among."""
    return (type(value) is str and value in ("nan", "inf", "-inf"), value)


def _sets_sorted(value: Any) -> Any:
    """``value`` with every set in it (through lists, tuples, dicts and their subclasses, and
    msgspec Structs) replaced by a sorted list, and every NaN or infinite float (arrays too) by
    its text (:func:`_nonfinite_text`); ``value`` itself if it holds neither. A set's
    elements are made set-free first, so a set of frozensets sorts as lists do. Raises
    TypeError if a set's elements do not compare."""
    kind = type(value)
    if kind in _PLAIN or _flat(value):
        return _nonfinite_text(value) if _nonfinite(value) else value
    if isinstance(value, (set, frozenset)):
        items = [_sets_sorted(v) for v in value]
        try:
            return sorted(items)
        except TypeError:  # a NaN or infinity, now text, among numbers: numbers first
            return sorted(items, key=_nonfinite_last)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fc" and not np.isfinite(value).all():
            return _sets_sorted(value.tolist())
        return value
    if isinstance(value, (list, tuple)):
        items = [_sets_sorted(v) for v in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return items if isinstance(value, list) else tuple(items)
        return value
    if isinstance(value, dict):
        _check_keys(value)
        entries = {k: _sets_sorted(v) for k, v in value.items()}
        if kind is not dict or any(entries[k] is not v for k, v in value.items()):
            return entries  # a subclass (defaultdict, Counter) is recorded as a plain dict
        return value
    if isinstance(value, msgspec.Struct):
        copy = None  # the same Struct type (its tag, renames, array_like...), sets sorted
        for name in value.__struct_fields__:
            old = getattr(value, name)
            new = _sets_sorted(old)
            if new is not old:
                copy = copy or msgspec.structs.replace(value)
                msgspec.structs.force_setattr(copy, name, new)
        return value if copy is None else copy
    return value


def _checked_fields(component: object, event: object, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as the log records them (sets sorted); raises
    :class:`~xds.errors.ConfigError` naming the argument the log could not encode."""
    if not isinstance(component, str) or not isinstance(event, str):
        name, value = (
            ("component", component) if not isinstance(component, str) else ("event", event)
        )
        raise ConfigError(
            f"emit() takes the {name} as a str, got {type(value).__name__} {_short(value)}",
            field=name,
        )
    for name, value in fields.items():
        if type(value) in _PLAIN and not _nonfinite(value):
            continue
        if _flat(value):
            if type(value) is not tuple:
                fields[name] = value.copy()  # a snapshot: later changes do not show
            continue
        try:
            recorded = _sets_sorted(value)
            _encoder.encode(recorded)
        except _Unencodable as exc:  # a type JSON cannot carry, maybe deep inside
            inner = exc.obj
            problem = "which the event log cannot encode"
            if inner is not value and not (isinstance(value, np.generic) and inner == value):
                problem = f"holding {type(inner).__name__} {_short(inner, 40)}, {problem}"
        except TypeError as exc:  # a set whose elements do not compare
            problem = f"which the event log cannot record in one order (it sorts sets: {exc})"
        except (ValueError, OverflowError) as exc:
            problem = f"which the event log cannot encode ({exc})"
        else:
            try:
                if type(recorded) not in _PLAIN:  # a snapshot: later changes do not show
                    recorded = copy.deepcopy(recorded)  # (what sorting sets left shared too)
            except (TypeError, copy.Error) as exc:  # a memoryview, say: no copy of it
                problem = f"which the event log cannot take a snapshot of ({exc})"
            else:
                fields[name] = recorded
                continue
        raise ConfigError(
            f"emit({component!r}, {event!r}) got {type(value).__name__} {_short(value)}, "
            f"{problem}; fields take numbers, strs, bools, None, numpy scalars and arrays, "
            "msgspec Structs, and lists, tuples, sets and dicts of those",
            field=name,
        )
    return fields


class EventLog:
    """An append-only list of :class:`Event` stamped with the run's virtual clock."""

    def __init__(self, clock: Callable[[], int], *, enabled: bool = True):
        self._clock = clock
        self.enabled = enabled
        self._events: list[Event] = []

    def emit(self, component: str, event: str, **fields: Any) -> None:
        """Append an event at the current virtual time (no-op when the log is disabled).

        Raises :class:`~xds.errors.ConfigError` naming the field (or ``component``/``event``)
        if the log could not encode it.
        """
        if self.enabled:
            if type(component) is not str or type(event) is not str:
                fields = _checked_fields(component, event, fields)
            for name, value in fields.items():  # hot path: plain and flat values pass type tests
                kind = type(value)
                if kind in _PLAIN:
                    if kind in _FLOATS and not isfinite(value):  # NaN or infinity
                        fields = _checked_fields(component, event, fields)
                        break
                elif _flat(value):
                    if kind is not tuple:
                        fields[name] = value.copy()  # a snapshot: later changes do not show
                else:
                    fields = _checked_fields(component, event, fields)
                    break
            self._events.append(Event(self._clock(), component, event, fields))

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    def __getitem__(self, i: int) -> Event:
        return self._events[i]

    def select(self, component: str | None = None, event: str | None = None) -> list[Event]:
        """Events of one component and/or one event name."""
        return [
            e
            for e in self._events
            if (component is None or e.component == component)
            and (event is None or e.event == event)
        ]

    def to_jsonl(self) -> bytes:
        """The whole log as JSON Lines (one event per line)."""
        return b"".join(_encoder.encode(e) + b"\n" for e in self._events)

    def write_jsonl(self, dest: str | Path | IO[bytes]) -> None:
        """Write the log as JSON Lines to a path or a binary file object."""
        data = self.to_jsonl()
        if isinstance(dest, (str, Path)):
            Path(dest).write_bytes(data)
        else:
            dest.write(data)

    def digest(self) -> str:
        """SHA-256 of the JSON Lines form: equal digests mean byte-identical logs."""
        h = hashlib.sha256()
        for e in self._events:
            h.update(_encoder.encode(e))
            h.update(b"\n")
        return h.hexdigest()


def read_jsonl(path: str | Path) -> list[Event]:
    """Read an event log written by :meth:`EventLog.write_jsonl`."""
    return [_decoder.decode(line) for line in Path(path).read_bytes().splitlines() if line]
