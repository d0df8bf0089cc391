"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.engine import FAULT_WORKLOADS, record_embedded


@pytest.fixture(scope="session")
def faulty(tmp_path_factory) -> Path:
    """An embedded-engine trace whose KV goes wrong several times, among counter
    divergences. Tests only read it."""
    d = tmp_path_factory.mktemp("faulty")
    return record_embedded(d / "t.jsonl", workload=FAULT_WORKLOADS["no-reload-after-preempt"],
                           fault="no-reload-after-preempt").path
