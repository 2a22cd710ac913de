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
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from .errors import ConfigError

T = TypeVar("T")


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
        match = re.search(r"- at `\$\.?([^`]*)`", str(exc)) or re.search(
            r"unknown field `([^`]*)`", str(exc)
        )
        field = match.group(1) if match else None
        message = str(exc).split(" - at ")[0]
        raise ConfigError(message, field=field or None, source=source) from None
    except ConfigError as exc:  # a __post_init__ check
        raise ConfigError(str(exc), source=source) from None
