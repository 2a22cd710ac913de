"""How many xds runs are on in the current thread.

Patches that change a library's behaviour only during runs (ordered cancel scopes, refused
worker threads) ask this; a run nested through a helper thread counts in that thread only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RunDepth(threading.local):
    """A per-thread count of the runs entered and not yet left."""

    depth = 0

    @property
    def on(self) -> bool:
        """Whether a run is on in this thread."""
        return self.depth > 0

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Count one more run while the block runs."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
