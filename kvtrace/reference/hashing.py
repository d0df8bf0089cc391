"""The block hash chain (semantics doc 4.2).

vLLM hashes ``(parent, tokens, extra_keys)`` with sha256 over a pickle. Only
equality of hashes matters to the scheduler, so any collision-free function of
the same inputs makes the same decisions. We use a 128-bit BLAKE2b.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

NONE_HASH = bytes(16)


def hash_block(parent: bytes, tokens: list[int], extra_keys: tuple | None = None) -> bytes:
    h = blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        cache_salt: str | None) -> None:
    """Append the hash of every newly full block of ``token_ids`` to ``hashes``."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else NONE_HASH
        extra = ("cache_salt", cache_salt) if (i == 0 and cache_salt) else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
