"""Replay a trace through the reference scheduler and report every divergence."""

from .replayer import Replayer, ReplayResult, replay_file

__all__ = ["Replayer", "ReplayResult", "replay_file"]
