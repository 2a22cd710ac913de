"""Virtual-time runtime: the loop, the clock, seeded random streams and the event log."""

from .core import (
    BACKENDS,
    Runtime,
    call_at_ns,
    current_runtime,
    emit,
    now_ns,
    rng,
    run,
    sleep_ns,
    sleep_until_ns,
    waiting_for,
)
from .events import Event, EventLog, read_jsonl
from .logs import configure_logging, get_logger
from .loop import VirtualTimeEventLoop
from .rng import RngStreams
from .sync import Barrier

__all__ = [
    "BACKENDS",
    "Barrier",
    "Event",
    "EventLog",
    "RngStreams",
    "Runtime",
    "VirtualTimeEventLoop",
    "call_at_ns",
    "configure_logging",
    "current_runtime",
    "emit",
    "get_logger",
    "now_ns",
    "read_jsonl",
    "rng",
    "run",
    "sleep_ns",
    "sleep_until_ns",
    "waiting_for",
]
