"""Where replay's shadow-KV check runs: ``--device auto|cpu|cuda`` to a
backend, and the shadow cache opened there (``open_shadow``).

Backends: "numpy" (NumPy on the CPU), "cpu" (torch on the CPU), "cuda" (torch
on CUDA). ``--device cpu`` is NumPy: it checks faster than torch on the CPU
(docs/performance.md) and imports in a twentieth of the time, which is most of
a small trace's replay. ``--device cuda`` is torch on CUDA.

``--device auto`` takes CUDA only where it can win: the trace file is at least
``CUDA_MIN_BYTES`` (the size at which replay moves the check to a worker
process, so torch's import overlaps the reading) and its KV cache holds at least
``CUDA_MIN_SLOTS`` slots, and torch sees a CUDA device. Otherwise NumPy. On an
H200 the check on CUDA costs about 0.75 ms per batch of steps whatever its
size, against about 11 ns per compared slot on that machine's CPU: CUDA draws
level at about 65,000 slots compared per batch, and no step reads more slots
than the cache holds. On every trace and schedule measured, CUDA was slower.
Whether torch sees CUDA is asked (importing torch) only when the rest holds.
"""

from __future__ import annotations

import os
from typing import Callable

from .core import ShadowCore

CUDA_MIN_BYTES = 8 << 20
CUDA_MIN_SLOTS = 1 << 20

# Backends replay_file also takes by name, for tests and benchmarks.
BACKENDS = {"numpy": "numpy", "torch-cpu": "cpu"}


def choose(device: str, trace_bytes: int, cache_slots: int, cuda: Callable[[], bool]) -> str:
    """The backend for ``device`` ("auto", "cpu", "cuda", or a backend's name in
    ``BACKENDS``) on a trace of ``trace_bytes`` whose cache holds ``cache_slots``
    slots. ``cuda`` says whether torch sees a CUDA device; it is called only
    when the answer matters."""
    if device in BACKENDS:
        return BACKENDS[device]
    if device == "cpu":
        return "numpy"
    if device == "auto":
        large = trace_bytes >= CUDA_MIN_BYTES and cache_slots >= CUDA_MIN_SLOTS
        return "cuda" if large and cuda() else "numpy"
    return device   # "cuda", "cuda:1": torch checks it


def pick_backend(device: str, path: str | os.PathLike, num_blocks: int, block_size: int) -> str:
    """``choose`` for the trace file ``path``."""
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    return choose(device, size, num_blocks * block_size, _cuda)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def open_shadow(num_blocks: int, block_size: int, device: str, **kwargs) -> ShadowCore:
    """The shadow cache on ``device``: "numpy" (NumPy on the CPU, no torch), or
    a torch device ("cpu", "cuda", "auto": see ``torch_backend.pick_device``)."""
    if device == "numpy":
        from .numpy_backend import NumpyShadowKV

        return NumpyShadowKV(num_blocks, block_size, **kwargs)
    from .torch_backend import ShadowKV

    return ShadowKV(num_blocks, block_size, device, **kwargs)
