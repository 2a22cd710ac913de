"""structlog set-up with virtual timestamps.

Log lines carry ``t_ns``, the run's virtual time, instead of a wall-clock timestamp (simulation
code never reads the wall clock). Use :func:`get_logger` with a component name.
"""

from __future__ import annotations

import logging as _stdlib_logging
import os
import sys
from typing import Any

import structlog


def _virtual_time(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    from .core import _current

    rt = _current.get()
    if rt is not None and "t_ns" not in event_dict:
        event_dict["t_ns"] = rt.now_ns()
    return event_dict


class _StderrLogger:
    """structlog's print logger, writing to ``sys.stderr`` as it is at each call: a test
    harness swaps ``sys.stderr`` per test (pytest's capture), so a stream held from the
    first configuration would be another test's, closed by then."""

    def __init__(self, *args: Any) -> None:  # a logger factory: structlog passes names
        pass

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


def configure_logging(level: str | None = None, *, json: bool = False) -> None:
    """Configure structlog for xds: virtual ``t_ns`` stamps, level filter, console or JSON.

    ``level`` defaults to the ``XDS_LOG_LEVEL`` environment variable, else ``warning``.
    """
    name = (level or os.environ.get("XDS_LOG_LEVEL") or "warning").upper()
    numeric = getattr(_stdlib_logging, name, None)
    if not isinstance(numeric, int):
        from xds.errors import ConfigError

        choices = "debug, info, warning, error, critical"
        if level:
            raise ConfigError(f"unknown log level {level!r}; one of {choices}", field="level")
        raise ConfigError(
            f"unknown log level {os.environ.get('XDS_LOG_LEVEL')!r}; one of {choices}",
            field="XDS_LOG_LEVEL",
        )
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _virtual_time,
            structlog.processors.add_log_level,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_StderrLogger,
        cache_logger_on_first_use=False,
    )


def ensure_logging_configured() -> None:
    """Configure xds logging unless the application already configured structlog."""
    if not structlog.is_configured():
        configure_logging()


def get_logger(component: str) -> Any:
    """A structlog logger bound to ``component``."""
    return structlog.get_logger().bind(component=component)
