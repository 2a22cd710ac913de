"""The structured event log of a run.

Components append :class:`Event` records (virtual time, component, event, fields) with
:meth:`EventLog.emit`. Appending is one list append of a ``msgspec.Struct``; a disabled log costs
one attribute test. The log can be written as JSON Lines and hashed: two runs of the same model
and seed give byte-identical logs, which is how determinism is tested.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np


class Event(msgspec.Struct, frozen=True, gc=False):
    """One record of the event log."""

    t_ns: int
    component: str
    event: str
    fields: dict[str, Any] = {}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in the event log")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.json.Decoder(Event)


class EventLog:
    """An append-only list of :class:`Event` stamped with the run's virtual clock."""

    def __init__(self, clock: Callable[[], int], *, enabled: bool = True):
        self._clock = clock
        self.enabled = enabled
        self._events: list[Event] = []

    def emit(self, component: str, event: str, **fields: Any) -> None:
        """Append an event at the current virtual time (no-op when the log is disabled)."""
        if self.enabled:
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
