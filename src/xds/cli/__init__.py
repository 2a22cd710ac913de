"""The ``xds`` command line: thin wrappers over the public API."""
