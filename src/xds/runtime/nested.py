"""Measurements that are runs of their own, taken from inside a run.

Some models price themselves by simulating something else first (a decode TE measures its
dispatch/combine costs on the pod; an MoE-attention deployment its A2E/E2A curve). Those are
``xds.run`` calls, which cannot nest in a running loop; :func:`run_nested` runs them in a
helper thread while the calling run waits, so its virtual time does not move meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from .core import _current

T = TypeVar("T")


def run_nested(measure: Callable[[], T], *, name: str = "xds-nested") -> T:
    """``measure()`` (which may call ``xds.run``) in a helper thread; the calling thread waits
    for it. Errors are raised here, as themselves."""
    out: list[T] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            out.append(measure())
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=work, name=name)
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return out[0]


def measure_anywhere(measure: Callable[[], T], *, name: str = "xds-nested") -> T:
    """``measure()`` wherever it is asked for: called directly outside a run, through
    :func:`run_nested` inside one (in this thread)."""
    if _current.get() is None:
        return measure()
    return run_nested(measure, name=name)
