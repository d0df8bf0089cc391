"""The Triton KV digest's chunk and warps, swept on CUDA
(kvtrace/record/vllm/kv_digest_triton.py).

For each of vLLM's two layouts (blocks first; K and V first), 32 layers of
1,024 blocks of 64 KiB, and 64 and 256 random blocks a call: every chunk of
512 to 8,192 words in 4, 8 and 16 warps. Each variant's digests are checked
against the mix in torch, then timed two ways: the kernel alone, launched
back to back by CUDA's clock, and whole calls of ``BlockDigests``. Beside
them, the limit measured in the same run: a copy of 512 MiB (bytes counted
once; a copy reads and writes each).

    python -m bench.kv_digest_sweep        # needs CUDA; about a minute
"""

from __future__ import annotations

import time


def main() -> None:
    import torch

    from kvtrace.record.vllm import kv_digest_triton as kt
    from kvtrace.record.vllm.kv_digest import BlockDigests

    if not torch.cuda.is_available():
        raise SystemExit("bench.kv_digest_sweep: torch sees no CUDA device")
    dev = torch.device("cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def clocked(fn, times: int) -> float:   # seconds a call, by CUDA's clock
        fn()
        torch.cuda.synchronize()
        start.record()
        for _ in range(times):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / times

    flat = torch.empty(1 << 28, dtype=torch.bfloat16, device=dev).normal_()
    out = torch.empty_like(flat)
    copy = flat.numel() * 2 / clocked(lambda: out.copy_(flat), 20) / 1e9
    del flat, out
    print(f"{torch.cuda.get_device_name()}: a copy {copy:,.0f} GB/s (bytes counted once)")
    layouts = {"blocks first [1024, 8, 16, 256]": (1024, 8, 16, 256),
               "K and V first [2, 1024, 16, 8, 128]": (2, 1024, 16, 8, 128)}
    widest = kt.MAX_CHUNK
    try:
        for name, shape in layouts.items():
            cache = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(32)]
            per_block = sum(t.numel() * t.element_size() for t in cache) // 1024
            arrays = BlockDigests(cache, 1024)
            arrays._call = None   # the mix in torch
            g = torch.Generator().manual_seed(0)
            for n in (64, 256):
                blocks = torch.randperm(1024, generator=g)[:n].tolist()
                want = arrays(blocks)
                for chunk in (512, 1024, 2048, 4096, 8192):
                    for warps in (4, 8, 16):
                        kt.MAX_CHUNK = chunk
                        d = BlockDigests(cache, 1024)
                        if d.kernel_off is not None:
                            raise SystemExit(f"no kernel: {d.kernel_off}")
                        kernel = d._call
                        kernel.warps = warps
                        if d(blocks) != want:
                            raise SystemExit(f"{name}, chunk {chunk}, {warps} warps: the "
                                             f"digests differ from the mix in torch's")
                        idx = torch.tensor(blocks, device=dev)
                        parts = torch.empty((n, kernel.layers, kernel.grid_x),
                                            dtype=torch.int64, device=dev)
                        alone = per_block * n / clocked(lambda: kernel.launch(idx, parts), 50)
                        t = time.perf_counter()
                        for _ in range(20):
                            d(blocks)
                        call = 20 * per_block * n / (time.perf_counter() - t)
                        print(f"  {name:36} {n:3} blocks  chunk {chunk:5}  {warps:2} warps   "
                              f"kernel alone {alone / 1e9:6,.0f} GB/s = {alone / 1e9 / copy:4.0%}"
                              f"   whole calls {call / 1e9:6,.0f} GB/s = {call / 1e9 / copy:4.0%}"
                              f" of a copy")
            del cache
            torch.cuda.empty_cache()
    finally:
        kt.MAX_CHUNK = widest


if __name__ == "__main__":
    main()
