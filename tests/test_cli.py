"""The xds command line."""

from __future__ import annotations

import subprocess
import sys

from xds import __version__
from xds.cli.main import main


def test_version(capsys):
    assert main(["version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_info_prints_the_pod(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "768 dies" in out and "36,864" in out and "UB link" in out


def test_info_sources_keeps_bracketed_grades(capsys):
    assert main(["info", "--sources", "--servers", "2"]) == 0
    out = capsys.readouterr().out
    assert "[emulator choice]" in out and "CANN" in out


def test_demo_runs_in_virtual_time(capsys):
    assert main(["demo", "--servers", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "32 die tasks x 3 steps" in out and "virtual time" in out


def test_bad_arguments_give_one_line_and_exit_2(capsys):
    for argv in (
        ["bogus"],
        ["info", "--servers", "0"],
        ["demo", "--backend", "uv"],
        ["info", "--nope"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("xds: error: ") and err.count("\n") == 1, err


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "xds.cli.main", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in out.stdout and "info" in out.stdout
