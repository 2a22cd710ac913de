"""The README's examples and set-up commands stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_examples_run(index, tmp_path, monkeypatch):
    block = _python_blocks()[index]
    if "@pytest.mark.xds" in block:
        pytest.skip("a test example: it runs as part of test_plugin_example below")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"README block {index}", "exec"), {"__name__": "readme"})


def test_readme_opens_with_two_setup_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None
    commands = [line for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == [
        "python3 -m pip install . && python3 -m xds replay",
        "python3 -m pip install -e '.[test]' && python3 -m pytest -q",
    ]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "pip install --quiet -e '.[test]'" in ci and "python -m pytest -q" in ci


@pytest.mark.xds(seed=7)
async def test_plugin_example(xds_backend):
    import xds

    await xds.sleep_ns(1_000)
    assert xds.now_ns() == 1_000
