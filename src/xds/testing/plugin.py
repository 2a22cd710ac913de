"""pytest plugin: run ``async def`` tests in xds virtual time.

Mark a coroutine test with ``@pytest.mark.xds`` (optionally ``seed=``, ``backend=``) and it runs
under :func:`xds.run`: ``anyio.sleep(3600)`` takes no wall time, and the same seed gives the same
run. A test that takes the ``xds_backend`` fixture runs once per backend (asyncio and trio)::

    @pytest.mark.xds(seed=7)
    async def test_barrier(xds_backend):
        ...

The plugin is registered through the ``pytest11`` entry point when xds is installed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest

from xds.runtime import BACKENDS, Runtime


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "xds(seed=0, backend='asyncio', event_log=True): run this async test in xds virtual time",
    )


@pytest.fixture(params=BACKENDS)
def xds_backend(request: pytest.FixtureRequest) -> str:
    """Parametrises a test over xds's backends (asyncio, trio)."""
    return str(request.param)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("xds")
    if marker is None or not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    options: dict[str, Any] = dict(marker.kwargs)
    funcargs = pyfuncitem.funcargs
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: funcargs[name] for name in argnames}
    backend = options.pop("backend", None) or funcargs.get("xds_backend", "asyncio")
    runtime = Runtime(backend=backend, **options)
    runtime.run(functools.partial(pyfuncitem.obj, **kwargs))
    return True
