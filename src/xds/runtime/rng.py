"""Named, seeded random streams (ARCHITECTURE.md, "Determinism").

All randomness in a run comes from ``numpy.random.Generator`` streams derived from one
``SeedSequence``. A stream is keyed by its *name* (a stable hash of it, not the order in which
streams are created), so adding a component with its own stream never shifts another
component's numbers.
"""

from __future__ import annotations

import hashlib
import numbers

import numpy as np


def _name_key(name: str) -> tuple[int, ...]:
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))


class RngStreams:
    """The run's random streams: ``streams("gating/layer3")`` returns a Generator.

    Asking twice for the same name returns the same (stateful) Generator.
    """

    def __init__(self, seed: int):
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
            from xds.errors import ConfigError

            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}", field="seed")
        seed = int(seed)  # numpy integers too
        self.seed = seed
        self._root = np.random.SeedSequence(seed)
        self._streams: dict[str, np.random.Generator] = {}
        self._uniforms: dict[str, UniformDraws] = {}

    def seed_sequence(self, name: str) -> np.random.SeedSequence:
        """The SeedSequence behind stream ``name`` (spawn children from it for sub-streams)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"stream name must be a non-empty string, got {name!r}")
        return np.random.SeedSequence(self._root.entropy, spawn_key=_name_key(name))

    def __call__(self, name: str) -> np.random.Generator:
        gen = self._streams.get(name)
        if gen is None:
            gen = np.random.Generator(np.random.PCG64(self.seed_sequence(name)))
            self._streams[name] = gen
        return gen

    def uniforms(self, name: str) -> UniformDraws:
        """Stream ``name``'s uniform draws, read ahead in blocks (:class:`UniformDraws`; one
        reader per name, so whoever asks next goes on where the last one stopped). A stream
        read this way must be read only this way: its Generator runs ahead of the draws taken."""
        draws = self._uniforms.get(name)
        if draws is None:
            draws = self._uniforms[name] = UniformDraws(self(name))
        return draws

    def names(self) -> list[str]:
        """Names of the streams used so far, sorted."""
        return sorted(self._streams)


class UniformDraws:
    """Uniform [0, 1) doubles of one Generator, read ahead ``block`` at a time: :meth:`take`
    gives what ``generator.random(n)`` would have (a Generator draws its doubles one after
    another, however many each call asks for), at one numpy call per block rather than per
    take (a decode iteration takes a few hundred)."""

    def __init__(self, generator: np.random.Generator, block: int = 1024):
        self._generator = generator
        self._block = block
        self._ahead: np.ndarray = np.empty(0)
        self._next = 0
        """Where the next take starts in :attr:`_ahead`."""

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` draws (a read-only view of the read-ahead block)."""
        if self._next + n > len(self._ahead):
            fresh = self._generator.random(max(n, self._block))
            self._ahead = np.concatenate([self._ahead[self._next :], fresh])
            self._ahead.flags.writeable = False  # so are the views taken from it
            self._next = 0
        draws = self._ahead[self._next : self._next + n]
        self._next += n
        return draws
