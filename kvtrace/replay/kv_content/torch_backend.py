"""The shadow cache in torch, on the CPU or on CUDA (see core.py)."""

from __future__ import annotations

from array import array

import torch

from .core import (MIX_C1, MIX_C2, NOT_WRITTEN, FP_INIT, K_POS, K_TOK, DeviceUnavailable,
                        ShadowCore, Batch, s64)

__all__ = ["ShadowKV", "mix64", "token_terms", "prefix_fingerprints", "pick_device"]


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words: arithmetic shift, then clear the copied sign bits."""
    return torch.bitwise_and(torch.bitwise_right_shift(x, s), (1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (bit-for-bit the unsigned version mod 2^64)."""
    x = x ^ _srl(x, 30)
    x = x * MIX_C1
    x = x ^ _srl(x, 27)
    x = x * MIX_C2
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
    return torch.cumsum(token_terms(tok, pos), 0) + s64(prev)



def pick_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" → cuda when torch sees a CUDA device, else cpu. "cuda" without CUDA is an error."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"device '{name}' was asked for, but torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA: {torch.version.cuda or 'no'}); use --device cpu or auto")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {name!r}: expected auto, cpu or cuda")



def _each_row(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """A value a read, on each of its ``rows`` (``n`` rows in all)."""
    return torch.repeat_interleave(x, rows, output_size=n)


def _i64(values: list[int] | array, device: torch.device) -> torch.Tensor:
    """A Python int list (or a C array of them) as an int64 tensor on ``device``
    (through a C array: several times faster than torch.tensor on long lists)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    t = torch.frombuffer(values if type(values) is array else array("q", values),
                         dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device)




class ShadowKV(ShadowCore):
    """The shadow cache in torch tensors on ``device`` ("auto", "cpu", "cuda")."""

    def __init__(self, num_blocks: int, block_size: int, device: str = "auto",
                 skip_checked: bool = True):
        self.device = pick_device(device)
        super().__init__(num_blocks, block_size, skip_checked)

    def _setup(self, n: int) -> None:
        dev = self.device
        self._fp = torch.zeros(n, dtype=torch.int64, device=dev)
        self._wreq = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._wstep = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._wpos = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._wload = torch.zeros(n, dtype=torch.bool, device=dev)
        self._first = torch.full((n,), NOT_WRITTEN, dtype=torch.int64, device=dev)
        self._arena = self._zeros(64)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return _i64(values, self.device)

    def _columns(self, values: list[int], k: int) -> tuple:
        return _i64(values, self.device).view(-1, k).unbind(1)

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, self.block_size), dtype=torch.int64, device=self.device)

    def _copy(self, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    def _fingerprint(self, toks: list[int], meta: list[int], total: int) -> None:
        dev = self.device
        first, start, dest = _i64(meta, dev).view(-1, 3).unbind(1)
        i64 = dict(dtype=torch.int64, device=dev)
        lens = torch.diff(first, append=torch.tensor([total], **i64))
        seg = torch.repeat_interleave(torch.arange(first.numel(), **i64), lens, output_size=total)
        local = torch.arange(total, **i64) - first[seg]
        cs = torch.cumsum(token_terms(_i64(toks, dev), start[seg] + local), 0)
        before = torch.where(first > 0, cs[(first - 1).clamp(min=0)], 0)
        arena = self._arena.view(-1)
        prev = torch.where(start > 0, arena[(dest - 1).clamp(min=0)], FP_INIT)
        arena[dest[seg] + local] = cs - before[seg] + prev[seg]

    def _apply(self, w: tuple) -> None:
        """The state after the writes of ``w``: each slot's last write."""
        wslot, wval, who, wpos, wstep, wload = w[:6]
        uslot, counts = torch.unique_consecutive(wslot, return_counts=True)
        last = torch.cumsum(counts, 0) - 1
        self._fp.index_copy_(0, uslot, wval[last])
        self._wreq.index_copy_(0, uslot, who[last].to(torch.int32))
        self._wstep.index_copy_(0, uslot, wstep[last].to(torch.int32))
        self._wpos.index_copy_(0, uslot, wpos[last].to(torch.int32))
        self._wload.index_copy_(0, uslot, wload[last].to(torch.bool))
        self._first.index_fill_(0, uslot, NOT_WRITTEN)

    def _write_log(self, b: Batch, tables: torch.Tensor) -> tuple:
        """Every queued write, one entry per position, sorted by (slot, step slot)
        with the order of writing kept among equals; and the sort keys."""
        B, dev, nb = self.block_size, self.device, self.num_blocks
        K = len(b.steps)
        i64 = dict(dtype=torch.int64, device=dev)
        total = b.n_writes
        first, lens, start, toff, abase, who, slot, step, loaded, posoff = \
            _i64(b.writes, dev).view(-1, 10).unbind(1)
        seg = torch.repeat_interleave(torch.arange(first.numel(), **i64), lens, output_size=total)
        pos = start[seg] + torch.arange(total, **i64) - first[seg]
        blk = tables.index_select(0, toff[seg] + pos // B)
        blk = torch.where((blk < 0) | (blk >= nb), nb, blk)
        wslot = blk * B + pos % B
        key = wslot * K + slot[seg]
        key, order = torch.sort(key, stable=True)
        seg = seg[order]
        wslot = wslot[order]
        self._first.scatter_reduce_(0, wslot, slot[seg], "amin")
        pos = pos[order]
        return (wslot, self._arena.view(-1).index_select(0, abase[seg] + pos),
                who[seg], pos + posoff[seg], step[seg], loaded[seg], key)

    def _compare(self, b: Batch, reads: tuple, tables: torch.Tensor, w: tuple | None,
                 skip: bool) -> tuple | None:
        """Compare the slots the batch's reads cover (with ``skip``, less the rows
        already checked). Returns None if all hold what they should, else what
        ``_report`` needs."""
        B, dev, nb = self.block_size, self.device, self.num_blocks
        K = len(b.steps)
        i64 = dict(dtype=torch.int64, device=dev)
        rows, toff, lims, abase, slot, skipped, los = reads
        nrows = b.n_compared if skip else b.n_rows
        if skip:
            rows = rows - skipped
        # A read's rows are consecutive: row i of the batch is row bi = i -
        # start of its read, so each index below is i plus one value a read.
        start = torch.cumsum(rows, 0) - rows - (skipped if skip else 0)   # i - bi

        def each_row(x: torch.Tensor) -> torch.Tensor:
            return _each_row(x, rows, nrows)

        i = torch.arange(nrows, **i64)
        blk = tables.index_select(0, i + each_row(toff - start))
        oob = (blk < 0) | (blk >= nb)
        blkc = torch.where(oob, nb, blk)
        # Rows are gathered from unfold's views: on the CPU, torch's
        # index_select takes them twice as fast as from a view(-1, B).
        held = self._fp.unfold(0, B, B).index_select(0, blkc)      # the state before the batch
        hit = None
        if w is not None:
            # Slots written in the batch at or before the read's step (few) take the
            # last such write: a binary search in the sorted write log.
            wval, key = w[1], w[6]
            rslot = each_row(slot)
            hit = self._first.unfold(0, B, B).index_select(0, blkc) <= rslot[:, None]
            sel = hit.view(-1).nonzero().squeeze(1)
            if sel.numel():
                r = sel // B
                j = torch.searchsorted(key, (blkc[r] * B + sel % B) * K + rslot[r], right=True) - 1
                held.view(-1)[sel] = wval[j]
        # The expected rows: the arena as rows of a block's width starting at
        # every position (a view), since a state read's row starts anywhere.
        want = self._arena.view(-1).unfold(0, B, 1).index_select(
            0, i * B + each_row(abase - start * B))
        # Whole rows compared; a block out of the table is wrong wherever it
        # is read; then, where any slot is wrong, the rows read in part lose
        # the columns they do not read.
        bad = held != want
        if bool(oob.any()):
            bad[oob] = True
        if not bool(bad.any()):
            return None
        self._trim_rows(bad, rows, lims, los, start, i)
        if not bool(bad.any()):
            return None
        rreq = each_row(torch.arange(rows.numel(), **i64))
        return bad, rreq, i - start[rreq], blk, blkc, hit

    def _trim_rows(self, bad: torch.Tensor, rows: torch.Tensor, lims: torch.Tensor,
                   los: torch.Tensor, start: torch.Tensor, i: torch.Tensor) -> None:
        """Clear, in ``bad``, the columns of the rows read in part that they
        do not read: a read's last row (its positions end inside it), and
        under a sliding window the rows it begins in or after (columns before
        the window)."""
        B = self.block_size
        col = torch.arange(B, dtype=torch.int64, device=self.device)
        if bool(los.any()):
            n = i.numel()
            bi = i - _each_row(start, rows, n)
            rowlim = (_each_row(lims, rows, n) - bi * B).clamp(max=B)
            rowlo = _each_row(los, rows, n) - bi * B
            part = ((rowlim < B) | (rowlo > 0)).nonzero().squeeze(1)
            if part.numel():
                read = ((col[None, :] < rowlim.index_select(0, part)[:, None])
                        & (col[None, :] >= rowlo.index_select(0, part)[:, None]))
                bad.index_copy_(0, part, bad.index_select(0, part) & read)
        else:
            cut = ((lims % B != 0) & (rows > 0)).nonzero().squeeze(1)
            if cut.numel():
                last = torch.cumsum(rows, 0).index_select(0, cut) - 1
                read = col[None, :] < (lims.index_select(0, cut) % B)[:, None]
                bad.index_copy_(0, last, bad.index_select(0, last) & read)

    def _first_bad(self, b: Batch, reads: tuple, w: tuple | None, bad: torch.Tensor,
                   rreq: torch.Tensor, bi: torch.Tensor, blk: torch.Tensor, blkc: torch.Tensor,
                   hit: torch.Tensor | None):
        """Per read with a wrong slot: (read, wrong slots, positions read, block
        id, position, slot, step slot, and the slot's writer: request index,
        step, position, loaded), of its first wrong slot."""
        B, K = self.block_size, len(b.steps)
        lims, slot = reads[2] - reads[6], reads[4]   # positions read: a window's only
        where = bad.view(-1).nonzero().squeeze(1)
        owner = rreq[where // B]
        uo, counts = torch.unique_consecutive(owner, return_counts=True)
        first_bad = where[torch.cumsum(counts, 0) - counts]
        frow, fcol = first_bad // B, first_bad % B
        fslot = blkc[frow] * B + fcol
        wr, ws = self._wreq[fslot].long(), self._wstep[fslot].long()
        wp, wl = self._wpos[fslot].long(), self._wload[fslot].long()
        if hit is not None:                 # the writer at the read's own step
            fhit = hit.view(-1)[first_bad]
            key = w[6]
            fj = (torch.searchsorted(key, fslot * K + slot[rreq[frow]], right=True) - 1).clamp(min=0)
            who, wpos, wstep, wload = w[2], w[3], w[4], w[5]
            wr = torch.where(fhit, who[fj], wr)
            ws = torch.where(fhit, wstep[fj], ws)
            wp = torch.where(fhit, wpos[fj], wp)
            wl = torch.where(fhit, wload[fj], wl)
        info = torch.stack([uo, counts, lims[uo], blk[frow], bi[frow] * B + fcol, fcol,
                            slot[uo], wr, ws, wp, wl]).tolist()
        return zip(*info)
