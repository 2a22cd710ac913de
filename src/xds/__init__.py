"""xds: an emulator of xDeepServe on the CloudMatrix384 SuperPod, in virtual time.

Quick start::

    import anyio, xds

    async def main():
        await xds.sleep_ns(5 * xds.units.US)
        return xds.now_ns()

    assert xds.run(main, seed=0) == 5_000
"""

from . import errors, hw, units
from .runtime import (
    Runtime,
    current_runtime,
    emit,
    now_ns,
    rng,
    run,
    sleep_ns,
    sleep_until_ns,
    waiting_for,
)

__version__ = "0.1.0"

__all__ = [
    "Runtime",
    "__version__",
    "current_runtime",
    "emit",
    "errors",
    "hw",
    "now_ns",
    "rng",
    "run",
    "sleep_ns",
    "sleep_until_ns",
    "units",
    "waiting_for",
]
