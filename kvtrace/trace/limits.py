"""How long a line of a trace may be, from its header: what bounds the memory
a reader takes for one record.

Decoding a record costs a multiple of its bytes: about 2 for a list of
requests' states, 9 for a list of token ids (``1000,``), 26 for a list of
empty lists, 50 for a free-form value of empty objects
(docs/reference/bad-input.md, "Safety of the read path"). So the reader holds
each line to what its header allows a record of its kind to hold, and refuses
a longer one before decoding it:

* an ``arrival``: a prompt of ``max_model_len`` token ids, its digests and
  runs when it is given as embeddings, and ``FREE_ROOM`` for the rest (the
  request id, stop tokens, ``kv_transfer_params``);
* ``request_finished``, ``prompt_stats``, ``reset_prefix_cache``,
  ``pause_state``, ``end``: ``FREE_ROOM``;
* any other record (a step, an output, an abort, a KV audit): ``max_num_seqs``
  requests' block tables of every KV-cache group, four times over (scheduled
  and their states), a KV audit of every block eight times, and
  ``GENERAL_ROOM`` for the rest (ids, requests finished or aborted at once);
* a ``keyframe``: the cap (it holds every live request's tokens, waiting
  ones too, which no header bounds);
* the header: ``HEADER_BYTES``.

Each is at most ``KVTRACE_MAX_LINE_BYTES`` (256 MiB unless set); set, it
replaces them all. A line is read into memory only up to the limit of any
record (``general``), or a keyframe's when it says its kind first (as
kvtrace's writers write it); a line longer than ``SMALL`` is held to its kind's
limit, as soon as it passes it when it says its kind first, else once it is
whole (a decode that builds nothing finds it).
"""

from __future__ import annotations

import re

import msgspec

from .events import Header

SMALL = 1 << 20          # lines up to this long are decoded without a look at their kind
HEADER_BYTES = 1 << 20   # a header is a few kilobytes
FREE_ROOM = 1 << 20      # ids, stop tokens, free-form values in one record
GENERAL_ROOM = 16 << 20  # ids and lists of requests no header bounds, in one record
ID_BYTES = 10            # "16777215,": a block id at the format's bound, with its comma
TOKEN_BYTES = 32         # a token id up to 2^40 and its comma, or a run [start, end] per token
DIGEST_BYTES = 68        # '"<64 hex digits>",'
REQUEST_BYTES = 512      # a scheduled request's or a state's fields, besides its block ids
AUDIT_ENTRY_BYTES = 128  # a KV audit's entry for one block


class _Kind(msgspec.Struct):
    kind: str = ""


_KIND = msgspec.json.Decoder(_Kind)   # skips every other field without building it
_LEADING_KIND = re.compile(rb'\s*\{\s*"kind"\s*:\s*"([a-z_]{1,32})"')


def kind_of(raw: bytes) -> str | None:
    """A record's kind, read without building the rest of it; None when the
    line does not say (not JSON, not an object, no kind)."""
    try:
        return _KIND.decode(raw).kind or None
    except Exception:
        return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LineLimits:
    """The longest line of each kind a trace with ``header`` may hold, at most
    ``cap`` (``explicit``: the user set the cap, which then applies to all)."""

    def __init__(self, header: Header, cap: int, explicit: bool = False):
        self.cap, self.explicit = cap, explicit
        cfg, f = header.config, header.features
        groups = list(f.kv_cache_groups or ())
        n_groups = max(len(groups), f.num_kv_cache_groups or 0, 1)
        min_block = min([g.block_size for g in groups] + [cfg.block_size])
        hash_block = f.hash_block_size or cfg.block_size
        mml = cfg.max_model_len
        # A request's table in one group: its tokens' blocks, null blocks of a
        # sliding window included, and, for an engine with a bug, the pool.
        table = _cdiv(mml, min_block) + cfg.num_blocks
        arrival = FREE_ROOM + TOKEN_BYTES * mml + DIGEST_BYTES * _cdiv(mml, hash_block)
        general = (GENERAL_ROOM + 4 * cfg.max_num_seqs * (REQUEST_BYTES + n_groups * table * ID_BYTES)
                   + 8 * n_groups * cfg.num_blocks * AUDIT_ENTRY_BYTES)
        self.general = cap if explicit else min(cap, general)
        small = self.general if explicit else min(self.general, FREE_ROOM)
        self.by_kind = {"arrival": self.general if explicit else min(self.general, arrival),
                        "request_finished": small, "prompt_stats": small,
                        "reset_prefix_cache": small, "pause_state": small, "end": small,
                        # every live request's tokens: no header bound but the cap
                        "keyframe": cap}
        self.why = (f"max_model_len {mml}, num_blocks {cfg.num_blocks}, max_num_seqs "
                    f"{cfg.max_num_seqs}, {n_groups} KV-cache group{'s' if n_groups > 1 else ''}")

    def check(self, raw: bytes) -> str | None:
        """The problem of a whole line longer than its kind allows, or None."""
        if len(raw) <= SMALL:
            return None
        return self.too_long(kind_of(raw), len(raw))

    def leading_kind(self, start: bytes) -> str:
        """The kind of a line still being read, when it says it first (as
        kvtrace's writers write every record but the vLLM recorder's steps and
        outputs), else "" (not known until the line is whole)."""
        m = _LEADING_KIND.match(start)
        return m.group(1).decode() if m else ""

    def too_long(self, kind: str | None, n: int) -> str | None:
        """The problem of ``n`` bytes of a line of ``kind``, or None."""
        limit = self.by_kind.get(kind) if kind else None
        if limit is None or n <= limit:
            return None
        what = "an arrival" if kind == "arrival" else f"a {kind} record"
        return (f"{what} longer than {limit:,} bytes, more than a record of its kind can hold "
                f"under this trace's header ({self.why}); refused before it is decoded (set "
                f"KVTRACE_MAX_LINE_BYTES to allow longer records)")
