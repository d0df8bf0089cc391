"""Align two traces request by request and report where they first disagree."""

from .align import DiffResult, diff_files  # noqa: F401
