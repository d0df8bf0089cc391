"""Where the tests find the repository: its traces, docs and code, and the
tests' own helpers, from a test in any folder under tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
