"""Shadow KV cache: an independent model of what every KV slot holds.

Counters can all agree while the KV data is wrong. The shadow cache keeps one
64-bit fingerprint per (block, slot) of the engine's KV cache, in a torch tensor
on the replay device, and at every step checks that each slot a scheduled
request's attention reads holds the fingerprint of that request's own token
prefix. A mismatch is a ``Divergence`` of kind ``kv-content``.

Step semantics, in this order:

1. loads: an external load of positions [start, end) of a request writes, into
   the slots its block table names, the fingerprints of the request's own prefix
   (the external store is assumed to hold the request's own prefix);
2. write: positions [c, c + n) of each scheduled request (clipped to the tokens
   the request is known to have) get their fingerprints. In the engine every
   layer writes the step's KV before its attention reads, so a request may read
   what another writes in the same step (a prefix hit on a block allocated
   earlier in the same schedule());
3. check: for every scheduled request, every position p < num_computed_tokens
   (taken before the step) is read through its block table, and the slot must
   hold the fingerprint of the request's prefix ending at p.

Every written slot also records its writer: the request (an index into an
interned table of request ids), the step, the writer's position and whether it
was a load. That is what a divergence reports when a slot holds something else.

Fingerprints
------------
For a request with tokens t_0, t_1, ... the fingerprint of the prefix ending at
position i is

    fp(i) = 1 + sum_{j <= i} term(t_j, j)      (mod 2^64, stored as int64)

    term(t, j) = mix64(t * K_TOK + mix64(j + K_POS)) with its lowest bit cleared

where mix64 is the splitmix64 finaliser (xor-shift-multiply, a bijection of
64-bit words), computed with int64 tensor ops: logical right shifts are
arithmetic shifts masked to the low 64 - s bits, and products and the cumsum
wrap modulo 2^64. Every term is even, so every fingerprint is odd; a slot that
was never written holds 0, which no fingerprint equals. "Never written" is
therefore detected exactly, with no probability involved. A request's
fingerprints are kept on the device and extended incrementally as tokens are
appended (a segmented cumsum over all pending tokens of all requests at once).

Collision bound
---------------
Assumption: mix64 behaves as a uniformly random function of (token, position)
(so each term is a uniformly random even 64-bit word, independent across
distinct (token, position) pairs). This is a modelling assumption about a
fixed, public, non-cryptographic mixer; it is not a proof, and it does not hold
against inputs chosen to collide (the fingerprint is linear in the terms, so
collisions can be constructed deliberately). It is the usual assumption for
content fingerprints of data not crafted against the hash.

Under it, take two prefixes that differ: different tokens, or different end
positions (a slot holding the right tokens at the wrong position counts as
different). Each prefix uses each position once, so there is a (token,
position) pair that appears in one sum and not in the other; its term is
uniform over the 2^63 even words and independent of the rest, so

    P[fp(prefix A) == fp(prefix B)] = 2^-63.

A replay that checks N slot reads, of which any number are wrong, misses a
wrong slot (accepts it as correct) with probability at most N * 2^-63 by the
union bound. For scale: 10^12 checked slots give at most about 1.1e-7. Slots
that were never written are always caught. Within one (token, position) the map
token -> term is injective up to the cleared low bit (two tokens can share a
term only if they differ in the mixer's output lowest bit alone, which the
random-function model already counts).

Performance
-----------
The check is one batched gather-and-compare per step over all scheduled
requests: the block tables' read prefixes are concatenated into one index
tensor, the slot fingerprints are gathered a block row at a time from the
(num_blocks, block_size) tensor, the expected fingerprints a block row at a time
from a block-aligned per-request arena, and the two are compared with a mask for
the tail of each request's last block. Python loops run over requests (and over
list concatenation of block ids), never over tokens.
"""

from __future__ import annotations

from array import array

import torch

from kvtrace.findings import Divergence

__all__ = ["ShadowKV", "mix64", "token_terms", "prefix_fingerprints", "pick_device", "RULE"]

RULE = "kv-content: every slot a request's attention reads holds that request's own prefix"

_MASK64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)
K_TOK = _s64(0x9E3779B97F4A7C15)   # odd: t -> t * K_TOK is a bijection mod 2^64
K_POS = _s64(0xD1B54A32D192ED03)
FP_INIT = 1                        # fp of the empty prefix; keeps every fingerprint odd


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words: arithmetic shift, then clear the copied sign bits."""
    return torch.bitwise_and(torch.bitwise_right_shift(x, s), (1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (bit-for-bit the unsigned version mod 2^64)."""
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def token_terms(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """term(t, j) for each (token, position): an even int64 word."""
    return torch.bitwise_and(mix64(tokens * K_TOK + mix64(positions + K_POS)), -2)


def prefix_fingerprints(token_ids, start: int = 0, prev: int = FP_INIT,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Fingerprints of the prefixes ending at positions start, start+1, ... of a
    token sequence whose fingerprint before ``start`` is ``prev``."""
    tok = torch.as_tensor(token_ids, dtype=torch.int64, device=device)
    pos = torch.arange(start, start + tok.numel(), dtype=torch.int64, device=tok.device)
    return torch.cumsum(token_terms(tok, pos), 0) + _s64(prev)


def pick_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" → cuda when torch sees a CUDA device, else cpu. "cuda" without CUDA is an error."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device '{name}' was asked for, but torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA: {torch.version.cuda or 'no'}); use --device cpu or auto")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {name!r}: expected auto, cpu or cuda")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    """A Python int list as an int64 tensor on ``device`` (through a C array: several
    times faster than torch.tensor on long lists)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    t = torch.frombuffer(array("q", values), dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device)


class _Req:
    __slots__ = ("idx", "row", "rows", "n_fp", "pending", "ntok", "trow", "table")

    def __init__(self, idx: int, trow: int):
        self.idx = idx          # index into ShadowKV.ids
        self.row = 0            # first arena row of this request's fingerprints
        self.rows = 0           # arena rows reserved
        self.n_fp = 0           # fingerprints already in the arena
        self.pending: list[int] = []  # tokens whose fingerprints are not computed yet
        self.ntok = 0           # n_fp + len(pending)
        self.trow = trow        # row of the device block-table matrix
        self.table: list[int] = []    # the block table as last copied to the device


class ShadowKV:
    """The shadow cache. See the module docstring for the step semantics.

    Public tensors (on ``device``), all shaped (num_blocks, block_size):
    ``fp`` (int64 fingerprint, 0 = never written), ``writer_req`` (int32 index
    into ``ids``, -1 = never written), ``writer_step``, ``writer_pos`` (int32) and
    ``writer_loaded`` (bool: the slot was last written by an external load).
    """

    def __init__(self, num_blocks: int, block_size: int, device: str = "auto"):
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.device = pick_device(device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        dev, B = self.device, block_size
        # One extra block at the end absorbs reads and writes through out-of-range
        # block ids; such reads are reported, such writes land nowhere visible.
        n = (num_blocks + 1) * B
        self._fp = torch.zeros(n, dtype=torch.int64, device=dev)
        self._wreq = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._wstep = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._wpos = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._wload = torch.zeros(n, dtype=torch.bool, device=dev)
        self.ids: list[str] = []                 # interned request ids
        self._intern: dict[str, int] = {}
        self._reqs: dict[str, _Req] = {}
        self._pending: dict[str, _Req] = {}      # requests with tokens awaiting fingerprints
        self._arena = torch.zeros((64, B), dtype=torch.int64, device=dev)
        self._top = 0                            # next free arena row
        # Block tables of live requests, one row each, updated only where they change.
        self._tmat = torch.zeros((64, 64), dtype=torch.int64, device=dev)
        self._tfree: list[int] = list(range(63, -1, -1))
        # Counters, for reports and benchmarks.
        self.slots_checked = 0
        self.slots_written = 0
        self.slots_loaded = 0

    # -- views ---------------------------------------------------------------------

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t[: self.num_blocks * self.block_size].view(self.num_blocks, self.block_size)

    @property
    def fp(self) -> torch.Tensor:
        return self._view(self._fp)

    @property
    def writer_req(self) -> torch.Tensor:
        return self._view(self._wreq)

    @property
    def writer_step(self) -> torch.Tensor:
        return self._view(self._wstep)

    @property
    def writer_pos(self) -> torch.Tensor:
        return self._view(self._wpos)

    @property
    def writer_loaded(self) -> torch.Tensor:
        return self._view(self._wload)

    # -- requests ------------------------------------------------------------------

    def add_request(self, req: str, prompt_token_ids: list[int]) -> None:
        if req in self._reqs:
            raise ValueError(f"request '{req}' is already in the shadow cache")
        idx = self._intern.get(req)
        if idx is None:
            idx = self._intern[req] = len(self.ids)
            self.ids.append(req)
        if not self._tfree:
            rows, cols = self._tmat.shape
            grown = torch.zeros((2 * rows, cols), dtype=torch.int64, device=self.device)
            grown[:rows] = self._tmat
            self._tmat = grown
            self._tfree = list(range(2 * rows - 1, rows - 1, -1))
        r = self._reqs[req] = _Req(idx, self._tfree.pop())
        if prompt_token_ids:
            r.pending = list(prompt_token_ids)
            r.ntok = len(r.pending)
            self._pending[req] = r

    def append_tokens(self, req: str, token_ids: list[int]) -> None:
        r = self._req(req)
        if token_ids:
            r.pending.extend(token_ids)
            r.ntok += len(token_ids)
            self._pending[req] = r

    def drop_request(self, req: str) -> None:
        r = self._reqs.pop(req, None)
        self._pending.pop(req, None)
        if r is not None:
            self._tfree.append(r.trow)

    def __contains__(self, req: str) -> bool:
        """Whether ``req`` is live in the shadow cache (added and not dropped)."""
        return req in self._reqs

    def num_tokens(self, req: str) -> int:
        return self._req(req).ntok

    def prefix_fingerprints(self, req: str) -> torch.Tensor:
        """The request's prefix fingerprints, position 0 onwards (a copy)."""
        self._materialise()
        r = self._req(req)
        return self._arena.view(-1)[r.row * self.block_size: r.row * self.block_size + r.n_fp].clone()

    def _req(self, req: str) -> _Req:
        r = self._reqs.get(req)
        if r is None:
            raise KeyError(f"request '{req}' is not in the shadow cache (never added, or dropped)")
        return r

    def _sync_table(self, r: _Req, table: list[int]) -> None:
        """Bring the request's device block-table row up to ``table``; usually a no-op."""
        old = r.table
        if table == old:
            return
        n, k = len(table), len(old)
        if n > self._tmat.shape[1]:
            rows, cols = self._tmat.shape
            grown = torch.zeros((rows, max(n, 2 * cols)), dtype=torch.int64, device=self.device)
            grown[:, :cols] = self._tmat
            self._tmat = grown
        if k < n and table[:k] == old:          # the table grew: copy the new tail only
            self._tmat[r.trow, k:n] = _i64(table[k:], self.device)
        else:
            self._tmat[r.trow, :n] = _i64(table, self.device)
        r.table = list(table)

    # -- arena: block-aligned per-request fingerprint segments ------------------------

    def _rows_for(self, ntok: int) -> int:
        return _cdiv(ntok + ntok // 2 + self.block_size, self.block_size)

    def _alloc(self, rows: int) -> int:
        if self._top + rows > self._arena.shape[0]:
            self._compact(rows)
        row = self._top
        self._top += rows
        return row

    def _compact(self, extra: int) -> None:
        """Move live segments to the front of a (possibly larger) arena."""
        B = self.block_size
        live = sum(r.rows for r in self._reqs.values())
        cap = max(64, 2 * (live + extra))
        old, new = self._arena, torch.zeros((cap, B), dtype=torch.int64, device=self.device)
        top = 0
        for r in self._reqs.values():
            used = min(_cdiv(r.n_fp, B), r.rows)
            if used:
                new[top: top + used] = old[r.row: r.row + used]
            r.row = top
            top += r.rows
        self._arena, self._top = new, top

    def _ensure(self, r: _Req, ntok: int) -> None:
        if ntok <= r.rows * self.block_size:
            return
        used = _cdiv(r.n_fp, self.block_size)
        rows = self._rows_for(ntok)
        r.rows = 0  # the old segment is dead; a compaction inside _alloc must not keep it
        old = self._arena[r.row: r.row + used].clone() if used else None
        row = self._alloc(rows)
        if used:
            self._arena[row: row + used] = old
        r.row, r.rows = row, rows

    def _materialise(self) -> None:
        """Compute the fingerprints of every pending token of every request, in one batch."""
        if not self._pending:
            return
        pend = list(self._pending.values())
        self._pending.clear()
        for r in pend:                      # first reserve (may move segments) ...
            self._ensure(r, r.ntok)
        B, dev = self.block_size, self.device
        toks: list[int] = []
        meta: list[int] = []                # per request: first, start position, arena offset
        total = 0
        for r in pend:                      # ... then read the final offsets
            k = len(r.pending)
            toks.extend(r.pending)
            meta += (total, r.n_fp, r.row * B + r.n_fp)
            total += k
            r.n_fp += k
            r.pending = []
        first, start, dest = _i64(meta, dev).view(-1, 3).unbind(1)
        i64 = dict(dtype=torch.int64, device=dev)
        lens = torch.diff(first, append=torch.tensor([total], **i64))
        seg = torch.repeat_interleave(torch.arange(len(pend), **i64), lens, output_size=total)
        local = torch.arange(total, **i64) - first[seg]
        cs = torch.cumsum(token_terms(_i64(toks, dev), start[seg] + local), 0)
        before = torch.where(first > 0, cs[(first - 1).clamp(min=0)], 0)
        arena = self._arena.view(-1)
        prev = torch.where(start > 0, arena[(dest - 1).clamp(min=0)], FP_INIT)
        arena[dest[seg] + local] = cs - before[seg] + prev[seg]

    # -- the step ------------------------------------------------------------------

    def step(self, step: int,
             loads: list[tuple[str, int, int, list[int]]],
             scheduled: list[tuple[str, int, int, list[int]]],
             ) -> list[Divergence]:
        self._materialise()
        if loads:
            self.slots_loaded += self._write(step, loads, loaded=True)
        # Within one forward pass every layer writes the step's KV before attention
        # reads it, so a request may read what another request writes in the same step
        # (a prefix hit on a block allocated earlier in the same schedule(), 4.3).
        writes = [(req, c, c + n, table) for req, c, n, table in scheduled if n > 0]
        if writes:
            self.slots_written += self._write(step, writes, loaded=False)
        return self._check(step, scheduled)

    def _write(self, step: int, items, loaded: bool) -> int:
        """Write the fingerprints of positions [start, end) of each item's request
        into the slots its block table names. Returns the number of slots written."""
        B, dev = self.block_size, self.device
        meta: list[int] = []                # per item: first, start, table row, arena offset, request
        total = 0
        for req, start, end, table in items:
            r = self._req(req)
            start = max(start, 0)
            end = min(end, r.ntok, len(table) * B)
            if end <= start:
                continue
            self._sync_table(r, table)
            meta += (total, start, r.trow, r.row * B, r.idx)
            total += end - start
        if not total:
            return 0
        i64 = dict(dtype=torch.int64, device=dev)
        first, start, trow, abase, who = _i64(meta, dev).view(-1, 5).unbind(1)
        lens = torch.diff(first, append=torch.tensor([total], **i64))
        seg = torch.repeat_interleave(torch.arange(first.numel(), **i64), lens, output_size=total)
        pos = start[seg] + torch.arange(total, **i64) - first[seg]
        cols = self._tmat.shape[1]
        blk = self._tmat.view(-1).index_select(0, trow[seg] * cols + pos // B)
        blk = torch.where((blk < 0) | (blk >= self.num_blocks), self.num_blocks, blk)
        slot = blk * B + pos % B
        val = self._arena.view(-1).index_select(0, abase[seg] + pos)
        who = who[seg]
        # Two writes to one slot in one step: keep the last, so that the fingerprint
        # and the writer of a slot always come from the same write.
        uniq, inv = torch.unique(slot, return_inverse=True)
        if uniq.numel() != total:
            last = torch.zeros(uniq.numel(), **i64).scatter_reduce(
                0, inv, torch.arange(total, **i64), "amax", include_self=False)
            slot, val, who, pos = uniq, val[last], who[last], pos[last]
        self._fp.index_copy_(0, slot, val)
        self._wreq.index_copy_(0, slot, who.to(torch.int32))
        self._wstep.index_fill_(0, slot, step)
        self._wpos.index_copy_(0, slot, pos.to(torch.int32))
        self._wload.index_fill_(0, slot, loaded)
        return total

    def _check(self, step: int, scheduled) -> list[Divergence]:
        B, dev = self.block_size, self.device
        divs: list[Divergence] = []
        meta: list[int] = []                # per request: first row, table row, limit, arena row
        reqs: list[str] = []
        nrows = checked = 0
        for req, c, _n, table in scheduled:
            r = self._req(req)
            lim = c
            if lim > r.ntok:
                divs.append(Divergence(
                    step, req, "kv-content",
                    f"position {r.ntok}: the request has only {r.ntok} tokens, but "
                    f"{c} count as computed", f"prefix of {req} up to position {c - 1}", RULE,
                    "kv-content"))
                lim = r.ntok
            if lim > len(table) * B:
                divs.append(Divergence(
                    step, req, "kv-content",
                    f"position {len(table) * B}: no block for it (the block table has "
                    f"{len(table)} blocks), but {c} positions count as computed",
                    f"prefix of {req} up to position {c - 1}", RULE, "kv-content"))
                lim = len(table) * B
            if lim <= 0:
                continue
            self._sync_table(r, table)
            meta += (nrows, r.trow, lim, r.row)
            reqs.append(req)
            nrows += -(-lim // B)
            checked += lim
        if not reqs:
            return divs
        self.slots_checked += checked
        i64 = dict(dtype=torch.int64, device=dev)
        first, trow, lims, arow = _i64(meta, dev).view(-1, 4).unbind(1)
        nbs = torch.diff(first, append=torch.tensor([nrows], **i64))
        rreq = torch.repeat_interleave(torch.arange(len(reqs), **i64), nbs, output_size=nrows)
        bi = torch.arange(nrows, **i64) - first[rreq]
        cols = self._tmat.shape[1]
        blk = self._tmat.view(-1).index_select(0, trow[rreq] * cols + bi)
        oob = (blk < 0) | (blk >= self.num_blocks)
        held = self._fp.view(-1, B).index_select(0, torch.where(oob, self.num_blocks, blk))
        want = self._arena.index_select(0, arow[rreq] + bi)
        rowlim = (lims[rreq] - bi * B).clamp(max=B)
        col = torch.arange(B, **i64)
        bad = ((held != want) | oob[:, None]) & (col[None, :] < rowlim[:, None])
        if not bool(bad.any()):
            return divs
        # Rare path: name the first bad position of each request, and count them all.
        where = bad.view(-1).nonzero().squeeze(1)
        row = where // B
        owner = rreq[row]
        uo, counts = torch.unique_consecutive(owner, return_counts=True)
        first_bad = where[torch.cumsum(counts, 0) - counts]
        frow, fcol = first_bad // B, first_bad % B
        fblk = blk[frow]
        fslot = torch.where(oob[frow], self.num_blocks, fblk) * B + fcol
        info = torch.stack([
            uo, counts, lims[uo], fblk, bi[frow] * B + fcol, fcol,
            self._wreq[fslot].long(), self._wstep[fslot].long(), self._wpos[fslot].long(),
            self._wload[fslot].long(),
        ]).tolist()
        for k, cnt, lim, b, p, s, wr, ws, wp, wl in zip(*info):
            req = reqs[k]
            where_s = f"block {b} slot {s} (position {p})"
            if not 0 <= b < self.num_blocks:
                what = f"block id {b} is outside the cache ({self.num_blocks} blocks)"
            elif wr < 0:
                what = "never written"
            else:
                verb = "loaded for" if wl else "written by"
                what = f"{verb} {self.ids[wr]} at step {ws} (its position {wp})"
            divs.append(Divergence(
                step, req, "kv-content",
                f"{where_s}: {what}; {cnt} of {lim} positions read are wrong",
                f"prefix of {req} up to position {p}", RULE, "kv-content"))
        return divs
