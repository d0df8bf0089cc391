"""The shadow cache in NumPy, on the CPU, without torch (see core.py).

The same steps as the torch backend (torch_backend.py), operation for
operation, so the same reports word for word: fingerprints are computed in
uint64, whose products and sums wrap modulo 2^64 as the torch backend's int64
ones do, and stored as int64 with the same bits. NumPy costs about a
microsecond per operation and imports in a twentieth of torch's time.
"""

from __future__ import annotations

from array import array

import numpy as np

from .core import MIX_C1, MIX_C2, NOT_WRITTEN, FP_INIT, K_POS, K_TOK, ShadowCore, Batch

__all__ = ["NumpyShadowKV", "mix64", "token_terms"]

_U = np.uint64


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays."""
    x = x ^ (x >> _U(30))
    x = x * _U(MIX_C1 & ((1 << 64) - 1))
    x = x ^ (x >> _U(27))
    x = x * _U(MIX_C2 & ((1 << 64) - 1))
    return x ^ (x >> _U(31))


def token_terms(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """term(t, j) for each (token, position), as uint64 (int64 arrays in)."""
    t, p = tokens.view(_U), positions.view(_U)
    return mix64(t * _U(K_TOK & ((1 << 64) - 1)) + mix64(p + _U(K_POS & ((1 << 64) - 1)))) \
        & ~_U(1)


def _i64(values: list[int] | array) -> np.ndarray:
    if not values:
        return np.empty(0, dtype=np.int64)
    return np.frombuffer(values if type(values) is array else array("q", values), dtype=np.int64)


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of equal values starts in ``x``, and where each ends."""
    change = np.flatnonzero(x[1:] != x[:-1]) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change - 1, [x.size - 1]))
    return starts, ends


class NumpyShadowKV(ShadowCore):
    """The shadow cache in NumPy arrays on the CPU."""

    device = "numpy"

    def _setup(self, n: int) -> None:
        self._fp = np.zeros(n, dtype=np.int64)
        self._wreq = np.full(n, -1, dtype=np.int32)
        self._wstep = np.full(n, -1, dtype=np.int32)
        self._wpos = np.full(n, -1, dtype=np.int32)
        self._wload = np.zeros(n, dtype=bool)
        self._first = np.full(n, NOT_WRITTEN, dtype=np.int64)
        self._arena = self._zeros(64)
        self._kept: dict[str, np.ndarray] = {}

    def _scratch(self, name: str, rows: int, dtype) -> np.ndarray:
        """A kept array of ``rows`` block rows, grown when a batch needs more:
        a batch's large arrays are not allocated afresh (fresh pages each
        time, from the operating system, for arrays this large). A heavy
        step's, beyond a batch's size, is not kept."""
        if rows * self.block_size > self.BATCH_SLOTS:
            return np.empty((rows, self.block_size), dtype=dtype)
        buf = self._kept.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self._kept[name] = np.empty((max(rows, 1024), self.block_size), dtype=dtype)
        return buf[:rows]

    def _ints(self, values: list[int]) -> np.ndarray:
        return _i64(values)

    def _columns(self, values: list[int], k: int) -> tuple:
        return tuple(_i64(values).reshape(-1, k).T)

    def _zeros(self, rows: int) -> np.ndarray:
        return np.zeros((rows, self.block_size), dtype=np.int64)

    def _copy(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def _rows_from(self) -> np.ndarray:
        """The arena as rows of a block's width starting at every position (a
        view): the expected fingerprints of a read, whose first row may start
        anywhere (a state's)."""
        flat = self._arena.reshape(-1)
        return np.lib.stride_tricks.as_strided(
            flat, (flat.size - self.block_size + 1, self.block_size),
            (flat.itemsize, flat.itemsize), writeable=False)

    def _fingerprint(self, toks: list[int], meta: list[int], total: int) -> None:
        first, start, dest = self._columns(meta, 3)
        lens = np.diff(first, append=total)
        seg = np.repeat(np.arange(first.size), lens)
        local = np.arange(total) - first[seg]
        cs = np.cumsum(token_terms(_i64(toks), start[seg] + local), dtype=_U)
        before = np.where(first > 0, cs[np.maximum(first - 1, 0)], _U(0))
        arena = self._arena.reshape(-1)
        prev = np.where(start > 0, arena[np.maximum(dest - 1, 0)], FP_INIT).view(_U)
        arena[dest[seg] + local] = (cs - before[seg] + prev[seg]).view(np.int64)

    def _apply(self, w: tuple) -> None:
        """The state after the writes of ``w``: each slot's last write."""
        wslot, wval, who, wpos, wstep, wload = w[:6]
        last = _runs(wslot)[1]
        u = wslot[last]
        self._fp[u] = wval[last]
        self._wreq[u] = who[last]
        self._wstep[u] = wstep[last]
        self._wpos[u] = wpos[last]
        self._wload[u] = wload[last] != 0
        self._first[u] = NOT_WRITTEN

    def _write_log(self, b: Batch, tables: np.ndarray) -> tuple:
        """Every queued write, one entry per position, sorted by (slot, step slot)
        with the order of writing kept among equals; and the sort keys."""
        B, nb = self.block_size, self.num_blocks
        K = len(b.steps)
        total = b.n_writes
        first, lens, start, toff, abase, who, slot, step, loaded, posoff = self._columns(b.writes, 10)
        seg = np.repeat(np.arange(first.size), lens)
        pos = start[seg] + np.arange(total) - first[seg]
        blk = tables[toff[seg] + pos // B]
        blk = np.where((blk < 0) | (blk >= nb), nb, blk)
        wslot = blk * B + pos % B
        key = wslot * K + slot[seg]
        order = np.argsort(key, kind="stable")
        key = key[order]
        seg = seg[order]
        wslot = wslot[order]
        pos = pos[order]
        # Sorted by slot, then step slot: a slot's first entry has its first step.
        firsts = _runs(wslot)[0]
        u = wslot[firsts]
        self._first[u] = np.minimum(self._first[u], slot[seg[firsts]])
        return (wslot, self._arena.reshape(-1)[abase[seg] + pos],
                who[seg], pos + posoff[seg], step[seg], loaded[seg], key)

    def _compare(self, b: Batch, reads: tuple, tables: np.ndarray, w: tuple | None,
                 skip: bool) -> tuple | None:
        """As ShadowKV._compare (torch_backend.py)."""
        B, nb = self.block_size, self.num_blocks
        K = len(b.steps)
        rows, toff, lims, abase, slot, skipped, los = reads
        nrows = b.n_compared if skip else b.n_rows
        if skip:
            rows = rows - skipped
        # A read's rows are consecutive: row i of the batch is row bi = i -
        # start of its read, so each index below is i plus one value a read.
        start = np.cumsum(rows) - rows - (skipped if skip else 0)   # i - bi
        i = np.arange(nrows)
        blk = tables[i + np.repeat(toff - start, rows)]
        oob = blk.view(np.uint64) >= nb      # a negative id too
        any_oob = oob.any()
        blkc = np.where(oob, nb, blk) if any_oob else blk
        # The rows gathered into kept arrays; every index is in range (the
        # sentinel row nb for a block outside the cache), so no mode checks it.
        held = self._fp.reshape(-1, B).take(blkc, axis=0, mode="clip",      # the state before
                                            out=self._scratch("held", nrows, np.int64))
        hit = None
        if w is not None:
            wval, key = w[1], w[6]
            rslot = np.repeat(slot, rows)
            hit = self._first.reshape(-1, B).take(blkc, axis=0) <= rslot[:, None]
            sel = np.flatnonzero(hit)
            if sel.size:
                r = sel // B
                j = np.searchsorted(key, (blkc[r] * B + sel % B) * K + rslot[r],
                                    side="right") - 1
                held.reshape(-1)[sel] = wval[j]
        if (abase % B).any():   # a state read's row starts anywhere in the arena
            want = self._rows_from()[i * B + np.repeat(abase - start * B, rows)]
        else:                    # rows of the arena: a faster gather
            want = self._arena.reshape(-1, B).take(i + np.repeat(abase // B - start, rows),
                                                   axis=0, mode="clip",
                                                   out=self._scratch("want", nrows, np.int64))
        # Whole rows compared; a block out of the table is wrong wherever it
        # is read; then, where any slot is wrong, the rows read in part lose
        # the columns they do not read.
        bad = np.not_equal(held, want, out=self._scratch("bad", nrows, bool))
        if any_oob:
            bad[oob] = True
        if not bad.any():
            return None
        self._trim_rows(bad, rows, lims, los, start, i)
        if not bad.any():
            return None
        rreq = np.repeat(np.arange(rows.size), rows)
        return bad, rreq, i - start[rreq], blk, blkc, hit

    def _trim_rows(self, bad: np.ndarray, rows: np.ndarray, lims: np.ndarray,
                   los: np.ndarray, start: np.ndarray, i: np.ndarray) -> None:
        """As ShadowKV._trim_rows (torch_backend.py)."""
        B = self.block_size
        col = np.arange(B)
        if los.any():
            bi = i - np.repeat(start, rows)
            rowlim = np.minimum(np.repeat(lims, rows) - bi * B, B)
            rowlo = np.repeat(los, rows) - bi * B
            part = np.flatnonzero((rowlim < B) | (rowlo > 0))
            if part.size:
                bad[part] &= ((col[None, :] < rowlim[part, None])
                              & (col[None, :] >= rowlo[part, None]))
        else:
            cut = np.flatnonzero((lims % B != 0) & (rows > 0))
            if cut.size:
                last = np.cumsum(rows)[cut] - 1
                bad[last] &= col[None, :] < (lims[cut] % B)[:, None]

    def _first_bad(self, b: Batch, reads: tuple, w: tuple | None, bad: np.ndarray,
                   rreq: np.ndarray, bi: np.ndarray, blk: np.ndarray, blkc: np.ndarray,
                   hit: np.ndarray | None):
        """As ShadowKV._first_bad (torch_backend.py)."""
        B, K = self.block_size, len(b.steps)
        lims, slot = reads[2] - reads[6], reads[4]
        where = np.flatnonzero(bad)
        owner = rreq[where // B]
        starts = _runs(owner)[0]
        uo = owner[starts]
        counts = np.diff(starts, append=owner.size)
        first_bad = where[starts]
        frow, fcol = first_bad // B, first_bad % B
        fslot = blkc[frow] * B + fcol
        wr, ws = self._wreq[fslot].astype(np.int64), self._wstep[fslot].astype(np.int64)
        wp, wl = self._wpos[fslot].astype(np.int64), self._wload[fslot].astype(np.int64)
        if hit is not None:                 # the writer at the read's own step
            fhit = hit.reshape(-1)[first_bad]
            key = w[6]
            fj = np.maximum(np.searchsorted(key, fslot * K + slot[rreq[frow]], side="right") - 1, 0)
            who, wpos, wstep, wload = w[2], w[3], w[4], w[5]
            wr = np.where(fhit, who[fj], wr)
            ws = np.where(fhit, wstep[fj], ws)
            wp = np.where(fhit, wpos[fj], wp)
            wl = np.where(fhit, wload[fj], wl)
        info = np.stack([uo, counts, lims[uo], blk[frow], bi[frow] * B + fcol, fcol,
                         slot[uo], wr, ws, wp, wl]).tolist()
        return zip(*info)
