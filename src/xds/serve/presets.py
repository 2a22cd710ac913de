"""Named deployments of the paper (ARCHITECTURE.md "Configuration").

``peak-decode`` is SPEC 12.2's colocated DP288/EP288 run; more presets (``production-4p1d``,
``peak-decode-ma``) arrive with their deployments.
"""

from __future__ import annotations

from pathlib import Path

from ..config import load_config
from ..errors import ConfigError
from .decode import DecodeConfig

PRESETS: dict[str, DecodeConfig] = {
    "peak-decode": DecodeConfig(),
}


def decode_config(name_or_path: str) -> DecodeConfig:
    """A preset by name, or a ``.toml``/``.json`` file of :class:`DecodeConfig` fields."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).suffix in (".toml", ".json"):
        return load_config(name_or_path, DecodeConfig)
    raise ConfigError(
        f"unknown deployment {name_or_path!r}: a preset "
        f"({', '.join(PRESETS)}) or a .toml/.json file",
        field="deployment",
    )
