"""Loading configs from TOML or JSON files with errors that name the file and the field.

Configs are frozen ``msgspec.Struct`` types (e.g. :class:`xds.serve.decode.DecodeConfig`).
:func:`load_config` reads a file (``.toml`` or ``.json``), converts it to the type with
msgspec's validation, and turns any problem into one :class:`xds.errors.ConfigError` naming the
file and the field path (``$.mtp.acceptance[0]`` style).
"""

from __future__ import annotations

import json
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from .errors import ConfigError

T = TypeVar("T")
_checking: ContextVar[bool] = ContextVar("xds_config_checking", default=False)


def _read(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError("file not found", source=str(path))
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix == ".json":
            return json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse: {exc}", source=str(path)) from None
    raise ConfigError("config files are .toml or .json", source=str(path))


def load_config(path: str | Path, kind: type[T], *, overrides: dict[str, Any] | None = None) -> T:
    """Read ``path`` as a ``kind`` (a msgspec Struct); ``overrides`` replace top-level keys."""
    p = Path(path)
    data = _read(p)
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a table/object", source=str(p))
    if overrides:
        data = {**data, **overrides}
    return convert(data, kind, source=str(p))


def convert(data: Any, kind: type[T], *, source: str | None = None) -> T:
    """msgspec conversion with validation, as a ConfigError naming the field."""
    try:
        return msgspec.convert(data, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise _config_error(exc, source) from None
    except ConfigError as exc:  # a __post_init__ check
        raise ConfigError(str(exc), source=source) from None


def _config_error(exc: msgspec.ValidationError, source: str | None) -> ConfigError:
    match = re.search(r"- at `\$\.?([^`]*)`", str(exc)) or re.search(
        r"unknown field `([^`]*)`", str(exc)
    )
    field = match.group(1) if match else None
    message = str(exc).split(" - at ")[0]
    return ConfigError(message, field=field or None, source=source)


class _FieldsChecked(Exception):
    """Raised by the copy :func:`check_fields` validates, once msgspec has checked its fields
    and called its ``__post_init__``: stops the class's own checks from running twice."""


def check_fields(struct: msgspec.Struct) -> None:
    """Validate a config or spec built in Python against its annotations (types and ``Meta``
    bounds), as loading it from TOML or JSON does: call first in ``__post_init__``. Nested
    structs were checked when they were built; a bad value raises one ConfigError naming the
    field."""
    if _checking.get():  # the copy being validated below: its fields passed
        raise _FieldsChecked
    token = _checking.set(True)
    try:
        msgspec.convert(msgspec.structs.asdict(struct), type(struct))
    except _FieldsChecked:
        pass
    except msgspec.ValidationError as exc:
        raise _config_error(exc, None) from None
    finally:
        _checking.reset(token)
