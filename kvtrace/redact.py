"""Redaction: replace every token id in a trace with a keyed pseudonym.

Traces hold users' prompts as token ids. A redacted trace keeps everything the
scheduler depends on and nothing of the text:

* The pseudonym of a token id is a keyed permutation of the id space
  ``0 .. 2^40`` (the ids a trace may hold): a Feistel network with 8 rounds whose
  round function is HMAC-SHA256 under the key, cycle-walked into the range.
  Equal ids get equal pseudonyms and different ids different ones, so prefix
  sharing, block hashes, stop tokens and the shadow-KV fingerprints replay as
  before, with zero divergences on a clean trace.
* Every field that holds token ids is mapped: ``prompt_token_ids``,
  ``eos_token_id`` and ``stop_token_ids`` of arrivals, and ``sampled`` of
  outputs. Nothing else in the format holds token ids.
* A prompt of embeddings' block digests (``prompt_embeds``) are replaced by
  their HMAC-SHA256 under the same key: equal digests stay equal, and a digest
  can no longer be checked against the embeddings of a guessed text.
* The KV audit's block hashes and byte digests (``kv_audit`` records) are
  replaced by their HMAC-SHA256 under the key, cut to the same width: the
  engine's hash of a block of tokens, under a fixed hash seed, and the digest
  of the KV bytes the model computed for it would confirm a guessed prompt.
  Equal values stay equal, which is all the data-path checks (D1-D3) compare.
* Pseudonyms spread over 2^40 values, so one lands inside a real vocabulary
  (at most a few hundred thousand ids) with probability below 2^-20: the
  redacted file shows no original id sequence.
* The key is random (``os.urandom(32)``) unless one is given, and it is never
  written to the output. Without it the mapping cannot be inverted or
  recomputed. Give the same key to redact several traces consistently (for
  ``kvtrace diff``).

Connectors' ``kv_transfer_params`` keep only what pairs the two sides of a
disaggregated deployment (``HANDOFF_KEYS``): hosts, ports and engine ids go.

Not redacted: request ids, ``cache_salt``, LoRA adapters' names and paths,
the header's ``meta``. These come
from the engine and the recorder, not from the prompt text; ``meta`` is
replaced by a note that the trace was redacted, plus the original engine and
recorder names.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from kvtrace.writing import writing
from kvtrace.trace import TraceReader, TraceWriter
from kvtrace.trace import events as ev

DOMAIN_MAX = ev.MAX_COUNT          # token ids are ints in 0 .. 2^40
_HALF = 21                         # 42-bit Feistel network, cycle-walked into 0 .. 2^40
_MASK = (1 << _HALF) - 1
_ROUNDS = 8
KEY_BYTES = 32
# meta keys kept from the original header: what produced the trace, not what it was fed.
_KEEP_META = ("recorder", "workload", "fault", "seed")


class Redactor:
    """A keyed permutation of token ids, memoised per distinct id."""

    def __init__(self, key: bytes | None = None):
        if key is None:
            key = os.urandom(KEY_BYTES)
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise ValueError("a redaction key must be at least 16 bytes")
        self._key = bytes(key)
        self._memo: dict[int, int] = {}

    def token(self, t: int) -> int:
        p = self._memo.get(t)
        if p is None:
            if not 0 <= t <= DOMAIN_MAX:
                raise ValueError(f"token id {t} is outside 0..2^40")
            p = self._feistel(t)
            while p > DOMAIN_MAX:          # cycle walking keeps it a permutation of 0..2^40
                p = self._feistel(p)
            self._memo[t] = p
        return p

    def tokens(self, ts: list[int]) -> list[int]:
        return [self.token(t) for t in ts]

    @property
    def distinct(self) -> int:
        return len(self._memo)

    def _feistel(self, x: int) -> int:
        left, right = x >> _HALF, x & _MASK
        key = self._key
        for i in range(_ROUNDS):
            mac = hmac.digest(key, bytes((i,)) + right.to_bytes(3, "big"), "sha256")
            left, right = right, left ^ (int.from_bytes(mac[:3], "big") & _MASK)
        return (left << _HALF) | right

    def block_hash(self, h: str) -> str:
        """A KV audit's block hash, keyed, as many hex digits long ("" stays "")."""
        if not h:
            return h
        mac = hmac.digest(self._key, b"kv_audit block hash\0" + h.encode(), "sha256")
        return mac.hex()[:len(h)]

    def bytes_digest(self, d: int) -> int:
        """A KV audit's 64-bit digest of a block's bytes, keyed."""
        mac = hmac.digest(self._key, b"kv_audit bytes\0" + d.to_bytes(8, "big", signed=True),
                          "sha256")
        return int.from_bytes(mac[:8], "big", signed=True)

    # -- events ------------------------------------------------------------------

    def event(self, e):
        """The event with its token ids replaced (the object is changed in place)."""
        if isinstance(e, ev.Arrival):
            e.prompt_token_ids = self.tokens(e.prompt_token_ids)
            e.stop_token_ids = self.tokens(e.stop_token_ids)
            if e.eos_token_id is not None:
                e.eos_token_id = self.token(e.eos_token_id)
            if e.prompt_embeds is not None:
                e.prompt_embeds = [hmac.digest(self._key, bytes.fromhex(d), "sha256").hex()
                                   for d in e.prompt_embeds]
            e.kv_transfer_params = handoff_only(e.kv_transfer_params)
        elif isinstance(e, ev.Output):
            e.sampled = {req: self.tokens(ts) for req, ts in e.sampled.items()}
        elif isinstance(e, ev.Drafts):
            e.drafts = {req: self.tokens(ts) for req, ts in e.drafts.items()}
        elif isinstance(e, ev.RequestFinished):
            e.kv_transfer_params = handoff_only(e.kv_transfer_params)
        elif isinstance(e, ev.KVAudit):
            e.loaded = [(req, block, self.block_hash(h), self.bytes_digest(before),
                         self.bytes_digest(after), asked, by_connector)
                        for req, block, h, before, after, asked, by_connector in e.loaded]
            for name in ("saved", "cached", "hits"):
                setattr(e, name, [(req, block, self.block_hash(h), self.bytes_digest(d))
                                  for req, block, h, d in getattr(e, name)])
        elif isinstance(e, ev.Step) and e.spec:
            # A padding draft (-1) is no token id, and stays as it is.
            e.spec = {req: [t if t < 0 else self.token(t) for t in ts] for req, ts in e.spec.items()}
        return e


# The kv_transfer_params keys a redacted trace keeps: what pairs the two sides
# of a disaggregated deployment and what they hand over (``kvtrace diff``).
# Hosts, ports and engine ids are dropped.
HANDOFF_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_request_id", "remote_block_ids",
                "remote_num_tokens", "transfer_mode")


def handoff_only(params: dict | None) -> dict | None:
    if params is None:
        return None
    return {k: params[k] for k in HANDOFF_KEYS if k in params}


@dataclass
class RedactSummary:
    src: str
    dst: str
    events: int = 0
    arrivals: int = 0
    tokens: int = 0              # token ids replaced
    distinct_tokens: int = 0
    truncation: str | None = None
    keyframes_left_out: int = 0   # keyframes hold token ids in their state

    def __str__(self) -> str:
        s = (f"redacted {self.src} -> {self.dst}: {self.events} events, {self.arrivals} requests, "
             f"{self.tokens} token ids ({self.distinct_tokens} distinct) replaced")
        if self.keyframes_left_out:
            s += (f"; {self.keyframes_left_out} keyframes left out (add them again with "
                  "'kvtrace keyframes')")
        if self.truncation:
            s += f"; the input stops early ({self.truncation}), and so does the copy"
        return s


def redact_file(src: str | os.PathLike, dst: str | os.PathLike, key: bytes | None = None
                ) -> RedactSummary:
    """Write a redacted copy of trace ``src`` to ``dst`` (mode 0600, compression from
    the name). ``key`` None draws a random key, which is not kept anywhere.
    Raises TraceError for unusable input. A trace that was cut off is copied up to
    its cut, without an ``end`` record, so that the copy reads as cut off too."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("redact into a new file, not over the input")
    red = Redactor(key)
    summary = RedactSummary(str(src), str(dst))
    with TraceReader(src) as reader:
        h = reader.header
        meta = {k: h.meta[k] for k in _KEEP_META if k in h.meta}
        meta["redacted"] = "token ids replaced by keyed pseudonyms (HMAC-SHA256 Feistel)"
        header = ev.Header(engine=h.engine, engine_version=h.engine_version, config=h.config,
                           counters=h.counters, features=h.features, meta=meta)
        with writing(dst, trace=True) as out:   # a failure leaves dst as it was
            writer = TraceWriter(dst, header, fd=out.take_fd())
            summary.truncation = _copy(reader, writer, red, summary)
    summary.distinct_tokens = red.distinct
    return summary


def _copy(reader: TraceReader, writer: TraceWriter, red: "Redactor", summary: "RedactSummary"
          ) -> str | None:
    """Every event of ``reader``, redacted, into ``writer``, which this closes."""
    end = None
    try:
        for e in reader:
            summary.events += 1
            if isinstance(e, ev.Arrival):
                summary.arrivals += 1
                summary.tokens += len(e.prompt_token_ids) + len(e.stop_token_ids) + (
                    e.eos_token_id is not None)
            elif isinstance(e, ev.Output):
                summary.tokens += sum(len(ts) for ts in e.sampled.values())
            elif isinstance(e, ev.Drafts):
                summary.tokens += sum(len(ts) for ts in e.drafts.values())
            elif isinstance(e, ev.Step) and e.spec:
                summary.tokens += sum(t >= 0 for ts in e.spec.values() for t in ts)
            if isinstance(e, ev.End):
                end = e
                continue
            if isinstance(e, ev.Keyframe):   # its state holds token ids: left out
                summary.keyframes_left_out += 1
                continue
            writer.write(red.event(e))
    except BaseException:
        writer.finish(None)
        raise
    writer.finish(end)
    return reader.truncation
