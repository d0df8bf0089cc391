"""Shadow KV cache: an independent model of what every KV slot holds.

Counters can all agree while the KV data is wrong. The shadow cache keeps one
64-bit fingerprint per (block, slot) of the engine's KV cache, in an array
(NumPy, or torch on the replay device: see "Backends"), and at every step
checks that each slot a scheduled request's attention reads holds the
fingerprint of that request's own token prefix. A mismatch is a
``Divergence`` of kind ``kv-content``.

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

A state group (Mamba, gated delta nets) keeps one recurrent state per block:
the state after some prefix of a request. The shadow cache holds it in the
block's slot 0, as the fingerprint of that prefix (the state after L tokens is
the fingerprint of the prefix ending at position L - 1), so that a state and
KV written into the same block id overwrite each other, as they do in the
engine, where one block id is one page of memory whatever group holds it. A
step's state operations (``queue``'s ``states``) are loads and reads, which
come after the step's loads and before any of its writes (the engine copies
and reads a request's state before its forward pass writes any), and writes,
which come with the step's writes. A state read must find the fingerprint of
the request's own prefix of exactly the length it reads; a slot written since
by anyone else, or with a state of another length, is a divergence naming its
writer. The design and its reasons: docs/design/content-check.md.

Every written slot also records its writer: the request (an index into an
interned table of request ids), the step, the writer's position (-L for the
state after L tokens) and whether it was a load. That is what a divergence
reports when a slot holds something else.

How fingerprints are made and why a collision is unlikely (the bound), how a
batch of steps is evaluated at once, which reads are skipped as already
checked, and the two backends: docs/design/content-check.md.
"""

from __future__ import annotations

from array import array

from kvtrace.findings import Divergence

__all__ = ["ShadowCore", "DeviceUnavailable", "RULE", "Table"]


RULE = "kv-content: every slot a request's attention reads holds that request's own prefix"
STATE_RULE = ("kv-content: every state a request starts from is the state after exactly "
              "its own prefix of that length")
_LATE = object()   # the tag of a batch entry that only writes (queue_late_writes)
_PRE = object()    # the tag of a step's loads and state reads, when it reads states
NULL_BLOCK = 0     # vLLM's null block: the placeholder of a slot that holds nothing

_MASK64 = (1 << 64) - 1


def s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


MIX_C1 = s64(0xBF58476D1CE4E5B9)
MIX_C2 = s64(0x94D049BB133111EB)
K_TOK = s64(0x9E3779B97F4A7C15)   # odd: t -> t * K_TOK is a bijection mod 2^64
K_POS = s64(0xD1B54A32D192ED03)
FP_INIT = 1                        # fp of the empty prefix; keeps every fingerprint odd


class DeviceUnavailable(RuntimeError):
    """A device asked for that this machine does not have: the user's choice, not a bug."""

    exit_code = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


NOT_WRITTEN = 1 << 62


class Table(list):
    """A block table (a list of block ids) that keeps its ids as a C array of
    64-bit integers too, for the batch's tables: appending converts the ids
    appended alone; any other change converts them all again. A request's
    table is read at every step, and converting each Python int is most of
    what reading it costs. (A change made by calling ``list``'s own methods
    on it, ``list.__setitem__(t, ...)`` or ``heapq``, is not seen: none is.)"""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids=()) -> None:
        super().__init__(ids)
        self._ids = array("q")
        self._n = 0           # the leading ids of the list that _ids holds

    def ids(self) -> array:
        """The ids, as a C array (kept: not to be changed)."""
        if self._n != len(self):
            if self._n > len(self):
                self._changed()
            self._ids.fromlist(self[self._n:])
            self._n = len(self)
        return self._ids

    def _changed(self) -> None:
        self._ids, self._n = array("q"), 0

    def __reduce__(self):   # a copy converts its ids again: it shares no array
        return Table, (list(self),)


def _changes(name: str):
    def changed(self, *args, **kwargs):
        self._changed()
        return getattr(list, name)(self, *args, **kwargs)
    changed.__name__ = name
    return changed


for _name in ("__setitem__", "__delitem__", "__imul__", "insert", "pop", "remove", "clear",
              "sort", "reverse"):
    setattr(Table, _name, _changes(_name))


class _Req:
    __slots__ = ("idx", "row", "rows", "n_fp", "pending", "ntok", "most", "window", "verified")

    def __init__(self, idx: int):
        self.idx = idx          # index into ShadowKV.ids
        self.row = 0            # first arena row of this request's fingerprints
        self.rows = 0           # arena rows reserved
        self.n_fp = 0           # fingerprints already in the arena
        self.pending: list[int] = []  # tokens whose fingerprints are not computed yet
        self.ntok = 0           # n_fp + len(pending)
        self.most = 0           # the most tokens it can reach, if known (a hint)
        self.window = 0         # its attention's sliding window (0: full attention)
        # Block ids of its leading full block rows that hold its prefix and that
        # nothing has written since they were checked ("Reads already checked").
        self.verified: list[int] = []


class Batch:
    """Steps queued for one evaluation, as flat lists of integers (one entry per
    request and step, never per token)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, object, list[Divergence]]] = []  # step, tag, divergences
        self.tables = array("q")        # every item's block table, concatenated
        self.writes: list[int] = []      # per write: first, length, start, table offset,
        #                                   arena offset, request, step slot, step, loaded,
        #                                   what the writer's position is recorded as, less
        #                                   the position (0; a state's: -L - 0)
        self.n_writes = 0                # positions written
        self.reads: list[int] = []       # per read: rows, table offset, limit, arena offset
        #                                   (flat) of its first row, step slot, leading
        #                                   rows already checked, first position read (a
        #                                   sliding window)
        self.read_reqs: list[_Req] = []
        self.read_states: dict[int, tuple[int, int]] = {}   # read -> (length, table slot)
        self.n_rows = 0                  # block rows read
        self.n_compared = 0              # of which not already checked

    def table(self, ids: list[int]) -> int:
        off = len(self.tables)
        if type(ids) is Table:
            self.tables += ids.ids()
        elif type(ids) is list:
            self.tables.fromlist(ids)
        else:
            self.tables.extend(ids)
        return off



class ShadowCore:
    """The shadow cache, less its array operations: each backend's subclass
    (``torch_backend.ShadowKV``, ``numpy_backend.NumpyShadowKV``) has them. See
    the module docstring for the step semantics.

    Public arrays (on ``device``), all shaped (num_blocks, block_size):
    ``fp`` (int64 fingerprint, 0 = never written), ``writer_req`` (int32 index
    into ``ids``, -1 = never written), ``writer_step``, ``writer_pos`` (int32;
    -L for the state after L tokens) and
    ``writer_loaded`` (bool: the slot was last written by an external load).
    They hold the state after the last evaluated step (see ``queue``).
    """

    # A batch is evaluated when it holds this many steps, or this many slots read
    # (its arrays a few MiB: bench/shadow_kv.py's full-cache check ran fastest at
    # 2^18 and 2^19 of 2^16 to 2^19). A step that reads more is evaluated on its own.
    BATCH_STEPS = 64
    BATCH_SLOTS = 1 << 18

    def __init__(self, num_blocks: int, block_size: int, skip_checked: bool = True):
        """``skip_checked=False`` compares every slot of every read, even the rows
        already checked and not written since (see "Reads already checked"): the
        same divergences, for measuring the comparison itself."""
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One extra block at the end absorbs reads and writes through out-of-range
        # block ids; such reads are reported, such writes land nowhere visible.
        # Per slot: _fp (int64), _wreq, _wstep, _wpos (int32, -1), _wload (bool),
        # and, while a batch is evaluated, _first: the first step slot of the
        # batch that writes it (int64, NOT_WRITTEN otherwise). And the arena.
        self._setup((num_blocks + 1) * block_size)
        self.ids: list[str] = []                 # interned request ids
        self._intern: dict[str, int] = {}
        self._reqs: dict[str, _Req] = {}
        # Requests with tokens awaiting fingerprints and room for them in the
        # arena (keyed by the request object: a dropped request stays here while
        # queued steps may read its tokens). A request gets room when a step
        # first uses it, so the waiting queue is neither here nor in _placed:
        # the cost of a batch stays that of the requests it uses ("Performance").
        self._pending: dict[_Req, None] = {}
        self._placed: dict[_Req, None] = {}     # live requests with arena rows
        self._top = 0                            # next free arena row
        self._batch = Batch()
        self._ready: list[tuple[object, list[Divergence]]] = []
        # Per block id: the requests with it among their checked rows, each with
        # the first such row (a write to the block unchecks them from there).
        self.skip_checked = skip_checked
        self._holders: dict[int, dict[_Req, int]] = {}
        # Counters, for reports and benchmarks.
        self.slots_checked = 0          # slot reads checked, by comparison or unchanged since
        self.states_checked = 0         # state reads checked (each compared)
        self.slots_compared = 0         # of which compared (the rest: unchanged since)
        self.slots_written = 0
        self.slots_loaded = 0
        self.states_written = 0
        self.states_loaded = 0

    # -- what each backend provides ---------------------------------------------------

    def _setup(self, n: int) -> None:
        """The per-slot arrays for ``n`` slots, and an arena of 64 rows."""
        raise NotImplementedError

    def _ints(self, values: list[int]):
        """A Python int list as a 1-d int64 array on the device."""
        raise NotImplementedError

    def _zeros(self, rows: int):
        """An arena of ``rows`` rows of zeros."""
        raise NotImplementedError

    def _copy(self, a):
        raise NotImplementedError

    def _fingerprint(self, toks: list[int], meta: list[int], total: int) -> None:
        """Write into the arena the fingerprints of ``toks``: segments given by
        ``meta`` (per segment: first index in toks, start position, arena offset)."""
        raise NotImplementedError

    # _write_log, _apply, _compare and _first_bad: see ShadowKV's (torch_backend.py).

    # -- views ---------------------------------------------------------------------

    def _view(self, t):
        return t[: self.num_blocks * self.block_size].reshape(self.num_blocks, self.block_size)

    @property
    def fp(self):
        return self._view(self._fp)

    @property
    def writer_req(self):
        return self._view(self._wreq)

    @property
    def writer_step(self):
        return self._view(self._wstep)

    @property
    def writer_pos(self):
        return self._view(self._wpos)

    @property
    def writer_loaded(self):
        return self._view(self._wload)

    # -- requests ------------------------------------------------------------------

    def add_request(self, req: str, prompt_token_ids: list[int], most: int = 0,
                    window: int = 0) -> None:
        """``most``: the most tokens the request can reach (prompt plus
        max_tokens), if known. It only sizes the room the request's fingerprints
        get in the arena, so that a request rarely has to move as it grows.
        ``window``: its attention's sliding window, if any: a step that computes
        from position c reads only positions c - window + 1 and on (the slots
        before are never read, and the engine gives their blocks back)."""
        if req in self._reqs:
            raise ValueError(f"request '{req}' is already in the shadow cache")
        idx = self._intern.get(req)
        if idx is None:
            idx = self._intern[req] = len(self.ids)
            self.ids.append(req)
        r = self._reqs[req] = _Req(idx)
        r.most = most
        r.window = window
        if prompt_token_ids:
            r.pending = list(prompt_token_ids)
            r.ntok = len(r.pending)

    def append_tokens(self, req: str, token_ids: list[int]) -> None:
        r = self._req(req)
        if token_ids:
            r.pending.extend(token_ids)
            r.ntok += len(token_ids)
            self._note_pending(r)

    def _note_pending(self, r: _Req) -> None:
        """Have the request's pending tokens fingerprinted with the next batch, if
        its arena segment has room for any; else ``_ensure`` does it on making room."""
        if r.pending and r.n_fp < r.rows * self.block_size:
            self._pending[r] = None

    def truncate(self, req: str, ntok: int) -> None:
        """Keep only the request's first ``ntok`` tokens (a streaming-input
        session's next turn rewrites what follows them). The steps queued so far
        are evaluated first: they may read the tokens that go."""
        r = self._req(req)
        if ntok >= r.ntok:
            return
        self._evaluate()
        if ntok <= r.n_fp:
            r.n_fp, r.pending = ntok, []
            self._pending.pop(r, None)
        else:
            del r.pending[ntok - r.n_fp:]
            self._note_pending(r)
        r.ntok = ntok
        self._uncheck(r, ntok // self.block_size)

    def drop_request(self, req: str) -> None:
        # Its arena rows, and its pending tokens, stay until the queued steps are
        # evaluated: they may still read them.
        r = self._reqs.pop(req, None)
        if r is not None:
            self._placed.pop(r, None)
            self._uncheck(r)
            if not self._batch.steps:
                self._pending.pop(r, None)

    def __contains__(self, req: str) -> bool:
        """Whether ``req`` is live in the shadow cache (added and not dropped)."""
        return req in self._reqs

    def num_tokens(self, req: str) -> int:
        return self._req(req).ntok

    def prefix_fingerprints(self, req: str):
        """The request's prefix fingerprints, position 0 onwards (a copy)."""
        r = self._req(req)
        self._ensure(r, r.ntok)
        self._materialise()
        at = r.row * self.block_size
        return self._copy(self._arena.reshape(-1)[at: at + r.n_fp])

    def _req(self, req: str) -> _Req:
        r = self._reqs.get(req)
        if r is None:
            raise KeyError(f"request '{req}' is not in the shadow cache (never added, or dropped)")
        return r

    # -- arena: block-aligned per-request fingerprint segments ------------------------

    def _rows_for(self, ntok: int, most: int = 0) -> int:
        """Rows for ``ntok`` fingerprints and room to grow: half as many again, or
        up to the most the request can reach, if that is known and not far off
        (at most twice ``ntok`` and 1024 more)."""
        room = max(ntok + ntok // 2 + self.block_size, min(most, 2 * ntok + 1024))
        return _cdiv(room, self.block_size)

    def _alloc(self, rows: int) -> int:
        # One row to spare past the last segment: a read's expected row may start
        # inside a segment's last row (a state's, see _queue_states).
        if self._top + rows + 1 > self._arena.shape[0]:
            self._compact(rows)
        row = self._top
        self._top += rows
        return row

    def _compact(self, extra: int) -> None:
        """Move live segments to the front of a (possibly larger) arena. Queued
        steps hold arena offsets: they are evaluated first."""
        self._evaluate()
        B = self.block_size
        live = sum(r.rows for r in self._placed)
        cap = max(64, 4 * (live + extra))   # room to spare: each compaction ends a batch
        old, new = self._arena, self._zeros(cap)
        top = 0
        for r in self._placed:
            used = min(_cdiv(r.n_fp, B), r.rows)
            if used:
                new[top: top + used] = old[r.row: r.row + used]
            r.row = top
            top += r.rows
        self._arena, self._top = new, top

    def _ensure(self, r: _Req, ntok: int) -> None:
        """Room in the arena for ``ntok`` of the request's fingerprints. A segment
        that moves leaves its old rows as they are, for the queued steps that read
        them, with every pending token that fits there computed first."""
        if ntok <= r.rows * self.block_size:
            return
        if r.pending and r.n_fp < r.rows * self.block_size:
            self._materialise([r])
        used = _cdiv(r.n_fp, self.block_size)
        rows = self._rows_for(ntok, r.most)
        r.rows = 0  # the old segment is dead; a compaction inside _alloc must not keep it
        old = self._copy(self._arena[r.row: r.row + used]) if used else None
        row = self._alloc(rows)
        if used:
            self._arena[row: row + used] = old
        r.row, r.rows = row, rows
        self._placed[r] = None
        self._note_pending(r)

    def _materialise(self, reqs: list[_Req] | None = None) -> None:
        """Compute the fingerprints of the pending tokens of ``reqs`` (default: those
        in ``_pending``), in one batch, as far as each request's arena segment
        reaches; what does not fit stays pending until ``_ensure`` makes room."""
        pend = list(self._pending) if reqs is None else reqs
        if not pend:
            return
        B = self.block_size
        toks: list[int] = []
        meta: list[int] = []                # per request: first, start position, arena offset
        total = 0
        for r in pend:
            self._pending.pop(r, None)      # done, or out of room
            k = min(len(r.pending), r.rows * B - r.n_fp)
            if k <= 0:
                continue
            toks += r.pending[:k]
            meta += (total, r.n_fp, r.row * B + r.n_fp)
            total += k
            r.n_fp += k
            del r.pending[:k]
        if total:
            self._fingerprint(toks, meta, total)

    # -- the step ------------------------------------------------------------------

    def step(self, step: int,
             loads: list[tuple[str, int, int, list[int]]],
             scheduled: list[tuple[str, int, int, list[int]]],
             states: list[tuple[str, str, int, list[int], int]] = (),
             ) -> list[Divergence]:
        """Check one step at once: ``queue`` it, then ``flush``."""
        ready = self.queue(step, loads, scheduled, states=states) + self.flush()
        return [d for _, divs in ready for d in divs]

    def queue(self, step: int,
              loads: list[tuple[str, int, int, list[int]]],
              scheduled: list[tuple[str, int, int, list[int]]],
              tag: object = None,
              states: list[tuple[str, str, int, list[int], int]] = (),
              ) -> list[tuple[object, list[Divergence]]]:
        """Add one step to the batch: ``loads`` as (request, start, end, block table),
        ``scheduled`` as (request, num_computed_tokens, num_scheduled_tokens, block
        table), ``states`` as (what, request, length, block table, table slot): what
        "load" (a connector loads the state after ``length`` tokens into the block
        the table names at that slot), "read" (the step starts from that state, read
        from there) or "write" (the step writes it there). Returns the steps
        evaluated meanwhile, as (tag, divergences) in step order; the rest come out
        of a later ``queue`` or ``flush``.

        Steps are evaluated together (see "Performance" in the module docstring), so
        that the per-operation cost of torch is paid once per batch, not per step."""
        # Room first: making room may move segments and evaluate the batch, which
        # must happen before this step takes any arena offset.
        loads = [(self._room(req), start, end, table) for req, start, end, table in loads]
        scheduled = [(self._room(req), c, n, table) for req, c, n, table in scheduled]
        states = [(what, self._room(req), n, table, i) for what, req, n, table, i in states]
        if self._batch.n_rows * self.block_size + sum(c for _, c, _, _ in scheduled) > self.BATCH_SLOTS:
            self._evaluate()                # a heavy step goes on its own
        b = self._batch
        divs: list[Divergence] = []
        reads_states = any(op[0] == "read" for op in states)
        if reads_states:   # its loads and state reads before its writes: a step slot of their own
            b.steps.append((step, _PRE, divs))
        slot = len(b.steps) - (1 if reads_states else 0)
        if loads:
            loads = [(r, start, end, table, b.table(table)) for r, start, end, table in loads]
            self.slots_loaded += self._queue_writes(b, step, slot, loads, loaded=True)
        if states:
            self.states_loaded += self._queue_states(b, step, slot, states, "load", divs)
            self._queue_states(b, step, slot, states, "read", divs)
        if reads_states:
            slot += 1
        b.steps.append((step, tag, divs))
        # A scheduled request writes and reads through the same table: one copy.
        scheduled = [(r, c, n, table, b.table(table)) for r, c, n, table in scheduled]
        # Within one forward pass every layer writes the step's KV before attention
        # reads it, so a request may read what another request writes in the same step
        # (a prefix hit on a block allocated earlier in the same schedule(), 4.3).
        writes = [(r, c, c + n, table, off) for r, c, n, table, off in scheduled if n > 0]
        if writes:
            self.slots_written += self._queue_writes(b, step, slot, writes, loaded=False)
        if states:
            self.states_written += self._queue_states(b, step, slot, states, "write", divs)
        self._queue_reads(b, step, slot, scheduled, divs)
        if len(b.steps) >= self.BATCH_STEPS or b.n_rows * self.block_size >= self.BATCH_SLOTS:
            self._evaluate()
        return self._take()

    def queue_late_writes(self, step: int, writes: list[tuple[str, int, int, list[int]]],
                          states: list[tuple[str, int, list[int], int]] = ()) -> None:
        """Queue writes that ``step`` made but that only its output could place, as
        (request, start, end, block table), and states as (request, length, block
        table, table slot): under speculative decoding, the KV of the drafts the
        output accepted, and the states after them (their tokens are the
        request's only once the output says so). They count after every write
        and read of ``step`` and before those of any later step; they report
        nothing themselves."""
        writes = [(self._room(req), start, end, table) for req, start, end, table in writes]
        states = [("write", self._room(req), n, table, i) for req, n, table, i in states]
        b = self._batch
        slot = len(b.steps)
        b.steps.append((step, _LATE, []))
        writes = [(r, start, end, table, b.table(table)) for r, start, end, table in writes]
        self.slots_written += self._queue_writes(b, step, slot, writes, loaded=False)
        if states:
            self.states_written += self._queue_states(b, step, slot, states, "write", [])
        if len(b.steps) >= self.BATCH_STEPS:
            self._evaluate()

    def _room(self, req: str) -> _Req:
        r = self._req(req)
        if r.ntok > r.rows * self.block_size:   # most steps find room enough
            self._ensure(r, r.ntok)
        return r

    def flush(self) -> list[tuple[object, list[Divergence]]]:
        """Evaluate every queued step; returns (tag, divergences) per step not yet returned."""
        self._evaluate()
        return self._take()

    def _take(self) -> list[tuple[object, list[Divergence]]]:
        ready, self._ready = self._ready, []
        return ready

    def _queue_writes(self, b: Batch, step: int, slot: int, items, loaded: bool) -> int:
        """Queue writing the fingerprints of positions [start, end) of each item's
        request into the slots its block table names (items: request, start, end,
        table, the table's offset in the batch). Returns the positions queued."""
        B = self.block_size
        total = 0
        for r, start, end, table, off in items:
            start = max(start, 0)
            end = min(end, r.ntok, len(table) * B)
            if end <= start:
                continue
            for blk in table[start // B: _cdiv(end, B)]:
                holders = self._holders.get(blk)
                if holders:
                    for other, row in list(holders.items()):
                        self._uncheck(other, row)
            b.writes += (b.n_writes, end - start, start, off, r.row * B, r.idx, slot, step, loaded, 0)
            b.n_writes += end - start
            total += end - start
        return total

    def _queue_states(self, b: Batch, step: int, slot: int, states, which: str,
                      divs: list) -> int:
        """Queue the ``which`` ("load", "read" or "write") items of ``states``
        (what, request, length, block table, table slot). A state lives in slot 0
        of its block, as the fingerprint of the prefix it follows; a read checks
        that one slot. Returns the items queued."""
        done = 0
        for what, r, n, table, i in states:
            if what != which:
                continue
            if not 0 <= i < len(table):
                if what == "read":
                    req = self.ids[r.idx]
                    divs.append(Divergence(
                        step, req, "kv-content",
                        f"state slot {i}: no block for it (the table has {len(table)} blocks), "
                        f"but the step starts from the state after {n} tokens",
                        f"state of {req} after {n} tokens", STATE_RULE, "kv-content"))
                continue
            if not 0 < n <= r.ntok:
                if what == "read":
                    req = self.ids[r.idx]
                    divs.append(Divergence(
                        step, req, "kv-content",
                        f"state slot {i}: the state after {n} tokens is read, but the request "
                        f"has only {r.ntok} tokens", f"state of {req} after {n} tokens",
                        STATE_RULE, "kv-content"))
                continue
            blk = table[i]
            off = b.table([blk])
            done += 1
            if what == "read":
                b.read_states[len(b.read_reqs)] = (n, i)
                b.reads += (1, off, 1, r.row * self.block_size + n - 1, slot, 0, 0)
                b.read_reqs.append(r)
                b.n_rows += 1
                b.n_compared += 1
                self.states_checked += 1
                continue
            holders = self._holders.get(blk)
            if holders:
                for other, row in list(holders.items()):
                    self._uncheck(other, row)
            b.writes += (b.n_writes, 1, 0, off, r.row * self.block_size + n - 1, r.idx, slot,
                         step, what == "load", -n)
            b.n_writes += 1
        return done

    def _queue_reads(self, b: Batch, step: int, slot: int, scheduled, divs: list) -> None:
        """Queue reading, for each scheduled request, every position before its
        num_computed_tokens through its block table (items: request, c, n, table,
        the table's offset in the batch)."""
        B = self.block_size
        # Summed here and added once: this loop runs for every request at
        # every step.
        n_rows = n_compared = checked = compared = 0
        reads, read_reqs = b.reads, b.read_reqs
        for r, c, _n, table, off in scheduled:
            lim = c
            if lim > r.ntok:
                req = self.ids[r.idx]
                divs.append(Divergence(
                    step, req, "kv-content",
                    f"position {r.ntok}: the request has only {r.ntok} tokens, but "
                    f"{c} count as computed", f"prefix of {req} up to position {c - 1}", RULE,
                    "kv-content"))
                lim = r.ntok
            if lim > len(table) * B:
                req = self.ids[r.idx]
                divs.append(Divergence(
                    step, req, "kv-content",
                    f"position {len(table) * B}: no block for it (the block table has "
                    f"{len(table)} blocks), but {c} positions count as computed",
                    f"prefix of {req} up to position {c - 1}", RULE, "kv-content"))
                lim = len(table) * B
            if lim <= 0:
                continue
            rows = -(-lim // B)
            skip = self._skippable(r, table, lim) if self.skip_checked else 0
            lo = max(0, c - r.window + 1) if r.window else 0
            reads += (rows, off, lim, r.row * B, slot, skip, lo)
            read_reqs.append(r)
            n_rows += rows
            n_compared += rows - skip
            checked += lim - lo
            if skip or lo:
                compared += max(lim - max(skip * B, lo), 0)   # a skipped last row may be partial
            else:
                compared += lim
        b.n_rows += n_rows
        b.n_compared += n_compared
        self.slots_checked += checked
        self.slots_compared += compared

    # -- reads already checked -------------------------------------------------------

    def _skippable(self, r: _Req, table: list[int], lim: int) -> int:
        """How many leading rows of this read need no comparison: the rows checked
        before, through the same block ids, and not written since. The rows this
        read covers in full count as checked from now on; if the batch finds any
        wrong slot, it is compared again in full (``_check``)."""
        B, nb, done = self.block_size, self.num_blocks, r.verified
        if table[:len(done)] != done:
            same = 0
            while same < len(done) and same < len(table) and table[same] == done[same]:
                same += 1
            self._uncheck(r, same)
        skip = min(len(done), -(-lim // B))
        for row in range(len(done), min(lim // B, len(table))):
            blk = table[row]
            if not 0 <= blk < nb:
                break
            self._holders.setdefault(blk, {}).setdefault(r, row)
            done.append(blk)
        return skip

    def _uncheck(self, r: _Req, row: int = 0) -> None:
        """The request's rows from ``row`` on are no longer known to be right."""
        done = r.verified
        for blk in done[row:]:
            holders = self._holders.get(blk)
            if holders is not None and holders.get(r, -1) >= row:
                del holders[r]
                if not holders:
                    del self._holders[blk]
        del done[row:]

    def _evaluate(self) -> None:
        """Evaluate the queued steps: their writes, in order, and every read against
        the slot as it stood at its own step."""
        b = self._batch
        if not b.steps:
            return
        self._materialise()                 # every position a queued step uses
        self._batch = Batch()
        tables = self._ints(b.tables)
        w = self._write_log(b, tables) if b.n_writes else None
        if w is not None and len(b.steps) == 1:
            # One step: its writes land first, and its reads see them in the state.
            self._apply(w)
            w = None
        if b.read_reqs:
            self._check(b, tables, w)
        if w is not None:
            self._apply(w)
        self._ready += [(tag, divs) for _step, tag, divs in b.steps
                        if tag is not _LATE and tag is not _PRE]

    def _check(self, b: Batch, tables, w: tuple | None) -> None:
        """Every queued read against the slot as it stood at the read's step: the
        last write to it in the batch at or before that step, else the state
        before the batch. Rows already checked are left out, unless some slot
        turns out wrong: then every read of the batch is compared in full, so
        that the report is the one a full comparison gives. Divergences go to
        their steps' lists; a request with a wrong slot has none of its rows
        counted as checked any more."""
        if not b.n_compared:
            return
        reads = self._columns(b.reads, 7)
        found = self._compare(b, reads, tables, w, skip=b.n_compared < b.n_rows)
        if found is not None and b.n_compared < b.n_rows:
            found = self._compare(b, reads, tables, w, skip=False)
        if found is not None:
            self._report(b, reads, w, *found)

    def _report(self, b: Batch, reads: tuple, w: tuple | None, *found) -> None:
        """The rare path: name the first bad position of each read, and count them all."""
        nb = self.num_blocks
        for k, cnt, lim, blkid, p, s, sl, wreq, wstep, wpos, wload in self._first_bad(
                b, reads, w, *found):
            r = b.read_reqs[k]
            self._uncheck(r)
            req = self.ids[r.idx]
            step = b.steps[sl][0]
            if not 0 <= blkid < nb:
                what = f"block id {blkid} is outside the cache ({nb} blocks)"
            elif wreq < 0:
                what = "never written"
            else:
                verb = "loaded for" if wload else "written by"
                held = f"its state after {-wpos} tokens" if wpos < 0 else f"its position {wpos}"
                what = f"{verb} {self.ids[wreq]} at step {wstep} ({held})"
            state = b.read_states.get(k)
            if state is not None:
                n, i = state
                null = " (the null block)" if blkid == NULL_BLOCK else ""
                b.steps[sl][2].append(Divergence(
                    step, req, "kv-content", f"state slot {i}, block {blkid}{null}: {what}",
                    f"state of {req} after {n} tokens", STATE_RULE, "kv-content"))
                continue
            b.steps[sl][2].append(Divergence(
                step, req, "kv-content",
                f"block {blkid} slot {s} (position {p}): {what}; {cnt} of {lim} positions read "
                f"are wrong", f"prefix of {req} up to position {p}", RULE, "kv-content"))
