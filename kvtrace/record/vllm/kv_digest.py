"""Digests of the KV cache's real bytes: ``BlockDigests``, and the
per-layer KV cache tensors of a worker (``kv_layers``).

A digest is a 64-bit hash of a block's bytes in every layer's KV cache (a
signed 64-bit integer): each layer's bytes are read as 64-bit words (bytes,
where a layer's block is no multiple of 8 of them); each word is multiplied
by a fixed random odd word of its position between xor-shifts (xor-shift,
multiply by the position's word, xor-shift, multiply, xor-shift, all modulo
2^64, so that every bit of the word reaches every bit); the mixed words are summed modulo 2^64, the layers folded in order.
The same bytes give the same digest on any device; bytes that differ give
another one but for a chance of about 2^-60 (without the mixing, a sum of
weighted words would miss two flips of the same high bit half the time).
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

_FOLD = 0x5851F42D4C957F2D   # odd: folds one layer's sum into the next
_MIX = 0x2545F4914F6CDD1D   # odd, below 2^63: a signed 64-bit integer as it is
_BATCH = 256   # blocks digested at once: the copies stay small beside the cache
_U29, _U31, _U32, _UMIX = np.uint64(29), np.uint64(31), np.uint64(32), np.uint64(_MIX)


def _kernel() -> tuple[object | None, str]:
    """``kvt_digest``, the mix in C (``_kv_digest.c``), where the compiled path
    runs and holds it (``python -m kvtrace.compile``); else None, and why."""
    global _KERNEL
    if _KERNEL is None:
        from kvtrace import compiled

        path, why = compiled.kernel("kvtrace.record.vllm._kv_digest")
        fn = None
        if path is not None:
            try:
                fn = ctypes.CDLL(path).kvt_digest
                fn.restype = None
                fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64,
                                                                         ctypes.c_void_p]
            except (OSError, AttributeError) as exc:
                fn, why = None, f"{path} did not load: {exc}"
        _KERNEL = (fn, why)
    return _KERNEL


_KERNEL: tuple[object | None, str] | None = None


class BlockDigests:
    """Digests of whole blocks of a set of per-layer KV cache tensors.

    One call of a kernel digests the blocks in every layer, one pass over
    their words: the kernel in C on the CPU, the Triton kernel on CUDA
    (``kv_digest_triton.py``). Each call's digests are checked against the
    array path's (NumPy chunks on the CPU, torch on CUDA) until one of them
    is not 0. The array path gives them where there is no kernel: where the
    compiled path is not built or does not run (CPU), where Triton does not
    import or compile (CUDA), where a layer's blocks are no whole number of
    64-bit words in place, where a layer's tensor moved to other memory, and
    where the kernel fails or differs (``kernel_off`` says why). A kernel
    short of memory gives way for that call alone."""

    # On the CPU, the words mixed at once: 256 KiB, which stays in a core's
    # own cache through the mix's passes.
    _CHUNK_WORDS = 1 << 15

    def __init__(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        import torch

        self.torch = torch
        self.num_blocks = num_blocks
        self.layers = []   # (tensor, its block dimension)
        seen = set()
        for t in layers:
            # A tensor listed twice (layers that share their KV cache) counts once.
            same = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if same in seen:
                continue
            seen.add(same)
            # vLLM's layouts put the blocks first ([blocks, heads, ...], the
            # CPU's) or second ([2, blocks, ...], K and V first).
            dims = [d for d, n in enumerate(t.shape[:2]) if n == num_blocks]
            if len(dims) != 1:
                raise ValueError(f"a KV cache tensor of shape {tuple(t.shape)} has "
                                 f"{'no' if not dims else 'more than one'} dimension of "
                                 f"{num_blocks} blocks among its first two")
            self.layers.append((t, dims[0]))
        self.device = self.layers[0][0].device
        self._weights: dict[int, torch.Tensor] = {}
        # Two buffers per layout (parts, words), of 64-bit words, kept: the
        # mix runs in place in them, allocating nothing per call. On CUDA
        # they hold a call's blocks (a power of 2 of them, up to _BATCH); on
        # the CPU a chunk's.
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.kernel_off: str | None = None   # why no kernel runs
        self._checked = False                 # its digests equaled the array path's (not all 0)
        # The kernel: a function of the blocks giving their digests.
        self._call: Callable[[list[int]], list[int]] | None = None
        if self.device.type == "cpu":
            self._kernel_setup()
        elif self.device.type == "cuda":
            self._triton_setup()
        else:
            self.kernel_off = f"no kernel for {self.device.type}"

    def _triton_setup(self) -> None:
        """The Triton kernel for these layers, or why it cannot run."""
        try:
            from kvtrace.record.vllm import kv_digest_triton as kt
        except Exception as exc:   # no Triton, or one that does not import
            self.kernel_off = f"Triton does not import: {exc}"
            return
        if kt.interpreted() and self.device.type != "cpu":
            self.kernel_off = ("Triton's interpreter is on (TRITON_INTERPRET): it reads no "
                               "GPU memory")
            return
        try:
            geometry = self._geometry()
            if geometry is None:
                return
            self._call = kt.TritonDigests(self.device, geometry)
        except Exception as exc:   # its table or weights found no memory, say
            self.kernel_off = f"it did not set up: {type(exc).__name__}: {exc}"
            return
        self._memory = self._where()

    def _kernel_setup(self) -> None:
        """The kernel in C's arguments for these layers, or why it cannot run."""
        self._fn, why = _kernel()
        if self._fn is None:
            self.kernel_off = why
            return
        geometry = self._geometry()
        if geometry is None:
            return
        cols = zip(*[(*g[:5], w.data_ptr()) for *g, w in geometry])
        self._args = (len(self.layers), *[np.array(c, dtype=np.int64) for c in cols])
        self._call = self._c_digest
        self._memory = self._where()

    def _geometry(self) -> list[tuple[int, int, int, int, int, torch.Tensor]] | None:
        """What a kernel reads of each layer, in 64-bit words: (its address,
        block stride, part stride, parts, words a part, the weights of a
        block's words); None, with ``kernel_off`` saying why, where a layer's
        blocks are no whole number of words in place."""
        out = []
        for t, dim in self.layers:
            parts, words = _layout(t, dim)
            if words is None:
                self.kernel_off = (f"a layer's blocks ({tuple(t.shape)}, {t.dtype}) are no "
                                   f"whole number of 64-bit words in place (a part's bytes, "
                                   f"gaps, or a start off an 8-byte boundary)")
                return None
            out.append((t.data_ptr(), words, int(t.shape[dim]) * words, parts, words,
                        self._w(parts * words)))
        return out

    def _where(self) -> list[tuple[int, tuple[int, ...]]]:
        """Where each layer's tensor is now, and its shape: the kernel reads
        the memory it saw at the start, and no other."""
        return [(t.data_ptr(), tuple(t.shape)) for t, _ in self.layers]

    def _w(self, n: int) -> torch.Tensor:
        w = self._weights.get(n)
        if w is None:
            g = self.torch.Generator().manual_seed(0x6B76 + n)
            w = (self.torch.randint(-(1 << 62), 1 << 62, (n,), generator=g,
                                    dtype=self.torch.int64) * 2 + 1).to(self.device)
            self._weights[n] = w
        return w

    def __call__(self, blocks: list[int]) -> list[int]:
        out: list[int] = []
        for at in range(0, len(blocks), _BATCH):
            out += self._digest(blocks[at:at + _BATCH])
        return out

    def _digest(self, blocks: list[int]) -> list[int]:
        if not blocks:
            return []
        if self._call is not None:
            out = self._kernel_digest(blocks)
            if out is not None:
                return out
        return self._array_digest(blocks)

    def _array_digest(self, blocks: list[int]) -> list[int]:
        """The digests from array operations: NumPy chunks on the CPU, torch
        elsewhere."""
        torch = self.torch
        idx = torch.as_tensor(blocks, dtype=torch.int64, device=self.device)
        if self.device.type == "cpu":
            # One thread: on two threads the passes share the caches and
            # ran slower (bench/kv_audit.py).
            sums = [self._layer_sums_cpu(t, dim, idx) for t, dim in self.layers]
        else:
            sums = [None] * len(self.layers)
        acc = None
        for (t, dim), s in zip(self.layers, sums):
            if s is None:
                s = self._layer_sums(t, dim, idx)
            acc = s if acc is None else acc * _FOLD + s
        return acc.tolist()

    def _layer_sums(self, t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
        """Each block's sum of its mixed words in one layer, in torch (any
        device): the blocks are copied as words, then mixed in place."""
        torch = self.torch
        # [parts, blocks, words]: one part where the blocks come first
        # (the CPU's layout), K and V where they come second.
        x, tmp = self._words(t, dim, idx)   # a copy: the mix below overwrites it
        parts, _, words = x.shape
        # Each step in place, through one scratch buffer (x ^= (x >> k) &
        # mask would allocate two of x's size): a logical shift of the
        # 64-bit words brings the high bits down, a multiply by a weight
        # of the word's position in its block (K's words, then V's) takes
        # them up again; twice, then once more down.
        torch.bitwise_right_shift(x, 31, out=tmp).bitwise_and_(0x1FFFFFFFF)
        x.bitwise_xor_(tmp).mul_(self._w(parts * words).view(parts, 1, words))
        torch.bitwise_right_shift(x, 29, out=tmp).bitwise_and_(0x7FFFFFFFF)
        x.bitwise_xor_(tmp).mul_(_MIX)
        torch.bitwise_right_shift(x, 32, out=tmp).bitwise_and_(0xFFFFFFFF)
        return x.bitwise_xor_(tmp).sum(dim=(0, 2))

    def _layer_sums_cpu(self, t: torch.Tensor, dim: int,
                        idx: torch.Tensor) -> torch.Tensor | None:
        """The same sums on the CPU, in NumPy chunks; None for a layout they
        cannot read (bytes no multiple of 8)."""
        parts, words = _layout(t, dim)
        if words is None:
            return None
        return self._chunk_sums(t, dim, idx, parts, words)

    def _kernel_digest(self, blocks: list[int]) -> list[int] | None:
        """The digests from the kernel; None, and the kernel off from here,
        where it fails or its first digests differ from the array path's."""
        if self._where() != self._memory:   # a tensor given other memory (torch's set_)
            self._call = None
            self.kernel_off = "a layer's KV cache tensor moved since the first digest"
            return None
        lo, hi = min(blocks), max(blocks)
        if lo < 0 or hi >= self.num_blocks:   # every layer's block dimension (_where holds it)
            raise IndexError(f"block {lo if lo < 0 else hi} is not in the KV cache")
        try:
            digests = self._call(blocks)
        except Exception as exc:   # Triton's compiler, say: the array path goes on
            if isinstance(exc, getattr(self.torch, "OutOfMemoryError", MemoryError)):
                return None   # this call alone: memory may be found at the next
            return self._kernel_fails(f"it failed: {type(exc).__name__}: {exc}")
        # Checked against the array path until a call with a digest other
        # than 0 (blocks of zeros, a fresh cache's, digest to 0 any way).
        if not self._checked:
            if digests != self._array_digest(blocks):
                arrays = "the NumPy chunks" if self.device.type == "cpu" else "the mix in torch"
                return self._kernel_fails(f"its digests differ from those of {arrays}")
            self._checked = any(digests)
            if self._checked:
                self._buffers.clear()   # the array path's: not needed from here
        return digests

    def _kernel_fails(self, why: str) -> None:
        self._call = None
        self.kernel_off = why
        logging.getLogger("kvtrace.record").warning(
            "kvtrace: KV digests on the array path from here, slower (the kernel: %s)", why)
        return None

    def _c_digest(self, blocks: list[int]) -> list[int]:
        """The kernel in C's digests (``_kv_digest.c``)."""
        idx = np.array(blocks, dtype=np.int64)
        out = np.empty(len(blocks), dtype=np.int64)
        n_layers, base, block_stride, part_stride, parts, words, weights = self._args
        self._fn(n_layers, base.ctypes.data, block_stride.ctypes.data, part_stride.ctypes.data,
                 parts.ctypes.data, words.ctypes.data, weights.ctypes.data, idx.ctypes.data,
                 len(blocks), out.ctypes.data)
        return out.tolist()

    def _chunk_sums(self, t: torch.Tensor, dim: int, idx: torch.Tensor,
                    parts: int, words: int) -> torch.Tensor:
        """The sums a few blocks at a time: each chunk of about
        ``_CHUNK_WORDS`` words is copied, mixed and summed while it is in the
        core's cache, as unsigned 64-bit words in NumPy (a logical shift is
        one pass there; torch has no unsigned shift on the CPU)."""
        torch = self.torch
        src = t.view(parts, t.shape[dim], -1).view(torch.int64)
        n = len(idx)
        step = max(1, min(n, self._CHUNK_WORDS // (parts * words)))
        bufs = self._scratch(parts, words, step)
        w = self._w(parts * words).numpy().view(np.uint64).reshape(parts, 1, words)
        sums = np.empty(n, dtype=np.uint64)
        for at in range(0, n, step):
            k = min(step, n - at)
            xt = bufs[0][:parts * k * words].view(parts, k, words)
            torch.index_select(src, 1, idx[at:at + k], out=xt)
            x = xt.numpy().view(np.uint64)
            tmp = bufs[1].numpy().view(np.uint64)[:x.size].reshape(x.shape)
            np.right_shift(x, _U31, out=tmp)
            x ^= tmp
            x *= w
            np.right_shift(x, _U29, out=tmp)
            x ^= tmp
            x *= _UMIX
            np.right_shift(x, _U32, out=tmp)
            x ^= tmp
            sums[at:at + k] = x.sum(axis=(0, 2), dtype=np.uint64)
        return torch.from_numpy(sums.view(np.int64))

    def _scratch(self, parts: int, words: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The two kept buffers of a layout, grown to hold ``rows`` blocks."""
        bufs = self._buffers.get((parts, words))
        if bufs is None or bufs[0].numel() < parts * rows * words:
            bufs = self._buffers[(parts, words)] = tuple(
                self.torch.empty(parts * rows * words, dtype=self.torch.int64, device=self.device)
                for _ in range(2))
        return bufs

    def _words(self, t: torch.Tensor, dim: int,
               idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks ``idx`` of one layer as 64-bit words, ``[parts, blocks,
        words]`` (a copy), and a scratch buffer of the same shape."""
        torch = self.torch
        n = len(idx)
        parts, words = _layout(t, dim)
        if words is not None:
            need = parts * n * words
            # grown to the largest call, up to _BATCH
            bufs = self._scratch(parts, words, min(_BATCH, 1 << (n - 1).bit_length()))
            x = bufs[0][:need].view(parts, n, words)
            torch.index_select(t.view(parts, t.shape[dim], -1).view(torch.int64), 1, idx, out=x)
            return x, bufs[1][:need].view(parts, n, words)
        x = t.index_select(dim, idx)   # another layout: the same words, by a slower road
        if dim:
            x = x.movedim(dim, 0)
        x = x.contiguous().view(torch.uint8).reshape(n, -1)
        x = x.view(torch.int64) if x.shape[1] % 8 == 0 else x.to(torch.int64)
        return x.unsqueeze(0), torch.empty_like(x).unsqueeze(0)


def _layout(t: torch.Tensor, dim: int) -> tuple[int, int | None]:
    """A layer's blocks as parts (1 where the blocks come first, K and V
    where they come second) of 64-bit words in place: (parts, words a part),
    words None where a part is no whole number of words, the tensor has
    gaps, or it starts off an 8-byte boundary."""
    parts = 1 if dim == 0 else int(t.shape[0])
    nbytes = t.numel() // (parts * t.shape[dim]) * t.element_size()   # a part of a block
    whole = t.is_contiguous() and nbytes % 8 == 0 and t.data_ptr() % 8 == 0
    return parts, (nbytes // 8 if whole else None)


def kv_layers(conn: KVConnectorBase_V1, names: list[str] | None = None) -> list[torch.Tensor]:
    """The worker's per-layer KV cache tensors, from vLLM's static forward
    context (the layers that hold one); with ``names``, those layers' alone,
    in that order."""
    cfg = getattr(conn, "_vllm_config", None)
    if cfg is None:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
    context = cfg.compilation_config.static_forward_context
    out = []
    for name in names if names is not None else list(context):
        kv = getattr(context.get(name), "kv_cache", None)
        if isinstance(kv, (list, tuple)):   # older releases: one per virtual engine
            kv = kv[0] if kv else None
        if kv is not None and hasattr(kv, "data_ptr") and kv.numel():
            out.append(kv)
    return out
