"""Named deployments of the paper (ARCHITECTURE.md "Configuration").

``peak-decode`` is SPEC 12.2's colocated DP288/EP288 run; ``ma-peak-decode`` SPEC 12.3's
MoE-attention disaggregated one (for ``xds ma-decode``); ``production-4p1d`` is SPEC 12.4's
PD-disaggregated deployment (for ``xds replay``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ..config import in_file, load_config
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


def _lookup(name_or_path: str, presets: dict[str, T], kind: type[T], what: str) -> T:
    if name_or_path in presets:
        return presets[name_or_path]
    if Path(name_or_path).suffix.lower() in (".toml", ".json"):
        return load_config(name_or_path, kind)
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


def decode_config(name_or_path: str) -> DecodeConfig:
    """A preset by name, or a ``.toml``/``.json`` file of :class:`DecodeConfig` fields, checked
    before anything runs: its fixed batch fits a die's KV, and its EPLB policy exists (both
    errors name the file)."""
    from .decode import check_batch_fits
    from .eplb.policies import policy

    config = _lookup(name_or_path, PRESETS, DecodeConfig, "deployment")
    source = None if name_or_path in PRESETS else name_or_path
    try:
        check_batch_fits(config)
        if config.eplb is not None:
            try:
                policy(config.eplb.policy)
            except ConfigError as exc:
                raise ConfigError(exc.message, field="eplb.policy") from None
    except ConfigError as exc:
        if source is None:
            raise
        raise in_file(exc, source) from None
    return config


def ma_config(name_or_path: str) -> MADecodeConfig:
    """A MoE-attention disaggregated preset by name, or a ``.toml``/``.json`` file of
    :class:`~xds.serve.ma_config.MADecodeConfig` fields."""
    return _lookup(name_or_path, MA_PRESETS, MADecodeConfig, "MA deployment")


def pd_config(name_or_path: str, **overrides: Any) -> PDConfig:
    """A PD preset by name, or a ``.toml``/``.json`` file of :class:`PDConfig` fields, with
    ``overrides`` replacing top-level fields (e.g. ``kv_transfer="xccl"``)."""
    config = _lookup(name_or_path, PD_PRESETS, PDConfig, "PD deployment")
    if not overrides:
        return config
    fields = PDConfig.__struct_fields__
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"PDConfig has no field {key!r}{hint}", field=key)
    return msgspec.structs.replace(config, **overrides)
