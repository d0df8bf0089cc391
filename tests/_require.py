"""Optional dependencies that CI must have: a test module that needs one skips
loudly on a developer's machine without it, and fails in CI (.ci/run sets
KVTRACE_REQUIRE_VLLM=1), so a broken install cannot pass as skipped tests."""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str, why: str):
    if os.environ.get(f"KVTRACE_REQUIRE_{module.upper()}") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{why}; THESE TESTS DID NOT RUN")
