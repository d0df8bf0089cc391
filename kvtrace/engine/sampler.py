"""The token sampler: what the model would return for one step.

A request gets exactly one token in a step iff that step is not a prefill chunk
(after schedule(), its whole sequence is computed). The token is a hash of the
seed, the request id and the token's position, so a request re-prefilled after
a preemption samples the same tokens again. Tokens are drawn right after
schedule(): under async scheduling the output comes back a step later, and the
token's position counts the tokens of the steps still in flight before it.
"""

from __future__ import annotations

from kvtrace.reference import Scheduler, SchedulerOutput

from .chance import below, unit

EOS_TOKEN_ID = 2
FIRST_ORDINARY_TOKEN = 3   # 0..2 are reserved (pad, bos, eos)


class Sampler:
    def __init__(self, seed: int, vocab_size: int, eos_probability: float = 0.0):
        self.seed = seed
        self.vocab_size = vocab_size
        self.eos_probability = eos_probability

    def token(self, req_id: str, position: int) -> int:
        if self.eos_probability and unit(self.seed, "eos", req_id, position) < self.eos_probability:
            return EOS_TOKEN_ID
        span = self.vocab_size - FIRST_ORDINARY_TOKEN
        return FIRST_ORDINARY_TOKEN + below(span, self.seed, "token", req_id, position)

    def sample(self, sched: Scheduler, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id in out.num_scheduled_tokens:
            r = sched.requests[req_id]
            if not r.is_prefill_chunk:
                ahead = max(r.num_output_placeholders - 1, 0)   # tokens in flight before it
                sampled[req_id] = [self.token(req_id, r.num_tokens + ahead)]
        return sampled
