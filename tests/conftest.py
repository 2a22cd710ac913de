"""Shared test configuration."""

from hypothesis import settings

settings.register_profile("xds", deadline=None, max_examples=50)
settings.load_profile("xds")
