"""Field notes in ``help()``: a config's fields, defaults and the notes written under them.

xds documents each field of a config or record with a string right below it (an attribute
docstring). Python keeps those only in the source, so ``help(DecodeConfig)`` would show none of
them. :func:`document_fields` appends a "Fields" section to a class's docstring, built from its
source: each field's type, default and note.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import typing
from typing import Any

import msgspec


@functools.cache
def _class_defs(module: str) -> dict[str, ast.ClassDef]:
    """The top-level classes of ``module``'s source, parsed once per module."""
    try:
        source = inspect.getsource(sys.modules[module])
    except (OSError, TypeError, KeyError):  # no source (frozen app): help() shows the docstring
        return {}
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def _notes(cls: type) -> dict[str, str]:
    """Field name -> the string written right below it in ``cls``'s body."""
    body = _class_defs(cls.__module__).get(cls.__name__)
    if body is None:
        return {}
    notes = {}
    for stmt, nxt in zip(body.body, [*body.body[1:], None], strict=True):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            notes[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return notes


def _default(field: Any) -> str:
    if field.default is not msgspec.NODEFAULT:
        text = repr(field.default)
    elif field.default_factory is not msgspec.NODEFAULT:
        text = f"{field.default_factory.__name__}()"
    else:
        return "required"
    return text if len(text) <= 60 else text[:57] + "..."


def _type(tp: Any) -> tuple[str, str]:
    """(how ``tp`` reads, the description in its ``Annotated`` metadata if any)."""
    description = ""
    if typing.get_origin(tp) is typing.Annotated:
        tp, *meta = typing.get_args(tp)
        for m in meta:
            description = getattr(m, "description", None) or description
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    for noise in ("typing.", "xds.", "collections.abc."):
        text = text.replace(noise, "")
    return text, description


def document_fields(*classes: type) -> None:
    """Append a "Fields" section (type, default, note) to each msgspec Struct's docstring."""
    for cls in classes:
        notes = _notes(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        lines = []
        for field in msgspec.structs.fields(cls):
            kind, description = _type(hints.get(field.name, field.type))
            lines.append(f"{field.name}: {kind} = {_default(field)}")
            note = notes.get(field.name) or description
            if note:
                lines += ["    " + line for line in note.splitlines()]
        doc = inspect.cleandoc(cls.__doc__ or "")
        cls.__doc__ = f"{doc}\n\nFields:\n\n" + "\n".join(lines) if lines else doc
