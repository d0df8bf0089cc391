"""A stand-in for torchvision, for tests only: vLLM's Qwen3.5 module imports
transformers' Qwen2-VL image processor, which imports torchvision. Nothing
here processes an image; every function raises. tests/e2e/vllm/test_vllm_state.py puts
this folder on PYTHONPATH of the process that runs a tiny Qwen3.5 (vLLM
inspects models in a process of its own)."""

__version__ = "0.0.0"

from . import io, transforms  # noqa: F401,E402
