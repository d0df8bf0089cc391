"""Seeded, order-independent pseudo-random numbers.

A value depends only on the seed and on the names passed in, never on how many
values were drawn before, so adding a request to a workload does not change the
tokens another request samples.
"""

from __future__ import annotations

from hashlib import blake2b


def _digest(seed: int, parts: tuple) -> int:
    h = blake2b(repr((seed,) + parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def unit(seed: int, *parts) -> float:
    """A number in [0, 1)."""
    return _digest(seed, parts) / 2.0**64


def below(n: int, seed: int, *parts) -> int:
    """An integer in [0, n)."""
    return _digest(seed, parts) % n
