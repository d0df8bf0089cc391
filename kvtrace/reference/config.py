"""The scheduler settings that change its decisions (semantics doc 7.1)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int                      # including the null block 0
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool = True
    policy: str = "fcfs"                 # "fcfs" or "priority"
    long_prefill_token_threshold: int = 0
    max_num_scheduled_tokens: int | None = None
    watermark_blocks: int = 0
    load_failure_policy: str = "fail"    # what a failed KV load does: "fail" or "recompute"

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens
