"""Shared test configuration."""

import gc
import os
import warnings

import pytest
from hypothesis import settings

settings.register_profile("xds", deadline=None, max_examples=50)
settings.load_profile("xds")

os.environ.pop("COLUMNS", None)  # the CLI's tables are 120 columns wide when not a terminal


@pytest.fixture
def streams_left_open():
    """``streams_left_open(run)``: the memory object streams that ``run()`` left open, by the
    ``ResourceWarning`` anyio gives when it collects one (a component should close its
    streams when its run ends)."""

    def check(run) -> list[str]:
        gc.collect()  # what earlier tests left for the collector is not this run's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            run()
            gc.collect()
        return [
            str(w.message)
            for w in caught
            if issubclass(w.category, ResourceWarning) and "MemoryObject" in str(w.message)
        ]

    return check
