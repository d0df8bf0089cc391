"""Async scheduling: the engine schedules step N+1 before step N's output
comes back. A decoding request holds one output placeholder per sampled token
still to come, counted inside ``num_computed_tokens``; the output takes them
back and caches the blocks its tokens filled (AS:25-78)."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from .interface import SchedulerAssertion
from .request import Request, Status
from .sessions import Sessions


@mypyc_attr(allow_interpreted_subclasses=True)
class AsyncOutput(Sessions):
    """A part of the Scheduler (feature.py): its config is ``self``'s."""

    def _reached_max_tokens(self, r: Request) -> bool:
        """The steps in flight already sample the request's last token, so
        another one would be wasted (S:664-678)."""
        return (r.num_output_placeholders > 0
                and r.num_computed_tokens + 2 - r.num_output_placeholders
                >= r.num_prompt_tokens + r.max_tokens)

    def _hold_placeholders(self, r: Request, num_drafts: int, drafts_asked: int) -> None:
        """A step that samples for ``r``: a placeholder for the token it samples
        (none for a pooling model) and for each of its ``num_drafts`` drafts.
        The next step's drafts are placeholders too, filled in by the model
        runner, never seen here (AS:25-53)."""
        r.num_output_placeholders += self.config.num_sampled_tokens_per_step + num_drafts
        if self.config.num_spec_tokens:
            r.spec_token_ids = [-1] * drafts_asked

    def _take_placeholders(self, r: Request, num_given: int, num_kept: int, stale: bool) -> None:
        """The sampled tokens replace their placeholders (a stale output's were
        zeroed at preemption): those kept (AS:59-71), or under the 0.33 profile
        every token given, and a stop that trimmed some takes them back from
        num_computed_tokens as well (S:2756-2770)."""
        if stale:
            return
        if self.config.profile.stop_trims_computed:
            r.num_computed_tokens -= num_given - num_kept
            taken = num_given if r.num_output_placeholders > 0 else 0
        else:
            taken = num_kept if self.config.async_scheduling else 0
        r.num_output_placeholders -= taken
        if r.num_output_placeholders < 0:
            raise SchedulerAssertion(r.request_id, "AS:70 more sampled tokens than placeholders")

    def _cache_output_blocks(self, r: Request, stale: bool, status_before: Status,
                             had_placeholders: bool) -> None:
        """The blocks the output's tokens complete become hash-visible: under
        async scheduling up to the tokens not in flight (AS:73-77), and under
        the 0.33 profile also when decoding speculatively, never for a stale
        output (S:2406-2415)."""
        if status_before != Status.RUNNING:
            return
        if self.config.profile.cache_blocks_at_output:
            if not stale and (had_placeholders or self.config.num_spec_tokens > 0):
                self.kv.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
        elif self.config.async_scheduling:
            self.kv.cache_blocks(r, r.num_computed_tokens - r.num_output_placeholders)
