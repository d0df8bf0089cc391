"""Recorder overhead on a real vLLM engine.

Two engines live in this process, built from the same arguments: one plain and
one with the kvtrace recorder wrapped around its scheduler (exactly what the
vLLM plugin does when KVTRACE_OUT is set). Rounds alternate between them, each
round on fresh prompts given to both, and the figure is the median of the
per-round ratio recorded / unrecorded wall time of ``LLM.generate``. The limit is
the engine's own time: the target is a ratio of at most 1.03.

    python -m bench.recorder_overhead [--rounds 7] [--requests 48]

Needs the [vllm] extra.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

TARGET = 1.03


def _prompts(rnd: random.Random, n: int) -> list[list[int]]:
    families = [[rnd.randrange(1, 500) for _ in range(40)] for _ in range(4)]
    return [families[i % 4] + [rnd.randrange(1, 500) for _ in range(rnd.randrange(8, 40))]
            for i in range(n)]


def run(rounds: int = 7, requests: int = 48, max_tokens: int = 48, suffix: str = ".jsonl.zst") -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        os.environ.setdefault(var, str(scratch / var.lower()))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("KVTRACE_OUT", None)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtrace.record import vllm_plugin
    from kvtrace.record.tiny_model import ensure_tiny_model
    from kvtrace.record.vllm_run import BASE_ENGINE, shutdown_llm

    vllm_plugin.install()
    model = str(ensure_tiny_model())
    engine = dict(BASE_ENGINE, num_gpu_blocks_override=48, max_num_seqs=16)
    plain = LLM(model=model, **engine)
    trace = scratch / f"overhead{suffix}"
    os.environ["KVTRACE_OUT"] = str(trace)
    recorded = LLM(model=model, **engine)
    os.environ.pop("KVTRACE_OUT")

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    rnd = random.Random(0)

    def timed(llm, prompts) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    warm = _prompts(rnd, requests)
    timed(plain, warm)
    timed(recorded, warm)
    ratios, plain_s, rec_s = [], [], []
    for i in range(rounds):
        prompts = _prompts(rnd, requests)
        if i % 2 == 0:      # alternate which engine goes first
            a = timed(plain, prompts)
            b = timed(recorded, prompts)
        else:
            b = timed(recorded, prompts)
            a = timed(plain, prompts)
        plain_s.append(a)
        rec_s.append(b)
        ratios.append(b / a)
    shutdown_llm(recorded)
    shutdown_llm(plain)
    steps = _count_steps(trace)
    steps_per_round = steps / (rounds + 1) if steps else 0
    return {
        "steps_per_round": steps_per_round,
        "engine_ms_per_step": 1e3 * statistics.median(plain_s) / steps_per_round if steps else 0.0,
        "recorder_us_per_step": (1e6 * (statistics.median(rec_s) - statistics.median(plain_s))
                                 / steps_per_round) if steps else 0.0,
        "rounds": rounds,
        "requests_per_round": requests,
        "unrecorded_s_median": statistics.median(plain_s),
        "recorded_s_median": statistics.median(rec_s),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "trace_bytes": trace.stat().st_size if trace.exists() else 0,
        "target": TARGET,
    }


def _count_steps(trace: Path) -> int:
    from kvtrace.trace import TraceReader
    from kvtrace.trace.events import Step

    if not trace.exists():
        return 0
    return sum(1 for e in TraceReader(trace) if isinstance(e, Step))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--suffix", default=".jsonl.zst", help="trace file ending: .jsonl, .jsonl.gz, .jsonl.zst")
    args = ap.parse_args()
    r = run(args.rounds, args.requests, suffix=args.suffix)
    print(f"recorder overhead on vLLM ({r['rounds']} interleaved rounds of {r['requests_per_round']} requests)")
    print(f"  unrecorded generate, median  {r['unrecorded_s_median']:.3f} s")
    print(f"  recorded generate, median    {r['recorded_s_median']:.3f} s")
    print(f"  ratio recorded/unrecorded    median {r['ratio_median']:.3f}  "
          f"(min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f})  target <= {TARGET:.2f}")
    print(f"  per step: engine {r['engine_ms_per_step']:.2f} ms, recorder {r['recorder_us_per_step']:.0f} us "
          f"({r['steps_per_round']:.0f} steps per round)")


if __name__ == "__main__":
    main()
