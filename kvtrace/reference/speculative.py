"""Speculative decoding: the drafts a step schedules, the padding of a
one-token admission, the drafter's lookahead slots, and the drafts an output
rejects (semantics doc 2.1, S:861-876, S:1131-1153, S:2110-2128)."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from .kv_transfer import KVTransfer
from .request import Request
from .step import StepPlan


@mypyc_attr(allow_interpreted_subclasses=True)
class SpeculativeDecoding(KVTransfer):
    """A part of the Scheduler (feature.py): its config and requests are ``self``'s."""

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """The drafts the model proposed after an output: each live request keeps
        them for its next step, but a request still prefilling drops them (S:2550-2569)."""
        for req_id, ids in drafts.items():
            r = self.requests.get(req_id)
            if r is None or r.is_finished:
                continue
            r.spec_token_ids = [] if r.is_prefill_chunk else list(ids)

    def _schedule_drafts(self, r: Request, n: int, step: StepPlan) -> None:
        """The drafts among a running request's ``n`` tokens are those past its
        last token; the rest of its drafts are dropped (S:861-876)."""
        k = n + r.num_computed_tokens - r.num_tokens - r.num_output_placeholders
        if k > 0:
            step.spec[r.request_id] = r.spec_token_ids[:k]
        r.spec_token_ids = []

    def _drafts_asked(self, num_requests: int) -> int:
        """The drafts a step that schedules ``num_requests`` requests asks the
        drafter for: num_spec_tokens, or with dynamic speculative decoding the
        table's entry for that batch size (S:1485-1490)."""
        table = self.config.spec_tokens_by_batch_size
        if table is None or not num_requests:
            return self.config.num_spec_tokens
        return table[min(num_requests, len(table) - 1)]

    def spec_decode_step_blocks(self) -> int:
        """Blocks of one decode step with every draft and the drafter's
        lookahead: 1 + num_spec_tokens + num_lookahead_tokens slots, in each
        KV-cache group but state groups, which hold theirs (S:347-357)."""
        k = self.config.num_spec_tokens
        if not k:
            return 0
        slots = 1 + k + self.config.num_lookahead_tokens
        return sum(-(-slots // bs) for bs in self.kv.spec_step_block_sizes)

    def _admission_lookahead(self, r: Request, load_async: bool) -> int:
        """The drafter's lookahead slots an admission allocates. An async load
        runs no model step: its slots come with its first chunk (S:1221-1226).
        Under the legacy profile only an admission that follows a load gets
        them, not one from a fresh lookup (its ``effective_lookahead_tokens``)."""
        if load_async or (r.num_computed_tokens == 0
                          and not self.config.profile.lookahead_at_lookup_admission):
            return 0
        return self.config.num_lookahead_tokens

    def _pads_with_drafts(self, step: StepPlan, num_computed: int) -> bool:
        """A waiting request with one token to compute is padded to a whole
        decode of 1 + num_spec_tokens, when no prefill runs in the step, a
        decode does or the request has KV already, and the padding and the
        token it samples fit in max_model_len (S:1131-1153). Not with dynamic
        speculative decoding (S:1135)."""
        k = self.config.num_spec_tokens
        return (k > 0 and self.config.spec_tokens_by_batch_size is None
                and self.config.profile.pads_one_token_admissions
                and not step.prefill_scheduled
                and bool(step.running or num_computed > 0)
                and num_computed + 1 + k + 1 <= self.max_model_len)

    def _reject_drafts(self, r: Request, num_drafts: int, num_sampled: int) -> None:
        """The sampled tokens are the drafts accepted and one more; the KV of the
        rejected drafts is not the request's, so it is computed again (S:2110-2128)."""
        num_rejected = num_drafts - max(num_sampled - 1, 0)
        if r.num_computed_tokens > 0:
            r.num_computed_tokens -= num_rejected
        if r.num_output_placeholders > 0:
            r.num_output_placeholders -= num_rejected
