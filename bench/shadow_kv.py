"""Throughput of the shadow KV content check, next to the device's memory bandwidth.

    python -m bench.shadow_kv [--device auto|cpu|cuda|numpy] [--num-blocks 4096] [--block-size 16]
                              [--requests 800] [--seed 0] [--threads N]

Two measurements, both on the chosen device (numpy: the NumPy backend, on the
CPU):

* replay: a synthetic continuous-batching schedule (chunked prefill, decode,
  shared-prefix hits, external loads, requests finishing and blocks reused) is
  generated first, then fed through ``ShadowKV``. The schedule is clean, so the
  run must report no divergence. Steps are queued and evaluated in batches, as
  replay runs them. Timed: ``ShadowKV.queue`` and ``flush`` calls alone, and the
  whole feed (add / append / queue / drop, and the last flush).
* full-cache check: every step reads every block of the cache (all requests at
  their full context), which isolates the batched gather-and-compare.

Verified slots are the slot reads checked (the sum of num_computed_tokens over
scheduled requests). Compared slots are those the check actually compared: a
read leaves out the rows it compared before and that nothing has written since
("Reads already checked" in kvtrace/replay/kv_content/core.py). The replay is run
both ways: as replay runs it, and comparing every slot (``skip_checked=False``).
The full-cache check compares every slot. The bound is the device's memory
bandwidth, measured in the same run with a large tensor copy, divided by the 16
bytes the check must move per compared slot (the slot's 8-byte fingerprint and
the expected 8-byte fingerprint). Real traffic is higher (index tensors, the comparison mask), and
a shadow table small enough for the caches can beat a DRAM figure, so the ratio
is a guide, not a law. On a CPU shared with other work, torch's thread pool can
stall on every small op; --threads 1 gives steadier figures there.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from kvtrace.replay.kv_content.core import ShadowCore, Table
from kvtrace.replay.kv_content.device import open_shadow
from kvtrace.replay.kv_content.torch_backend import pick_device

BYTES_PER_SLOT = 16


def _sync(dev: torch.device | str) -> None:
    if getattr(dev, "type", None) == "cuda":
        torch.cuda.synchronize(dev)


def bandwidth(dev: torch.device) -> tuple[float, int]:
    """Best-of copy bandwidth in bytes/s (read + write counted), and the buffer size."""
    nbytes = (1 << 30) if dev.type == "cuda" else (1 << 28)
    a = torch.ones(nbytes // 8, dtype=torch.int64, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(dev)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / best, nbytes


# --------------------------------------------------------------------------- schedule


def make_schedule(num_blocks: int, B: int, n_requests: int, seed: int):
    """A clean continuous-batching schedule. Returns a list of steps; each is a dict
    with 'add' [(req, prompt)], 'append' [(req, tokens)], 'loads', 'scheduled'
    (as ShadowKV.step takes them) and 'drop' [req] (after the step)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(16 * B)]      # shared prefix, 16 blocks
    budget, max_running = 2048, 128
    free = list(range(num_blocks - 1, 0, -1))                      # block 0 is vLLM's null block
    pinned: list[int] | None = None                                # the system prefix's blocks
    waiting = []
    for i in range(n_requests):
        n = rng.randrange(64, 1024)
        body = [rng.randrange(1, 32000) for _ in range(n)]
        shared = rng.random() < 0.4
        waiting.append({"req": f"r{i}", "prompt": (system + body) if shared else body,
                        "shared": shared, "out": rng.randrange(16, 256),
                        "ext": rng.random() < 0.2})
    running: list[dict] = []
    steps = []
    pending_append: list[tuple[str, list[int]]] = []
    prefix_writer: str | None = None
    while waiting or running:
        st = {"add": [], "append": pending_append, "loads": [], "scheduled": [], "drop": []}
        pending_append = []
        left = budget
        # running requests first: decode one token or continue a prefill chunk
        for r in running:
            if left == 0:
                break
            n = min(r["ntok"] - r["c"], left)
            if n <= 0:
                continue
            st["scheduled"].append((r["req"], r["c"], n, list(r["table"])))
            r["c"] += n
            left -= n
        # admit new requests while blocks and budget allow (whole request reserved)
        while waiting and left > 0 and len(running) < max_running:
            w = waiting[0]
            total = len(w["prompt"]) + w["out"]
            hit = 0
            if w["shared"] and pinned is not None:
                hit = len(system)
            need = -(-total // B) - hit // B
            if need > len(free):
                break
            waiting.pop(0)
            table = (pinned[:] if hit else []) + [free.pop() for _ in range(need)]
            r = {"req": w["req"], "ntok": len(w["prompt"]), "c": hit, "table": table,
                 "out_left": w["out"], "pin": bool(hit)}
            st["add"].append((w["req"], w["prompt"]))
            if w["ext"]:                                            # external hit, loaded now
                room = (len(w["prompt"]) - 1 - hit) // B
                e = rng.randrange(0, room + 1) * B
                if e:
                    st["loads"].append((w["req"], hit, hit + e, list(table)))
                    r["c"] = hit + e
            n = min(r["ntok"] - r["c"], left)
            st["scheduled"].append((w["req"], r["c"], n, list(table)))
            r["c"] += n
            left -= n
            if w["shared"] and pinned is None and prefix_writer is None:
                prefix_writer = w["req"]
                r["pins_prefix"] = True
            running.append(r)
        # outputs: requests whose prompt is done sample one token
        still = []
        for r in running:
            if r["c"] == r["ntok"] and any(s[0] == r["req"] for s in st["scheduled"]):
                if r.get("pins_prefix") and pinned is None:
                    pinned = r["table"][: len(system) // B]
                r["out_left"] -= 1
                if r["out_left"] <= 0:
                    st["drop"].append(r["req"])
                    keep = len(system) // B if (r["pin"] or r.get("pins_prefix")) else 0
                    free.extend(r["table"][keep:])
                    continue
                tok = rng.randrange(1, 32000)
                pending_append.append((r["req"], [tok]))
                r["ntok"] += 1
            still.append(r)
        running = still
        steps.append(st)
    return steps


def run_replay(s: ShadowCore, steps) -> tuple[float, float, int]:
    dev = s.device
    t_step = 0.0
    ndiv = 0
    _sync(dev)
    t0 = time.perf_counter()
    for i, st in enumerate(steps):
        for req, toks in st["append"]:
            s.append_tokens(req, toks)
        for req, prompt in st["add"]:
            s.add_request(req, prompt)
        a = time.perf_counter()
        ndiv += sum(len(d) for _, d in s.queue(i, st["loads"], st["scheduled"]))
        t_step += time.perf_counter() - a
        for req in st["drop"]:
            s.drop_request(req)
    a = time.perf_counter()
    ndiv += sum(len(d) for _, d in s.flush())
    _sync(dev)
    t_step += time.perf_counter() - a
    return t_step, time.perf_counter() - t0, ndiv


def run_full_check(num_blocks: int, B: int, dev: str, reps: int) -> tuple[float, int, int]:
    """Every block of the cache read every step: 64 requests of num_blocks/64 blocks each."""
    s = open_shadow(num_blocks, B, dev, skip_checked=False)
    rng = random.Random(1)
    nreq = 64
    per = (num_blocks - 1) // nreq
    sched = []
    for k in range(nreq):
        table = Table(range(1 + k * per, 1 + (k + 1) * per))   # as the check keeps tables
        s.add_request(f"f{k}", [rng.randrange(1, 32000) for _ in range(per * B)])
        sched.append((f"f{k}", 0, per * B, table))
    s.step(0, [], sched)                                            # write everything once
    check = [(r, per * B - 1, 0, t) for r, _, _, t in sched]
    assert s.step(1, [], check) == []
    _sync(s.device)
    t0 = time.perf_counter()
    for i in range(reps):
        s.queue(2 + i, [], check)
    s.flush()
    _sync(s.device)
    return time.perf_counter() - t0, reps * nreq * (per * B - 1), reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shadow_kv", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda", "numpy"), default="auto")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--full-reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0: leave torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = pick_device("cpu" if args.device == "numpy" else args.device)
    B = args.block_size
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        f"cpu ({torch.get_num_threads()} torch threads)"
    backend = str(dev)
    if args.device == "numpy":
        import numpy

        name, backend = f"NumPy {numpy.__version__}", "numpy"

    t0 = time.perf_counter()
    steps = make_schedule(args.num_blocks, B, args.requests, args.seed)
    t_gen = time.perf_counter() - t0
    sched_reqs = sum(len(st["scheduled"]) for st in steps)

    # warm-up on a short prefix of the schedule, then the timed run; in inference
    # mode, as replay runs the check
    with torch.inference_mode():
        run_replay(open_shadow(args.num_blocks, B, backend), steps[:50])
        s = open_shadow(args.num_blocks, B, backend)
        t_step, t_all, ndiv = run_replay(s, steps)
        every = open_shadow(args.num_blocks, B, backend, skip_checked=False)
        t_every, _, ndiv_every = run_replay(every, steps)
        ndiv += ndiv_every
        t_full, full_slots, full_reps = run_full_check(args.num_blocks, B, backend, args.full_reps)
    bw, bw_bytes = bandwidth(dev)
    ceiling = bw / BYTES_PER_SLOT

    print(f"shadow KV check on {backend} [{name}], torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"cache {args.num_blocks} blocks x {B} slots "
          f"({args.num_blocks * B * 8 / 2**20:.1f} MiB of fingerprints); schedule: {args.requests} "
          f"requests, {len(steps)} steps, {sched_reqs} scheduled request-steps "
          f"(generated in {t_gen:.1f} s, not timed)")
    print(f"memory bandwidth, measured now: {bw / 1e9:.1f} GB/s "
          f"(copy of {bw_bytes >> 20} MiB, read + write counted)")
    print(f"bound: {BYTES_PER_SLOT} B moved per compared slot -> {ceiling / 1e6:.0f} M slots/s")
    print()
    rows = [
        ("replay, queue/flush only", s.slots_checked, s.slots_compared, t_step, len(steps)),
        ("replay, whole feed", s.slots_checked, s.slots_compared, t_all, len(steps)),
        ("replay, comparing every slot", every.slots_checked, every.slots_compared, t_every,
         len(steps)),
        ("full-cache check", full_slots, full_slots, t_full, full_reps),
    ]
    hdr = f"{'measurement':<29} {'verified slots':>15} {'compared':>12} {'steps':>6} {'time s':>8} " \
          f"{'us/step':>8} {'M verified/s':>13} {'M compared/s':>13} {'bound M/s':>10} {'of bound':>9}"
    print(hdr)
    print("-" * len(hdr))
    for label, slots, compared, t, n in rows:
        rate = compared / t
        print(f"{label:<29} {slots:>15,} {compared:>12,} {n:>6} {t:>8.3f} {t / n * 1e6:>8.0f} "
              f"{slots / t / 1e6:>13.1f} {rate / 1e6:>13.1f} {ceiling / 1e6:>10.0f} {rate / ceiling:>8.1%}")
    print()
    print(f"slots written {s.slots_written:,}, loaded {s.slots_loaded:,}; "
          f"kv-content divergences on this clean schedule: {ndiv}")
    return 1 if ndiv else 0


if __name__ == "__main__":
    raise SystemExit(main())
