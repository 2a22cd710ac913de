"""Checks on the files a run writes after it ends (``--plot``, ``--timeline``): a long run
must not end in a failed save, so the path is checked before the run starts."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError


def check_output_path(
    path: str | Path,
    suffixes: Sequence[str],
    *,
    field: str,
    what: str,
    folder_made_later: bool = False,
) -> Path:
    """``path`` as a Path a writer can use: one of ``suffixes`` (lower case, e.g. ``".png"``
    or ``".json.gz"``), in an existing folder, not a directory, and writable (tried by creating
    and removing a probe file there); else ConfigError naming ``field``. ``what`` says what is
    written, for the message ("a plot"). ``folder_made_later``: the folder is one the run
    creates before writing (``--out``), checked on its own: only the suffix is checked here."""
    p = Path(path)
    name = p.name.lower()
    if not any(name.endswith(s) and len(name) > len(s) for s in suffixes):
        got = "".join(p.suffixes[-2:]) if p.suffixes else ""
        raise ConfigError(
            f"{what} is written as {', '.join(suffixes)} (by the file's suffix), got "
            f"{got or 'no suffix'!r}",
            field=field,
        )
    if folder_made_later:
        return p
    folder = p.absolute().parent
    if not folder.is_dir():
        raise ConfigError(f"folder {folder} does not exist", field=field)
    if p.exists() and not p.is_file():
        raise ConfigError("exists and is not a file", field=field)
    try:
        fd, probe = tempfile.mkstemp(prefix=".xds-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"cannot write in {folder} ({exc.strerror or exc})", field=field
        ) from None
    return p
