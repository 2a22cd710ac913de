"""Loading configs from TOML or JSON files with errors that name the file and the field.

Configs are frozen ``msgspec.Struct`` types (e.g. :class:`xds.serve.decode.DecodeConfig`).
:func:`load_config` reads a file (``.toml`` or ``.json``), converts it to the type with
msgspec's validation, and turns any problem into one :class:`xds.errors.ConfigError` naming the
file and the field path (``$.mtp.acceptance[0]`` style).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import numbers
import re
import tomllib
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
import numpy as np

from .errors import ConfigError

T = TypeVar("T")
_checking: ContextVar[type | None] = ContextVar("xds_config_checking", default=None)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused if a key repeats (TOML refuses it too; JSON keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _read(path: Path) -> Any:
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "is not a regular file"
        raise ConfigError(why if path.exists() else "file not found", source=str(path))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark is fine
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8",
            source=str(path),
        ) from None
    try:
        if path.suffix.lower() == ".toml":
            return tomllib.loads(text)
        if path.suffix.lower() == ".json":
            return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse: {exc}", source=str(path)) from None
    except RecursionError:
        raise ConfigError("cannot parse: nested too deeply", source=str(path)) from None
    except _DuplicateKey as exc:
        raise ConfigError(
            f"key {exc.args[0]!r} appears twice in one object (which value is meant?)",
            source=str(path),
        ) from None
    raise ConfigError("config files are .toml or .json", source=str(path))


def load_config(
    path: str | Path,
    kind: type[T],
    *,
    overrides: dict[str, Any] | None = None,
    base: T | None = None,
) -> T:
    """Read ``path`` as a ``kind`` (a msgspec Struct); ``overrides`` replace top-level keys.

    The file changes only what it writes: its tables are merged key by key into ``base``
    (default: ``kind()``), so ``[decode]`` with one key keeps every other field of the base's
    decode table rather than falling back to a standalone decode config's defaults. Lists are
    replaced whole."""
    p = Path(path)
    data = _read(p)
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a table/object", source=str(p))
    if overrides:
        data = {**data, **overrides}
    if base is None:
        try:
            base = kind()
        except (TypeError, ConfigError):  # required fields: nothing to merge into
            base = None
    if base is not None:
        data = _merged(msgspec.to_builtins(base), data)
    try:
        return convert(data, kind, source=str(p))
    except ConfigError as exc:
        raise in_file(exc, p) from None


def in_file(exc: ConfigError, path: str | Path) -> ConfigError:
    """``exc`` about a field of the config file ``path``: naming the file, and the line that
    sets the field where a TOML file spells it simply."""
    p = Path(path)
    line = _toml_line(p, exc.field) if p.suffix.lower() == ".toml" and exc.field else None
    where = f" (line {line})" if line is not None else ""
    if line is None and exc.field and not _sets(p, exc.field):
        where = " (the default: the file does not set it)"
    return ConfigError(f"{exc.message}{where}", field=exc.field, source=str(p))


def _sets(path: Path, field: str) -> bool:
    """Whether the config file sets the dotted ``field`` (True when that cannot be told)."""
    try:
        data: Any = _read(path)
    except ConfigError:
        return True
    for key in field.split("."):
        name = key.split("[")[0]
        if not isinstance(data, dict) or name not in data:
            return False
        data = data[name]
        if "[" in key:
            return True  # an element of a list: the file wrote the list
    return True


def _toml_line(path: Path, field: str) -> int | None:
    """The line of ``path`` (a TOML file) that sets the dotted ``field`` (``faults[1].dp``: the
    ``dp`` key of the second ``[[faults]]`` table): a ``key =`` line under its table header, or
    the header of the table; None if the file does not spell it that simply (inline tables,
    dotted keys)."""
    want = [
        (m.group(1), int(m.group(2)) if m.group(2) else None)
        for m in re.finditer(r"([^.\[\]]+)(?:\[(\d+)\])?", field)
    ]
    table: list[tuple[str, int | None]] = []
    seen: dict[str, int] = {}  # array-of-tables header -> tables so far
    header_line = None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for n, raw in enumerate(lines, 1):
        text = raw.strip()
        head = re.fullmatch(r"(\[\[?)\s*([\w.\s-]+?)\s*\]\]?(\s*#.*)?", text)
        if head:
            name = ".".join(t.strip() for t in head.group(2).split("."))
            table = [(t, None) for t in name.split(".")]
            if head.group(1) == "[[":  # one more table of the array
                seen[name] = seen.get(name, -1) + 1
                table[-1] = (table[-1][0], seen[name])
            if table == want:
                header_line = n
            continue
        key = re.match(r"([\w-]+)\s*=", text)
        if key and [*table, (key.group(1), None)] in (want, [*want[:-1], (want[-1][0], None)]):
            return n  # the key, or an element of the array it sets
    return header_line


def _merged(base: Any, update: Any) -> Any:
    """``update`` laid over ``base``: tables merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(update, dict):
        out = dict(base)
        for key, value in update.items():
            out[key] = _merged(base[key], value) if key in base else value
        return out
    return update


def convert(data: Any, kind: type[T], *, source: str | None = None) -> T:
    """msgspec conversion with validation, as a ConfigError naming the field."""
    try:
        return msgspec.convert(data, kind, strict=True)  # "8" for an int is an error
    except msgspec.ValidationError as exc:
        raise _config_error(exc, source, kind) from None
    except ConfigError as exc:  # a __post_init__ check
        if exc.source:
            raise
        raise ConfigError(exc.message, field=exc.field, source=source) from None


def _field_names(kind: Any, path: str) -> tuple[str, ...]:
    """The field names of the struct at dotted ``path`` in struct ``kind`` ("" is ``kind``
    itself; empty if the path does not lead to a struct)."""
    info = _info_at(kind, path) if path else msgspec.inspect.type_info(kind)
    while isinstance(info, msgspec.inspect.UnionType):  # e.g. an optional struct
        structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
        if not structs:
            return ()
        info = structs[0]
    if isinstance(info, msgspec.inspect.StructType):
        return tuple(f.name for f in info.fields)
    return ()


def _choices(kind: Any, path: str) -> tuple[str, ...]:
    """The allowed values of the literal field at dotted ``path`` in struct ``kind`` (empty if
    it is not a literal, or the path does not resolve)."""
    info = _info_at(kind, path)
    if isinstance(info, msgspec.inspect.LiteralType):
        return tuple(str(v) for v in info.values)
    return ()


def _tags(kind: Any, path: str) -> tuple[str, ...]:
    """The tags allowed at ``path`` (e.g. ``faults[0].kind``) when it is the tag field of a
    tagged union of structs (in a list or not) in struct ``kind``; empty otherwise."""
    table, _, key = re.sub(r"\[\d+\]", "", path).rpartition(".")
    info: Any = _info_at(kind, table) if table else None
    while isinstance(
        info, msgspec.inspect.ListType | msgspec.inspect.VarTupleType | msgspec.inspect.SetType
    ):
        info = info.item_type
    types = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return tuple(
        str(t.tag)
        for t in types
        if isinstance(t, msgspec.inspect.StructType) and t.tag_field == key and t.tag is not None
    )


def _info_at(kind: Any, path: str) -> Any:
    """The msgspec type info of the field at dotted ``path`` in struct ``kind`` (None if the
    path does not resolve)."""
    info: Any = msgspec.inspect.type_info(kind)
    for name in path.split("."):
        while isinstance(info, msgspec.inspect.UnionType):  # e.g. an optional struct
            structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
            if not structs:
                return None
            info = structs[0]
        if not isinstance(info, msgspec.inspect.StructType):
            return None
        info = next((f.type for f in info.fields if f.name == name), None)
        if info is None:
            return None
    return info


def _config_error(
    exc: msgspec.ValidationError, source: str | None, kind: Any = None
) -> ConfigError:
    match = re.search(r"- at `\$\.?([^`]*)`", str(exc)) or re.search(
        r"unknown field `([^`]*)`", str(exc)
    )
    field = match.group(1) if match else None
    message = str(exc).split(" - at ")[0]
    unknown = re.match(r"Object contains unknown field `([^`]*)`", message)
    if unknown:
        if field != unknown.group(1):  # msgspec names the table: name the key in it
            field = f"{field}.{unknown.group(1)}" if field else unknown.group(1)
        message = "unknown field"
        if kind is not None and field and "[" not in field:
            table, _, key = field.rpartition(".")
            close = difflib.get_close_matches(key, _field_names(kind, table), n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
    if unknown and field in ("prefill", "decode", "probe") and kind is not None:
        names = getattr(kind, "__struct_fields__", ())
        if "prefill" not in names and "decode" not in names:  # a PD file given elsewhere
            message += (
                f" (a [{field}] table makes this a PD deployment file: it is for xds replay "
                "and xds capacity --deployment)"
            )
    if kind is not None and field and message.startswith("Invalid enum value"):
        choices = _choices(kind, field)
        if choices:
            message += f"; one of {', '.join(repr(c) for c in choices)}"
    if kind is not None and field:  # a tagged union's tag (e.g. a fault's kind): its choices
        missing = re.match(r"Object missing required field `([^`]*)`", message)
        tag_path = f"{field}.{missing.group(1)}" if missing else field
        if missing or message.startswith(("Invalid value", "Expected `str`")):
            tags = _tags(kind, tag_path)
            if tags:
                message += f"; one of {', '.join(repr(t) for t in tags)}"
    inner = re.match(r"([A-Za-z_][\w.]*(?:\[\d+\][\w.]*)*): (.*)", message, re.S)
    if field and inner:  # a nested struct's own check named its field: one dotted path
        outer, sub = field.split("."), inner.group(1).split(".")
        if outer[-1] == sub[0]:
            sub = sub[1:]
        field, message = ".".join(outer + sub), inner.group(2)
    elif inner and not field:  # the top-level struct's own check named it
        field, message = inner.group(1), inner.group(2)
    return ConfigError(message, field=field or None, source=source)


class _FieldsChecked(Exception):
    """Raised by the copy :func:`check_fields` validates, once msgspec has checked its fields
    and called its ``__post_init__``: stops the class's own checks from running twice."""


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers (a sweep over ``np.arange`` builds configs too)."""
    return value.item() if isinstance(value, np.generic) else value


def is_integer(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(value: object, field: str, *, low: int = 0, high: int | None = None) -> int:
    """``value`` as a plain int if it is an integer (numpy ones too; not a bool) in
    ``low..high`` (``high`` None: no upper bound); else one ConfigError naming ``field``.
    Floats, ``None`` and strings are refused, never truncated."""
    if is_integer(value):
        v = int(value)  # type: ignore[call-overload]
        if v >= low and (high is None or v <= high):
            return v
    bounds = f">= {low}" if high is None else f"in {low}..{high}"
    raise ConfigError(f"must be an integer {bounds}, got {value!r:.40}", field=field)


def require_positive(value: object, field: str) -> float:
    """``value`` as a float if it is a finite real number > 0 (numpy ones too; not a bool);
    else one ConfigError naming ``field`` (NaN, infinity, zero and strings are refused)."""
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool
    )
    if not number or not 0 < value < math.inf:  # type: ignore[operator]
        raise ConfigError(f"must be a finite number > 0, got {value!r:.40}", field=field)
    return float(value)  # type: ignore[arg-type]


def require_instance(value: object, kind: type, field: str) -> None:
    """One ConfigError naming ``field`` unless ``value`` is a ``kind`` (an API argument of the
    wrong type fails at the call, not as an AttributeError deep inside)."""
    if not isinstance(value, kind):
        name = kind.__name__
        acronym = len(name) > 1 and name[:2].isupper()  # letters said by name: "an MA..."
        article = "an" if name[0] in ("AEFHILMNORSX" if acronym else "AEIO") else "a"
        raise ConfigError(
            f"must be {article} {name}, got {type(value).__name__} {value!r:.40}",
            field=field,
        )


def check_fields(struct: msgspec.Struct) -> None:
    """Validate a config or spec built in Python against its annotations (types and ``Meta``
    bounds), as loading it from TOML or JSON does: call first in ``__post_init__``. Nested
    structs were checked when they were built; a bad value, or a plain dict where a struct
    belongs, raises one ConfigError naming the field."""
    kind = type(struct)
    if _checking.get() is kind:  # the copy being validated below: its fields passed
        raise _FieldsChecked
    token = _checking.set(kind)
    fields = {k: _plain(v) for k, v in msgspec.structs.asdict(struct).items()}
    try:
        msgspec.convert(fields, kind)
    except _FieldsChecked:
        pass
    except msgspec.ValidationError as exc:
        raise _config_error(exc, None, kind) from None
    finally:
        _checking.reset(token)
    for name, expected in _struct_fields(kind).items():
        if isinstance(fields[name], dict):
            raise ConfigError(
                f"expected a {expected.__name__}, got a dict (build it, or load the whole "
                "config with xds.config.load_config)",
                field=name,
            )


@functools.cache
def _struct_fields(kind: type) -> dict[str, type]:
    """The fields of ``kind`` whose type is a Struct, with that type."""
    return {
        f.name: f.type.cls
        for f in msgspec.inspect.type_info(kind).fields  # type: ignore[attr-defined]
        if isinstance(f.type, msgspec.inspect.StructType)
    }


def split_spec(spec: str, kinds: Any) -> tuple[str, dict[str, str]]:
    """A command-line spec ``KIND:KEY=VALUE,...`` (e.g. a ``--fault``) as its kind and its
    fields (strings, stripped). Raises one ConfigError naming ``fault`` for an unknown kind, an
    item without ``=`` or a key given twice; ``kinds`` lists the known kinds."""
    kind, _, rest = spec.partition(":")
    if kind not in kinds:
        raise ConfigError(
            f"{spec!r}: unknown fault kind {kind!r}; known: {', '.join(kinds)}", field="fault"
        )
    fields: dict[str, str] = {}
    items = rest.split(",") if rest.strip() else []
    for item in items:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not item.strip():
            raise ConfigError(f"{spec!r}: an empty item (a stray comma?)", field="fault")
        if not eq or not key:
            raise ConfigError(f"{spec!r}: expected KEY=VALUE, got {item!r}", field="fault")
        if not value:
            raise ConfigError(f"{spec!r}: {key} has no value", field="fault")
        if key in fields:
            raise ConfigError(f"{spec!r}: {key} is given twice", field="fault")
        fields[key] = value
    return kind, fields


_SETTING_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_BARE_WORD = re.compile(r"[\w.+\-/:]+")


def parse_setting(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` as (dotted field path, value): VALUE is a TOML value (``5``, ``0.9``,
    ``true``, ``"x"``, ``[1, 2]``, ``{ k = 1 }``) or a bare word taken as a string
    (``decode.model=qwen3-235b``)."""
    path, eq, raw = text.partition("=")
    path, raw = path.strip(), raw.strip()
    if "\n" in raw:
        raise ConfigError("a setting is one line", source=f"setting {text!r}")
    if not eq or not _SETTING_PATH.fullmatch(path):
        raise ConfigError(
            "a setting is FIELD=VALUE with FIELD a dotted field path (decode.model=kimi-k2, "
            "prefill.tes=5)",
            source=f"setting {text!r}",
        )
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if not _BARE_WORD.fullmatch(raw):
            raise ConfigError(
                f'cannot read {raw!r} as a TOML value (quote a string: {path}="...")',
                source=f"setting {text!r}",
            ) from None
        value = raw
    return path, value


def check_settings(settings: object) -> None:
    """``settings`` is a sequence of ``FIELD=VALUE`` strings (not one bare string, which would
    read as one setting per character); else ConfigError naming ``settings``."""
    if isinstance(settings, str) or not isinstance(settings, Sequence):
        raise ConfigError(
            "settings are a list of FIELD=VALUE strings, got "
            + (
                f"the one string {settings!r} (write [{settings!r}])"
                if isinstance(settings, str)
                else type(settings).__name__
            ),
            field="settings",
        )
    for i, text in enumerate(settings):
        if not isinstance(text, str):
            raise ConfigError(
                f"a setting is a FIELD=VALUE string, got {type(text).__name__}",
                field=f"settings[{i}]",
            )


def apply_settings(config: T, settings: Sequence[str]) -> T:
    """``config`` (a msgspec Struct) with ``FIELD=VALUE`` ``settings`` (:func:`parse_setting`)
    laid over it, later ones over earlier ones, then checked as a file would be: an unknown
    field (with a "did you mean"), a value of the wrong type or a failed check is a
    :class:`ConfigError` naming the setting and the field (or, when a check fails on a field
    no setting wrote, saying so). A setting inside an optional table that is off
    (``decode.eplb`` None) turns the table on with its defaults for the rest."""
    check_settings(settings)
    if not isinstance(config, msgspec.Struct):
        raise ConfigError(
            f"settings apply to a config (a msgspec Struct), got {type(config).__name__}",
            field="config",
        )
    if not settings:
        return config
    data: Any = msgspec.to_builtins(config)
    parsed = [(text, *parse_setting(text)) for text in settings]
    for _, path, value in parsed:
        update: Any = value
        for key in reversed(path.split(".")):
            update = {key: update}
        data = _merged(data, update)
    try:
        return convert(data, type(config))
    except ConfigError as exc:
        raise settings_error(exc, settings) from None


def settings_error(exc: ConfigError, settings: Sequence[str]) -> ConfigError:
    """``exc``, raised by a config built with ``settings``, naming the setting that wrote its
    field (or one inside it, or the value a setting's path runs through), or saying that no
    setting wrote it."""
    field = exc.field or ""
    for text in reversed(settings):
        path = parse_setting(text)[0]
        if field == path or field.startswith((path + ".", path + "[")):
            return ConfigError(exc.message, field=exc.field, source=f"setting {text!r}")
        if path.startswith(field + "."):  # the path runs through this field
            return ConfigError(
                f"{exc.message} (the setting's path runs through {field}, which is not a table)"
                if "got `object`" in exc.message
                else f"{exc.message} (the setting writes inside {field})",
                field=exc.field,
                source=f"setting {text!r}",
            )
    written = ", ".join(repr(text) for text in settings)
    return ConfigError(
        f"{exc.message} (no setting writes this field: with the settings {written}, the "
        "deployment's own value fails; set it too)",
        field=exc.field,
    )
