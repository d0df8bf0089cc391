"""The KV digest's Triton kernel (kvtrace/record/vllm/kv_digest_triton.py)
gives the documented digest on every layout it takes, and refuses the rest.

Without a GPU the kernel runs under Triton's interpreter, on the CPU, in a
process of its own (the interpreter is chosen when the kernel is defined);
on CUDA it runs as compiled, in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests._paths import REPO
from tests._require import require

require("triton", "the KV digest's kernel for CUDA is written in Triton (vLLM brings it)")


def _layers(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: str,
            seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-100, 100, shape, generator=g).to(dtype).to(device)
            for shape, dtype in shapes]


def _run_kernel(layers: list[torch.Tensor], num_blocks: int):
    """A BlockDigests whose digests come from the Triton kernel alone."""
    from kvtrace.record.vllm.kv_digest import BlockDigests

    d = BlockDigests(layers, num_blocks)
    d._call, d.kernel_off = None, None
    d._triton_setup()
    return d


def check_layouts(device: str) -> None:
    """Each case: the kernel runs (nothing turns it off), its digests are the
    documented ones, and it loads two words at a time exactly where every
    start is 16 bytes apart."""
    from kvtrace.record.vllm import kv_digest_triton as kt
    from kvtrace.record.vllm.kv_digest import BlockDigests
    from tests.unit.replay.test_data_path import _digest_as_documented

    assert kt.interpreted() is (device == "cpu")   # on CUDA, compiled

    def offset(t: torch.Tensor) -> torch.Tensor:   # the same values, 8 bytes further on
        room = torch.empty(t.numel() * t.element_size() + 8, dtype=torch.uint8, device=t.device)
        moved = room[8:].view(t.dtype).view(t.shape)
        moved.copy_(t)
        return moved

    cases = {   # name: (layers, blocks, pairs)
        "blocks-first": (_layers([((20, 2, 4, 16), torch.bfloat16)] * 3, device), 20, True),
        "k-and-v-first": (_layers([((2, 20, 4, 8), torch.float16)] * 3, device), 20, True),
        "float32": (_layers([((20, 2, 4, 16), torch.float32)] * 2, device), 20, True),
        "odd-words": (_layers([((2, 20, 3, 2), torch.float32)] * 2, device), 20, False),
        "mixed": (_layers([((2, 9, 4, 9), torch.float32), ((9, 2, 4, 16), torch.bfloat16),
                           ((9, 3, 2), torch.float32)], device), 9, False),
        "off-16-bytes": ([offset(t) for t in _layers([((12, 2, 4, 8), torch.bfloat16)] * 2,
                                                     device)], 12, False),
    }
    for name, (layers, num_blocks, pairs) in cases.items():
        d = _run_kernel(layers, num_blocks)
        assert isinstance(d._call, kt.TritonDigests), (name, d.kernel_off)
        assert d._call.pairs is pairs, name
        cpu = [t.cpu() for t in layers]
        for blocks in ([1, 2, 3], list(range(num_blocks)), [num_blocks - 1], [4, 4]):
            assert d(blocks) == _digest_as_documented(cpu, num_blocks, blocks), (name, blocks)
        assert d.kernel_off is None and d._checked, name
        assert len(set(d(list(range(num_blocks))))) == num_blocks
        # And the same as the array path's, which the kernel is checked against.
        arrays = BlockDigests(layers, num_blocks)
        arrays._call = None
        assert arrays(list(range(num_blocks))) == d(list(range(num_blocks))), name

    # A block of many chunks: each part split over several programs.
    layers = _layers([((2, 6, 8, 16), torch.float32)] * 2, device)
    kt.MAX_CHUNK, before = 16, kt.MAX_CHUNK
    try:
        d = _run_kernel(layers, 6)
        assert d._call.chunk == 16 and d._call.grid_x == 2 * 4
        assert d([5, 0, 3]) == _digest_as_documented([t.cpu() for t in layers], 6, [5, 0, 3])
    finally:
        kt.MAX_CHUNK = before

    # More blocks than one call takes (BlockDigests splits them).
    layers = _layers([((300, 2, 4), torch.float32)], device)
    d = _run_kernel(layers, 300)
    blocks = list(range(299, -1, -1))
    assert d(blocks) == _digest_as_documented([layers[0].cpu()], 300, blocks)


def check_refusals(device: str) -> None:
    """Layers the kernel cannot read in place as 64-bit words are left to
    the array path, which says why."""
    odd_bytes = _layers([((20, 3, 5), torch.uint8)], device)
    d = _run_kernel(odd_bytes, 20)
    assert d._call is None and "64-bit words in place" in d.kernel_off
    room = torch.zeros(8 * 20 * 2 + 4, dtype=torch.uint8, device=device)
    off_8 = room[4:].view(20, 2, 8)   # 16 bytes a block, starting 4 bytes in
    d = _run_kernel([off_8], 20)
    assert d._call is None and "64-bit words in place" in d.kernel_off
    room[4 + 16 * 7] = 1
    assert d([7, 6]) == [d([7])[0], 0] and d([7])[0] != 0


def _interpreted(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = ("import tests.unit.record.vllm.test_kv_digest_triton as m; "
            f"m.{check}('cpu')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_kernel_gives_the_documented_digest_on_every_layout_interpreted():
    _interpreted("check_layouts")


def test_layers_the_kernel_cannot_read_are_left_to_the_array_path_interpreted():
    _interpreted("check_refusals")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_gives_the_documented_digest_on_every_layout_on_cuda():
    check_layouts("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layers_the_kernel_cannot_read_are_left_to_the_array_path_on_cuda():
    check_refusals("cuda")
