"""The block hash chain (semantics doc 4.2).

vLLM hashes ``(parent, tokens, extra_keys)`` with sha256 over a pickle. Only
equality of hashes matters to the scheduler, so any collision-free function of
the same inputs makes the same decisions. We use a 128-bit BLAKE2b.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from hashlib import blake2b, sha256

NONE_HASH = bytes(16)

# A prompt of embeddings keys every block with the sha256 of its rows of them
# (KU:598-622). A block past the prompt has no rows: vLLM hashes an empty slice.
EMPTY_EMBEDS = sha256(b"").hexdigest()


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """A prompt given as embeddings, as far as a block's key depends on it: the
    sha256 of each block's rows of them, and, for a prompt that mixes them with
    token ids, the runs [start, end) of positions given as token ids."""

    digests: tuple[str, ...]
    token_runs: tuple[tuple[int, int], ...] = ()

    def key(self, i: int, block_size: int) -> tuple:
        """Block ``i``'s part of the key. Where the block has positions given as
        token ids, they are part of it: the same ids and rows, read as token ids
        at other positions, are other inputs. vLLM 0.32 leaves them out and
        serves one block's KV for the other (upstream issue 56655); this keys
        them as its fix does (upstream PR 56656)."""
        digest = self.digests[i] if i < len(self.digests) else EMPTY_EMBEDS
        start, end = i * block_size, (i + 1) * block_size
        runs = tuple((max(s, start) - start, min(e, end) - start)
                     for s, e in self.token_runs if s < end and e > start)
        if runs:
            return ("prompt_embeds", digest, ("prompt_is_token_ids", runs))
        return ("prompt_embeds", digest)


def hash_block(parent: bytes, tokens: list[int], extra_keys: tuple | None = None) -> bytes:
    h = blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        cache_salt: str | None, embeds: PromptEmbeds | None = None,
                        lora: tuple | None = None, lookahead: int = 0) -> None:
    """Append the hash of every newly full block of ``token_ids`` to ``hashes``.
    A block's extra keys, in vLLM's order (KU:625-663): the request's LoRA
    adapter (``lora``: its name and path), the cache salt on the first block,
    the prompt's embeddings. With ``lookahead`` (vLLM 0.33's lookahead block
    hashes, for EAGLE: KU:953-1036), a block's hash also covers that many
    tokens after it, and exists only once they do."""
    for i in range(len(hashes), (len(token_ids) - lookahead) // block_size):
        parent = hashes[-1] if hashes else NONE_HASH
        extra: tuple | None = ("cache_salt", cache_salt) if (i == 0 and cache_salt) else None
        if embeds is not None or lora is not None:
            extra = (lora, extra, None if embeds is None else embeds.key(i, block_size))
        if lookahead:
            end = (i + 1) * block_size
            extra = (extra, tuple(token_ids[end:end + lookahead]))
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
