"""The KV digest's mix as one Triton kernel, for CUDA: ``kv_digest.py``'s
documented digest of a call's blocks over every layer, in one launch.

The layers' fold (``acc = acc * FOLD + sum``, layer by layer) is a sum
written out: a block's digest is the sum over the layers ``l`` of ``FOLD^(L
- 1 - l) * sum_l``, modulo 2^64. So each program mixes and sums one chunk
of one part (K or V, or the whole block) of one block in one layer, times
its layer's power of FOLD, and writes that alone; the block's digest is the
sum of its programs' numbers. Nothing is copied, and the bytes are read
once.

``BlockDigests`` (kv_digest.py) runs it on CUDA and checks its first
digests against the mix in torch, as it checks the kernel in C on the CPU.
Under Triton's interpreter (``TRITON_INTERPRET=1``) it runs on the CPU too,
which is how the tests hold it to the documented digest on a machine
without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

FOLD = 0x5851F42D4C957F2D
MAX_CHUNK = 2048   # words a program mixes at most: 16 KiB, 8 words a thread in 8 warps


@triton.jit
def _mix_sums(table, idx, out, CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """out[i, l, x]: the mixed sum of chunk x of block idx[i] in layer l,
    times the layer's fold. Chunk x is part x // chunks' chunk x % chunks.
    Every address is counted in 64-bit words from the table's own: a
    pointer argument, whose alignment Triton knows. With PAIRS, every
    layer's words start 16 bytes apart from a 16-byte boundary, so two words
    load at once."""
    x = tl.program_id(0)
    i = tl.program_id(1)
    l = tl.program_id(2)
    row = table + l * 8
    layer = tl.load(row)              # where the layer starts
    block_stride = tl.load(row + 1)
    part_stride = tl.load(row + 2)
    parts = tl.load(row + 3)
    words = tl.load(row + 4)          # a part's
    weights = tl.load(row + 5)        # where the weights of its words start
    fold = tl.load(row + 6).to(tl.uint64, bitcast=True)
    chunks = tl.load(row + 7)         # a part's
    if PAIRS:
        layer = tl.multiple_of(layer, 2)
        block_stride = tl.multiple_of(block_stride, 2)
        part_stride = tl.multiple_of(part_stride, 2)
        words = tl.multiple_of(words, 2)
        weights = tl.multiple_of(weights, 2)
    p = x // chunks
    j = (x - p * chunks) * CHUNK + tl.arange(0, CHUNK)
    live = j < tl.where(p < parts, words, 0)
    at = layer + tl.load(idx + i) * block_stride + p * part_stride + j
    w_at = weights + p * words + j
    v = tl.load(table + at, mask=live, other=0).to(tl.uint64, bitcast=True)
    v ^= v >> 31
    v *= tl.load(table + w_at, mask=live, other=0).to(tl.uint64, bitcast=True)
    v ^= v >> 29
    v *= 0x2545F4914F6CDD1D   # kv_digest._MIX
    v ^= v >> 32
    # A masked word loads as 0, and a 0 mixes to 0: it adds nothing.
    total = tl.sum(v, axis=0) * fold
    tl.store(out + (i * tl.num_programs(2) + l) * tl.num_programs(0) + x,
             total.to(tl.int64, bitcast=True))


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernel (``TRITON_INTERPRET=1``
    when it was defined): then it reads host memory alone."""
    return type(_mix_sums).__name__ == "InterpretedFunction"


class TritonDigests:
    """The digests of blocks of a set of layers, by ``_mix_sums``, on
    ``device``: each layer as ``BlockDigests._geometry`` gives it (its
    address, block stride, part stride, parts, words a part, the weights of a
    block's words; strides in 64-bit words)."""

    def __init__(self, device: torch.device,
                 layers: list[tuple[int, int, int, int, int, torch.Tensor]]) -> None:
        import torch

        self.torch = torch
        self.device = device
        count = len(layers)
        self.table = torch.empty((count, 8), dtype=torch.int64, device=device)
        here = self.table.data_ptr()   # addresses are counted in words from here
        rows = []
        self._weights = []   # the table holds their addresses: kept alive here
        for n, (at, block_stride, part_stride, parts, words, w) in enumerate(layers):
            self._weights.append(w)
            fold = pow(FOLD, count - 1 - n, 1 << 64)
            rows.append([(at - here) // 8, block_stride, part_stride, parts, words,
                         (w.data_ptr() - here) // 8, fold - (1 << 64) if fold >> 63 else fold])
        widest = max(r[4] for r in rows)
        self.chunk = min(MAX_CHUNK, max(16, 1 << (widest - 1).bit_length()))
        for r in rows:   # a part's chunks
            r.append(-(-r[4] // self.chunk))
        self.grid_x = max(r[3] * r[7] for r in rows)
        self.table.copy_(torch.tensor(rows, dtype=torch.int64))
        # Two words at a time where every start is 16 bytes from here, and
        # here is on a 16-byte boundary.
        self.pairs = here % 16 == 0 and all(r[0] % 2 == r[2] % 2 == r[4] % 2 == r[5] % 2 == 0
                                            for r in rows)
        self.layers = count
        self.warps = max(1, min(8, self.chunk // 256))

    def __call__(self, blocks: list[int]) -> list[int]:
        torch = self.torch
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        out = torch.empty((len(blocks), self.layers, self.grid_x), dtype=torch.int64,
                          device=self.device)
        self.launch(idx, out)
        # The sum of 64-bit integers wraps modulo 2^64, as the digest's does.
        return out.view(len(blocks), -1).sum(dim=1).tolist()

    def launch(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """The kernel alone: each program's number into ``out``, of shape
        (blocks, layers, grid_x)."""
        grid = (self.grid_x, len(idx), self.layers)
        if self.device.type == "cuda":
            with self.torch.cuda.device(self.device):
                _mix_sums[grid](self.table, idx, out, CHUNK=self.chunk, PAIRS=self.pairs,
                                num_warps=self.warps)
        else:   # Triton's interpreter
            _mix_sums[grid](self.table, idx, out, CHUNK=self.chunk, PAIRS=self.pairs)
