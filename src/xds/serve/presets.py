"""Named deployments of the paper (ARCHITECTURE.md "Configuration").

``peak-decode`` is SPEC 12.2's colocated DP288/EP288 run; ``ma-peak-decode`` SPEC 12.3's
MoE-attention disaggregated one (for ``xds ma-decode``); ``production-4p1d`` is SPEC 12.4's
PD-disaggregated deployment (for ``xds replay``).

Every loader takes a preset name or a file, optionally followed by ``@FIELD=VALUE`` settings
(``production-4p1d@prefill.tes=5@decode.batch_per_die=48``), and ``settings`` laid over it
before those (:func:`xds.config.apply_settings`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ..config import apply_settings, check_settings, in_file, load_config, settings_error
from ..errors import ConfigError
from .decode import DecodeConfig
from .ma_config import MADecodeConfig
from .replay import PDConfig

T = TypeVar("T")

PRESETS: dict[str, DecodeConfig] = {
    "peak-decode": DecodeConfig(),
}

PD_PRESETS: dict[str, PDConfig] = {
    "production-4p1d": PDConfig(),
}
"""SPEC 12.4: 16 servers; 4 Prefill TEs of 2 servers (DP8/EP32, TP4); 1 Decode TE of 8 servers
(DP128/EP128)."""


MA_PRESETS: dict[str, MADecodeConfig] = {
    "ma-peak-decode": MADecodeConfig(),
}
"""SPEC 12.3: 3 domains x 160 attention dies + 288 expert dies on the whole pod."""


def split_settings(name_or_path: str, presets: dict[str, Any]) -> tuple[str, list[str]]:
    """``NAME@FIELD=VALUE@...`` as (NAME, its settings); a preset's name or an existing
    file's path is taken whole, ``@`` and all."""
    if name_or_path in presets or "@" not in name_or_path or _exists(name_or_path):
        return name_or_path, []
    parts = name_or_path.split("@")
    for i in range(len(parts) - 1, 0, -1):  # the longest preset or file before an @
        base = "@".join(parts[:i])
        if base in presets or _exists(base):
            return base, parts[i:]
    # none exists: settings are the trailing parts that read FIELD=VALUE (a missing file's
    # name may hold an @ too, and is then named whole)
    first = len(parts)
    while first > 1 and ("=" in parts[first - 1] or not parts[first - 1]):
        first -= 1
    return "@".join(parts[:first]), parts[first:]


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name too long to be a file's, say
        return False


def with_settings(name_or_path: str, settings: Sequence[str], presets: dict[str, Any]) -> str:
    """``name_or_path`` with ``settings`` written into it, before its own ``@`` settings: how
    a deployment loaded with both is named (``production-4p1d@prefill.tes=5``). For display:
    load with the loaders' ``settings`` argument (a value may hold an ``@``)."""
    if not settings:
        return name_or_path
    name, inline = split_settings(name_or_path, presets)
    return "@".join([name, *settings, *inline])


def _lookup(
    name_or_path: str,
    presets: dict[str, T],
    kind: type[T],
    what: str,
    settings: Sequence[str] = (),
) -> T:
    """The preset or file ``name_or_path`` names, with ``settings`` then its own ``@``
    settings laid over it."""
    check_settings(settings)
    name, inline = split_settings(name_or_path, presets)
    base = _named(name, presets, kind, what)
    try:
        return apply_settings(base, [*settings, *inline])
    except ConfigError as exc:  # no setting wrote the field: the file's value fails with them
        if exc.source is None and name not in presets:
            raise in_file(exc, name) from None
        raise


def _named(name_or_path: str, presets: dict[str, T], kind: type[T], what: str) -> T:
    if name_or_path in presets:
        return presets[name_or_path]
    if Path(name_or_path).suffix.lower() in (".toml", ".json"):
        try:
            return load_config(name_or_path, kind)
        except ConfigError as exc:
            if "unknown field" not in exc.message or "PD deployment file" in exc.message:
                raise  # (a [prefill] or [decode] table already says whose file it is)
            _other_command(exc, name_or_path, kind)
            raise
    close = difflib.get_close_matches(name_or_path, list(presets), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    for command, kind_presets in (
        ("decode", PRESETS),
        ("ma-decode", MA_PRESETS),
        ("replay", PD_PRESETS),
    ):
        if presets is not kind_presets and name_or_path in kind_presets:
            hint = f" (it is an `xds {command}` deployment)"
    raise ConfigError(
        f"unknown {what} {name_or_path!r}{hint}: a preset ({', '.join(presets)}) or a "
        ".toml/.json file",
        field="deployment",
    )


def _other_command(exc: ConfigError, path: str, kind: type) -> None:
    """If the file ``path``, refused as a ``kind`` for an unknown field (``exc``), reads as
    another command's deployment, raise ``exc`` saying so."""
    for command, other in (
        ("decode", DecodeConfig),
        ("ma-decode", MADecodeConfig),
        ("replay", PDConfig),
    ):
        if other is kind:
            continue
        try:
            load_config(path, other)
        except ConfigError:
            continue
        raise ConfigError(
            f"{exc.message}; the file reads as an `xds {command}` deployment",
            field=exc.field,
            source=exc.source,
        ) from None


def decode_config(name_or_path: str, settings: Sequence[str] = ()) -> DecodeConfig:
    """A preset by name, or a ``.toml``/``.json`` file of :class:`DecodeConfig` fields (and
    settings, see the module), checked before anything runs: its fixed batch fits a die's KV,
    and its EPLB policy exists (both errors name the file, when no setting is in play)."""
    from .decode import check_batch_fits
    from .eplb.policies import policy

    check_settings(settings)
    name, inline = split_settings(name_or_path, PRESETS)
    every = [*settings, *inline]
    config = apply_settings(_named(name, PRESETS, DecodeConfig, "deployment"), every)
    try:
        check_batch_fits(config)
        if config.eplb is not None:
            try:
                policy(config.eplb.policy)
            except ConfigError as exc:
                raise ConfigError(exc.message, field="eplb.policy") from None
    except ConfigError as exc:
        if every:  # a setting wrote the field, or none did (and the deployment's value
            exc = settings_error(exc, every)  # fails with the settings: the note says so)
            if exc.source is not None:
                raise exc from None
        if name in PRESETS:
            raise exc from None
        raise in_file(exc, name) from None
    return config


def ma_config(name_or_path: str, settings: Sequence[str] = ()) -> MADecodeConfig:
    """A MoE-attention disaggregated preset by name, or a ``.toml``/``.json`` file of
    :class:`~xds.serve.ma_config.MADecodeConfig` fields (and settings, see the module)."""
    return _lookup(name_or_path, MA_PRESETS, MADecodeConfig, "MA deployment", settings)


def pd_config(name_or_path: str, settings: Sequence[str] = (), **overrides: Any) -> PDConfig:
    """A PD preset by name, or a ``.toml``/``.json`` file of :class:`PDConfig` fields (and
    settings, see the module: ``pd_config("production-4p1d", ["prefill.tes=5"])``), with
    ``overrides`` replacing top-level fields (e.g. ``kv_transfer="xccl"``)."""
    config = _lookup(name_or_path, PD_PRESETS, PDConfig, "PD deployment", settings)
    if not overrides:
        return config
    fields = PDConfig.__struct_fields__
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"PDConfig has no field {key!r}{hint}", field=key)
    return msgspec.structs.replace(config, **overrides)
