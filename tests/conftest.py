"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtrace.engine import FAULT_WORKLOADS, record_embedded

# A report written to a pipe is 160 columns wide unless COLUMNS says otherwise
# (kvtrace/report/terminal.py), and the tests read reports as a pipe gets them:
# neither a shell's COLUMNS nor the 80 that pytest-xdist's workers are given
# may wrap a phrase a test looks for.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


@pytest.fixture(scope="session")
def faulty(tmp_path_factory) -> Path:
    """An embedded-engine trace whose KV goes wrong several times, among counter
    divergences. Tests only read it."""
    d = tmp_path_factory.mktemp("faulty")
    return record_embedded(d / "t.jsonl", workload=FAULT_WORKLOADS["no-reload-after-preempt"],
                           fault="no-reload-after-preempt").path
