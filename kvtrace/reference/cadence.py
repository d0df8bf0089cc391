"""Prefill throttling: steps in which prefills are held back so that decodes
run in longer stretches (S:750-791 of vLLM 0.33; S:636-640 of 0.32).

A step defers prefills when some running request decodes and either

* the engine core asks for it (``schedule(throttle_prefills=True)``: vLLM's
  data-parallel engine core does, on steps off its shared cadence), or
* under the 0.33 profile, without data parallelism,
  ``prefill_schedule_interval`` executed steps have not passed since the last
  step that carried a prefill,

unless the last step that released prefills could not drain the waiting
queue (``capacity_bound``: throttling would then starve it). A deferring
step schedules no running prefill chunk, and its waiting pass stops at the
first request with more than one token to compute.
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class PrefillCadence:
    def __init__(self, interval: int, local: bool):
        # The interval this scheduler applies itself (1: none).
        self.interval = interval if local else 1
        self.num_executed_steps = 0            # steps that scheduled a token
        self.last_prefill_step = -self.interval  # so that the first step is never held
        self.capacity_bound = False

    def defers(self, throttle_prefills: bool, decoding: bool) -> bool:
        """Whether this step holds prefills back. ``decoding``: some running
        request is past its prefill."""
        if not decoding or self.capacity_bound:
            return False
        if throttle_prefills:
            return True
        return (self.interval > 1
                and (self.num_executed_steps + 1) - self.last_prefill_step < self.interval)

    def released(self, num_waiting: int, num_deferred: int) -> None:
        """After the waiting pass of a step that did not defer: was it bound by
        capacity, leaving waiting requests it did not skip? (S:1612-1616)"""
        self.capacity_bound = num_waiting > num_deferred

    def step_done(self, scheduled_tokens: bool, carried_prefill: bool) -> None:
        """The step is built: count it, and restart the interval from it if it
        carried a prefill (S:1619-1629)."""
        if scheduled_tokens:
            self.num_executed_steps += 1
        if self.interval > 1 and carried_prefill:
            self.last_prefill_step = self.num_executed_steps
