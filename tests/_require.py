"""Optional dependencies that CI must have: a test module that needs one skips
loudly on a developer's machine without it, and fails in CI (.ci/run sets
KVTRACE_REQUIRE_VLLM=1), so a broken install cannot pass as skipped tests."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest


def require(module: str, why: str, load: bool = True):
    """``module``, imported; with ``load`` False, only found (None returned):
    a module whose import changes the process for the tests after it (LMCache
    loads numba's llvmlite, which breaks vLLM engines started later unless
    kvtrace.lab.lmcache_connectors, which the engine imports, has patched it)."""
    required = os.environ.get(f"KVTRACE_REQUIRE_{module.upper()}") == "1"
    if not load:
        if importlib.util.find_spec(module) is not None:
            return None
        if required:
            raise ModuleNotFoundError(f"No module named {module!r}: {why}")
        pytest.skip(f"{why}; THESE TESTS DID NOT RUN", allow_module_level=True)
    if required:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{why}; THESE TESTS DID NOT RUN")
