"""Shadow KV cache: clean schedules stay silent, content bugs are named."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from kvtrace.replay.kv_content import core as sk
from kvtrace.replay.kv_content import torch_backend as tb
from kvtrace.replay.kv_content.device import open_shadow
from kvtrace.replay.kv_content.torch_backend import ShadowKV

B = 4
M = (1 << 64) - 1

# The random runs below check the batched array code of each backend: NumPy, and
# torch on each device it has.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["numpy", "cpu", pytest.param("cuda", marks=CUDA)]


def _same(a, b) -> bool:
    """Two arrays (NumPy or torch, on any device) hold the same values."""
    host = [t.cpu().numpy() if isinstance(t, torch.Tensor) else t for t in (a, b)]
    return host[0].dtype == host[1].dtype and np.array_equal(*host)


# --------------------------------------------------------------------------- reference hash


def _mix_ref(x: int) -> int:
    x &= M
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def _fp_ref(tokens: list[int]) -> list[int]:
    """The documented prefix fingerprint, in plain Python integers, as signed int64."""
    out, acc = [], 1
    for j, t in enumerate(tokens):
        term = _mix_ref((t * 0x9E3779B97F4A7C15 + _mix_ref(j + 0xD1B54A32D192ED03)) & M) & ~1
        acc = (acc + term) & M
        out.append(acc - (1 << 64) if acc >> 63 else acc)
    return out


def test_mix64_matches_unsigned_splitmix():
    rng = random.Random(1)
    xs = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, M, 1 << 63, (1 << 63) - 1]
    got = tb.mix64(torch.tensor([sk.s64(x) for x in xs], dtype=torch.int64)).tolist()
    assert [g & M for g in got] == [_mix_ref(x) for x in xs]


def test_numpy_mix64_and_terms_match_unsigned_splitmix_and_torch():
    from kvtrace.replay.kv_content import numpy_backend as snp

    rng = random.Random(5)
    xs = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, M, 1 << 63, (1 << 63) - 1]
    got = snp.mix64(np.array(xs, dtype=np.uint64)).tolist()
    assert got == [_mix_ref(x) for x in xs]
    toks = [rng.randrange(0, 1 << 63) for _ in range(2000)]   # stand-ins reach 2^63 - 1
    pos = [rng.randrange(0, 1 << 20) for _ in range(2000)]
    mine = snp.token_terms(np.array(toks, dtype=np.int64), np.array(pos, dtype=np.int64))
    theirs = tb.token_terms(torch.tensor(toks), torch.tensor(pos))
    assert mine.view(np.int64).tolist() == theirs.tolist()


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_a_requests_fingerprints_match_the_reference_on_each_backend(device):
    rng = random.Random(6)
    toks = [rng.randrange(0, 1 << 40) for _ in range(300)]
    s = open_shadow(64, B, device)
    s.add_request("r", toks[:100])
    s.append_tokens("r", toks[100:250])
    s.prefix_fingerprints("r")                 # computes the first 250
    s.append_tokens("r", toks[250:])
    assert s.prefix_fingerprints("r").tolist() == _fp_ref(toks)


def test_prefix_fingerprints_match_reference_and_are_odd():
    rng = random.Random(2)
    toks = [rng.randrange(0, 1 << 40) for _ in range(500)]
    got = tb.prefix_fingerprints(toks).tolist()
    assert got == _fp_ref(toks)
    assert all(v & 1 for v in got)


def test_incremental_fingerprints_equal_one_shot():
    rng = random.Random(3)
    toks = [rng.randrange(50_000) for _ in range(300)]
    s = ShadowKV(8, B, "cpu")
    s.add_request("a", toks[:37])
    s.add_request("filler", [1] * 5)
    s.step(0, [], [])
    i = 37
    while i < len(toks):           # grow past the arena segment several times
        k = rng.randrange(1, 9)
        s.append_tokens("a", toks[i:i + k])
        s.append_tokens("filler", [2])
        i += k
        if rng.random() < 0.3:
            s.step(1, [], [])
    assert s.prefix_fingerprints("a").tolist() == _fp_ref(toks)
    assert s.prefix_fingerprints("filler").tolist() == _fp_ref([1] * 5 + [2] * (s.num_tokens("filler") - 5))


def test_fingerprints_separate_tokens_and_positions():
    g = torch.Generator().manual_seed(4)
    n = 200_000
    tok = torch.randint(0, 1 << 31, (n,), generator=g)
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    terms = tb.token_terms(tok, pos)
    pairs = torch.unique(tok * (1 << 20) + pos).numel()
    assert torch.unique(terms).numel() == pairs            # no two distinct (t, j) share a term
    # Same token at different positions, different tokens at one position.
    assert torch.unique(tb.token_terms(torch.full((n,), 7), torch.arange(n))).numel() == n
    assert torch.unique(tb.token_terms(torch.arange(n), torch.full((n,), 7))).numel() == n
    # Prefix fingerprints of many random sequences: equal only for equal prefixes.
    seqs = torch.randint(0, 8, (5000, 12), generator=g)   # small vocab: many shared prefixes
    pos = torch.arange(12).expand_as(seqs)
    fps = torch.cumsum(tb.token_terms(seqs, pos), 1) + sk.FP_INIT
    assert torch.equal(fps[17], tb.prefix_fingerprints(seqs[17]))
    last = fps[:, -1]
    assert torch.unique(last).numel() == torch.unique(seqs, dim=0).shape[0]
    a, b = seqs[0].tolist(), seqs[0].tolist()
    b[-1] = (b[-1] + 1) % 8
    fa, fb = tb.prefix_fingerprints(a), tb.prefix_fingerprints(b)
    assert torch.equal(fa[:-1], fb[:-1]) and fa[-1] != fb[-1]
    # A prefix at a shifted position is a different fingerprint.
    assert tb.prefix_fingerprints(a, start=1)[-1] != fa[-1]


# --------------------------------------------------------------------------- helpers


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def _one(divs, req: str, step: int):
    assert len(divs) == 1, divs
    d = divs[0]
    assert (d.kind, d.field, d.req, d.step) == ("kv-content", "kv-content", req, step)
    return d


def _where(d) -> tuple[int, int, int]:
    m = re.match(r"block (\d+) slot (\d+) \(position (\d+)\)", d.recorded)
    assert m, d.recorded
    return tuple(int(x) for x in m.groups())


def _count(d) -> tuple[int, int]:
    m = re.search(r"(\d+) of (\d+) positions read are wrong", d.recorded)
    assert m, d.recorded
    return int(m.group(1)), int(m.group(2))


# --------------------------------------------------------------------------- clean runs


def test_clean_chunked_prefill_decode_and_shared_prefix():
    s = ShadowKV(32, B, "cpu")
    pa = _prompt(1, 13)
    s.add_request("a", pa)
    ta = [3, 4, 5, 6]
    assert s.step(0, [], [("a", 0, 5, ta)]) == []          # chunked prefill: 5 + 8
    assert s.step(1, [], [("a", 5, 8, ta)]) == []
    s.append_tokens("a", [777])
    for st in range(2, 8):                                   # decode, crossing a block edge
        ntok = 13 + st - 1
        table = ta if ntok <= len(ta) * B else ta + [9]
        assert s.step(st, [], [("a", ntok - 1, 1, table)]) == []
        s.append_tokens("a", [1000 + st])
    # b shares a's first 8 prompt tokens: a prefix-cache hit on blocks 3 and 4.
    pb = pa[:8] + _prompt(2, 6)
    s.add_request("b", pb)
    tb = [3, 4, 11, 12]
    assert s.step(8, [], [("b", 8, 6, tb), ("a", 19, 1, ta + [9])]) == []
    s.append_tokens("b", [5])
    s.append_tokens("a", [6])
    assert s.step(9, [], [("b", 14, 1, tb), ("a", 20, 1, ta + [9])]) == []
    s.drop_request("a")                                      # a finishes; its blocks keep their content
    s.add_request("c", pa[:8] + [1, 2])                      # and still serve an exact hit
    assert s.step(10, [], [("c", 8, 2, [3, 4, 13]), ("b", 15, 0, tb)]) == []
    assert s.slots_checked == 5 + sum(range(13, 19)) + 8 + 19 + 14 + 20 + 8 + 15


def test_clean_external_load_at_block_boundary_and_mid_block():
    s = ShadowKV(16, B, "cpu")
    s.add_request("a", _prompt(3, 14))
    t = [2, 5, 7, 8]
    # local hit 0, external hit 6 (ends mid-block): nct = L + E = 6 is right.
    assert s.step(0, [("a", 0, 6, t)], [("a", 6, 8, t)]) == []
    s.append_tokens("a", [1])
    assert s.step(1, [], [("a", 14, 1, t)]) == []


def test_a_slot_rewritten_with_the_same_prefix_is_fine():
    s = ShadowKV(8, B, "cpu")
    p = _prompt(4, 8)
    s.add_request("a", p)
    s.add_request("b", p)
    assert s.step(0, [], [("a", 0, 8, [1, 2]), ("b", 0, 8, [1, 2])]) == []  # same slots, same content
    s.append_tokens("a", [9])
    s.append_tokens("b", [9])
    assert s.step(1, [], [("a", 8, 1, [1, 2, 3]), ("b", 8, 1, [1, 2, 4])]) == []


# --------------------------------------------------------------------------- the bug classes


def test_async_load_overshoot():
    s = ShadowKV(16, B, "cpu")
    s.add_request("a", _prompt(5, 20))
    t = [4, 6, 9, 10, 11]
    # External hit E = 6 from L = 0, loaded asynchronously; the buggy engine sets
    # nct = cdiv(6, 4) * 4 = 8, so positions 6 and 7 count as computed unloaded.
    assert s.step(0, [("a", 0, 6, t)], []) == []
    d = _one(s.step(1, [], [("a", 8, 12, t)]), "a", 1)
    assert _where(d) == (6, 2, 6)
    assert "never written" in d.recorded
    assert _count(d) == (2, 8)
    assert d.expected == "prefix of a up to position 6"


def test_async_load_overshoot_into_a_reused_block_names_the_old_writer():
    s = ShadowKV(16, B, "cpu")
    s.add_request("old", _prompt(6, 8))
    assert s.step(0, [], [("old", 0, 8, [6, 7])]) == []
    s.drop_request("old")
    s.add_request("a", _prompt(7, 20))
    t = [4, 6, 9, 10, 11]
    s.step(1, [("a", 0, 6, t)], [])
    d = _one(s.step(2, [], [("a", 8, 12, t)]), "a", 2)
    assert _where(d) == (6, 2, 6)
    assert "written by old at step 0 (its position 2)" in d.recorded


def test_missing_reload_after_preemption():
    s = ShadowKV(32, B, "cpu")
    s.add_request("a", _prompt(8, 12))
    ta = [1, 2, 3]
    assert s.step(0, [], [("a", 0, 12, ta)]) == []
    s.append_tokens("a", [5])
    # a is preempted, its blocks are freed and taken by b.
    s.add_request("b", _prompt(9, 12))
    assert s.step(1, [], [("b", 0, 12, [1, 2, 3])]) == []
    # a resumes with an external hit of 8 on fresh blocks 20, 21, 22: nct = 8,
    # but the connector plans no load.
    d = _one(s.step(2, [], [("a", 8, 5, [20, 21, 22, 23])]), "a", 2)
    assert _where(d) == (20, 0, 0)
    assert "never written" in d.recorded and _count(d) == (8, 8)
    # The same resume with the load in place is clean.
    s2 = ShadowKV(32, B, "cpu")
    s2.add_request("a", _prompt(8, 12))
    s2.step(0, [], [("a", 0, 12, ta)])
    s2.append_tokens("a", [5])
    assert s2.step(2, [("a", 0, 8, [20, 21, 22, 23])], [("a", 8, 5, [20, 21, 22, 23])]) == []


def test_missing_reload_on_blocks_another_request_wrote():
    s = ShadowKV(32, B, "cpu")
    s.add_request("a", _prompt(10, 12))
    s.step(0, [], [("a", 0, 12, [1, 2, 3])])
    s.add_request("b", _prompt(11, 12))
    s.step(1, [], [("b", 0, 12, [1, 2, 3])])                # b got a's freed blocks
    d = _one(s.step(2, [], [("a", 8, 4, [1, 2, 3])]), "a", 2)  # resumed onto them, no load
    assert _where(d) == (1, 0, 0)
    assert "written by b at step 1 (its position 0)" in d.recorded


def test_block_freed_while_in_use_and_reused():
    s = ShadowKV(32, B, "cpu")
    s.add_request("a", _prompt(12, 10))
    ta = [5, 6, 7]
    assert s.step(0, [], [("a", 0, 10, ta)]) == []
    s.append_tokens("a", [1])
    # Block 6 is freed while a still runs, and handed to b, which writes it. In the
    # same forward pass b's write lands before a's attention reads: wrong at step 1.
    s.add_request("b", _prompt(13, 6))
    d = _one(s.step(1, [], [("a", 10, 1, ta), ("b", 0, 6, [6, 8])]), "a", 1)
    assert _where(d) == (6, 0, 4)
    assert "written by b at step 1 (its position 0)" in d.recorded
    assert _count(d) == (4, 10)
    s.append_tokens("a", [2])
    s.append_tokens("b", [3])
    d = _one(s.step(2, [], [("a", 11, 1, ta), ("b", 6, 1, [6, 8])]), "a", 2)
    assert _count(d) == (4, 11)


def test_wrong_prefix_cache_hit():
    s = ShadowKV(32, B, "cpu")
    pa = _prompt(14, 8)
    s.add_request("a", pa)
    assert s.step(0, [], [("a", 0, 8, [2, 3])]) == []
    # b's first block matches a's, its second does not, but the cache hands out both.
    pb = pa[:4] + _prompt(15, 4) + [9, 9]
    s.add_request("b", pb)
    d = _one(s.step(1, [], [("b", 8, 2, [2, 3, 4])]), "b", 1)
    assert _where(d) == (3, 0, 4)
    assert "written by a at step 0 (its position 4)" in d.recorded
    assert d.expected == "prefix of b up to position 4"
    assert _count(d) == (4, 8)


def test_one_divergence_per_request_per_step_and_several_requests():
    s = ShadowKV(32, B, "cpu")
    for r in ("a", "b", "c"):
        s.add_request(r, _prompt(ord(r), 9))
    divs = s.step(0, [], [("a", 8, 1, [1, 2, 3]), ("b", 0, 9, [4, 5, 6]), ("c", 5, 4, [7, 8, 9])])
    assert [(d.req, _where(d), _count(d)) for d in divs] == [
        ("a", (1, 0, 0), (8, 8)), ("c", (7, 0, 0), (5, 5))]


def test_table_too_short_and_block_out_of_range():
    s = ShadowKV(8, B, "cpu")
    s.add_request("a", _prompt(16, 12))
    s.step(0, [], [("a", 0, 12, [1, 2, 3])])
    s.append_tokens("a", [1])
    d = _one(s.step(1, [], [("a", 12, 1, [1, 2])]), "a", 1)
    assert "no block" in d.recorded
    d = _one(s.step(2, [], [("a", 12, 1, [1, 2, 99, 4])]), "a", 2)
    assert "outside the cache" in d.recorded and _where(d) == (99, 0, 8)


def test_counts_beyond_known_tokens():
    s = ShadowKV(8, B, "cpu")
    s.add_request("a", _prompt(17, 5))
    s.step(0, [], [("a", 0, 5, [1, 2])])
    d = _one(s.step(1, [], [("a", 7, 1, [1, 2])]), "a", 1)
    assert "only 5 tokens" in d.recorded


def test_duplicate_write_keeps_fingerprint_and_writer_together():
    s = ShadowKV(8, B, "cpu")
    s.add_request("a", _prompt(18, 4))
    s.add_request("b", _prompt(19, 4))
    s.step(0, [], [("a", 0, 4, [3]), ("b", 0, 4, [3])])
    held = s.fp[3].tolist()
    owner = s.ids[s.writer_req[3, 0]]
    assert held == s.prefix_fingerprints(owner).tolist()
    assert s.writer_req[3].unique().numel() == 1


def test_unknown_request_is_an_error():
    s = ShadowKV(8, B, "cpu")
    with pytest.raises(KeyError, match="'x'"):
        s.step(0, [], [("x", 0, 1, [1])])


def test_a_request_told_how_long_it_may_grow_keeps_its_place_in_the_arena():
    rows = {}
    for most in (0, 120):
        s = ShadowKV(64, B, "cpu")
        s.add_request("a", _prompt(30, 10), most=most)
        seen = set()
        toks = _prompt(30, 10)
        for step in range(110):
            table = list(range(1, -(-len(toks) // B) + 1))
            s.step(step, [], [("a", len(toks) - 1, 1, table)])
            seen.add(s._reqs["a"].row)
            extra = [step % 97 + 3]
            s.append_tokens("a", extra)
            toks += extra
        assert s.prefix_fingerprints("a").tolist() == _fp_ref(toks)
        rows[most] = len(seen)
    assert rows[120] == 1 and rows[0] > 2


def test_many_requests_grow_and_compact_the_arena():
    rng = random.Random(20)
    s = ShadowKV(512, B, "cpu")
    live: dict[str, list[int]] = {}
    for i in range(200):
        r = f"r{i}"
        live[r] = _prompt(100 + i, rng.randrange(1, 40))
        s.add_request(r, live[r])
        if i % 3 == 0:
            gone = rng.choice(sorted(live))
            s.drop_request(gone)
            del live[gone]
        for q in rng.sample(sorted(live), min(5, len(live))):
            extra = [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
            s.append_tokens(q, extra)
            live[q] += extra
        s.step(i, [], [])
    for r, toks in live.items():
        assert s.prefix_fingerprints(r).tolist() == _fp_ref(toks)


# --------------------------------------------------------------------------- devices


def test_cpu_device():
    s = ShadowKV(4, B, "cpu")
    assert s.device == torch.device("cpu")
    assert s.fp.shape == (4, B) and s.fp.dtype == torch.int64 and s.fp.device.type == "cpu"
    assert s.writer_req.shape == (4, B) and int(s.writer_req.min()) == -1


def test_auto_device_follows_cuda_availability():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert ShadowKV(4, B).device.type == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        ShadowKV(4, B, "cuda")


def test_bad_device_and_sizes():
    with pytest.raises(ValueError, match="unknown device"):
        ShadowKV(4, B, "tpu")
    with pytest.raises(ValueError, match="num_blocks"):
        ShadowKV(0, B, "cpu")


@CUDA
def test_cuda_matches_cpu():
    outs = []
    for dev in ("cpu", "cuda"):
        s = ShadowKV(32, B, dev)
        s.add_request("a", _prompt(14, 8))
        s.step(0, [], [("a", 0, 8, [2, 3])])
        s.add_request("b", _prompt(14, 4) + _prompt(15, 6))
        outs.append([d.to_json() for d in s.step(1, [], [("b", 8, 2, [2, 3, 4])])])
        assert s.prefix_fingerprints("a").tolist() == _fp_ref(_prompt(14, 8))
    assert outs[0] == outs[1] and len(outs[0]) == 1


# --------------------------------------------------------------------------- batches


def _chaos(seed: int):
    """A random run: requests come, grow and go; steps write and read through
    tables that are right, shared, too short, out of range or plain wrong; loads
    land anywhere. Yields the operations both caches see."""
    rng = random.Random(seed)
    nblocks = 12
    live: dict[str, int] = {}
    tables: dict[str, list[int]] = {}
    n = 0
    for step in range(120):
        if len(live) < 5 or rng.random() < 0.3:
            r = f"r{n}"
            n += 1
            live[r] = rng.randrange(1, 3 * B + 3)
            tables[r] = []
            yield ("add", r, _prompt(1000 + n, live[r]))
        if live and rng.random() < 0.15:
            gone = rng.choice(sorted(live))
            del live[gone]
            yield ("drop", gone)
        loads, sched = [], []
        for r in rng.sample(sorted(live), min(len(live), rng.randrange(1, 5))):
            need = -(-live[r] // B) + rng.choice([0, 0, 0, 1, -1])
            t = tables[r]
            while len(t) < need:
                t.append(rng.randrange(0, nblocks + (2 if rng.random() < 0.05 else 0)))
            if t and rng.random() < 0.05:
                t[rng.randrange(len(t))] = rng.randrange(nblocks)
            c = rng.randrange(0, live[r] + 2)
            k = rng.randrange(0, 2 * B)
            if rng.random() < 0.2:
                loads.append((r, rng.randrange(0, c + 1), c + rng.randrange(0, B), list(t)))
            sched.append((r, c, k, list(t)))
        # State operations: through short positional tables with the null block,
        # into blocks that KV is written to as well; some of another length, out
        # of the table, or past the request's tokens.
        states = []
        for r in rng.sample(sorted(live), min(len(live), rng.randrange(0, 4))):
            t = [0] * rng.randrange(0, 2) + [rng.randrange(0, nblocks + (1 if rng.random() < 0.05 else 0))
                                             for _ in range(rng.randrange(1, 3))]
            for what in rng.sample(["load", "read", "write", "read"], rng.randrange(1, 4)):
                length = rng.randrange(0, live[r] + 2)
                states.append((what, r, length, t,
                               rng.randrange(0, len(t) + (1 if rng.random() < 0.1 else 0))))
        yield ("step", step, loads, sched, states)
        for r in list(live):
            if rng.random() < 0.5:
                extra = [rng.randrange(500) for _ in range(rng.randrange(1, 4))]
                live[r] += len(extra)
                yield ("append", r, extra)


class _SlotModel:
    """The documented step semantics, one slot and one position at a time, in
    plain Python: what the batched tensor code must report, word for word."""

    def __init__(self, num_blocks: int):
        self.nb = num_blocks
        self.tokens: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], tuple] = {}   # (block, slot) -> fp, writer, step, pos, loaded

    def add_request(self, req, toks):
        self.tokens[req] = list(toks)

    def append_tokens(self, req, toks):
        self.tokens[req] += toks

    def drop_request(self, req):
        self.tokens.pop(req, None)

    def _slot(self, table, p):
        b = table[p // B]
        return (b if 0 <= b < self.nb else self.nb, p % B)

    def _write(self, step, req, start, end, table, loaded):
        fps = _fp_ref(self.tokens[req])
        for p in range(max(start, 0), min(end, len(fps), len(table) * B)):
            self.slots[self._slot(table, p)] = (fps[p], req, step, p, loaded)

    def _state(self, step, what, req, n, table, i):
        """A state load or write: slot 0 of the block, the fingerprint of the
        prefix it follows. False when it lands nowhere."""
        fps = _fp_ref(self.tokens[req])
        if not (0 <= i < len(table) and 0 < n <= len(fps)):
            return False
        b = table[i]
        self.slots[(b if 0 <= b < self.nb else self.nb, 0)] = (fps[n - 1], req, step, -n, what == "load")
        return True

    def _state_reads(self, step, states):
        words, late = [], []
        for what, req, n, table, i in states:
            if what != "read":
                continue
            ntok = len(self.tokens[req])
            if not 0 <= i < len(table):
                words.append((req, f"state slot {i}: no block for it (the table has {len(table)} "
                                   f"blocks), but the step starts from the state after {n} tokens", n))
                continue
            if not 0 < n <= ntok:
                words.append((req, f"state slot {i}: the state after {n} tokens is read, but the "
                                   f"request has only {ntok} tokens", n))
                continue
            blk = table[i]
            got = self.slots.get((blk if 0 <= blk < self.nb else self.nb, 0))
            if 0 <= blk < self.nb and got is not None and got[0] == _fp_ref(self.tokens[req])[n - 1]:
                continue
            if not 0 <= blk < self.nb:
                held = f"block id {blk} is outside the cache ({self.nb} blocks)"
            elif got is None:
                held = "never written"
            else:
                _, who, ws, wp, wl = got
                its = f"its state after {-wp} tokens" if wp < 0 else f"its position {wp}"
                held = f"{'loaded for' if wl else 'written by'} {who} at step {ws} ({its})"
            null = " (the null block)" if blk == 0 else ""
            late.append((req, f"state slot {i}, block {blk}{null}: {held}", n))
        return words, late

    def step(self, step, loads, sched, states=()):
        for req, start, end, table in loads:
            self._write(step, req, start, end, table, True)
        for op in states:
            if op[0] == "load":
                self._state(step, *op)
        state_words, state_late = self._state_reads(step, states)
        for req, c, n, table in sched:
            if n > 0:
                self._write(step, req, c, c + n, table, False)
        for op in states:
            if op[0] == "write":
                self._state(step, *op)
        words, late = [], []
        for req, c, _n, table in sched:
            ntok, lim = len(self.tokens[req]), c
            if lim > ntok:
                words.append((req, f"position {ntok}: the request has only {ntok} tokens, but "
                                   f"{c} count as computed", c - 1))
                lim = ntok
            if lim > len(table) * B:
                words.append((req, f"position {len(table) * B}: no block for it (the block table has "
                                   f"{len(table)} blocks), but {c} positions count as computed", c - 1))
                lim = len(table) * B
            fps = _fp_ref(self.tokens[req])
            bad = [p for p in range(max(lim, 0)) if not 0 <= table[p // B] < self.nb
                   or self.slots.get(self._slot(table, p), (0,))[0] != fps[p]]
            if bad:
                p = bad[0]
                blk = table[p // B]
                if not 0 <= blk < self.nb:
                    what = f"block id {blk} is outside the cache ({self.nb} blocks)"
                elif self._slot(table, p) not in self.slots:
                    what = "never written"
                else:
                    _, who, ws, wp, wl = self.slots[self._slot(table, p)]
                    its = f"its state after {-wp} tokens" if wp < 0 else f"its position {wp}"
                    what = f"{'loaded for' if wl else 'written by'} {who} at step {ws} ({its})"
                late.append((req, f"block {blk} slot {p % B} (position {p}): {what}; "
                                  f"{len(bad)} of {lim} positions read are wrong", p))
        state = [{"step": step, "req": req, "recorded": text, "expected": f"state of {req} after {n} tokens"}
                 for req, text, n in state_words + state_late]
        kv = [{"step": step, "req": req, "recorded": text, "expected": f"prefix of {req} up to position {p}"}
              for req, text, p in words + late]
        return state[:len(state_words)] + kv[:len(words)] + state[len(state_words):] + kv[len(words):]


def _words(divs) -> list[dict]:
    return [{"step": d.step, "req": d.req, "recorded": d.recorded, "expected": d.expected} for d in divs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(8))
def test_batched_steps_report_what_single_steps_and_a_slot_model_report(seed, device, monkeypatch):
    """Queued steps, evaluated together, give the same divergences (same words,
    same writers) and leave the same cache as steps checked one at a time, and
    both say what a plain slot-by-slot model of the semantics says, with requests
    added, grown (moving their fingerprints) and dropped in between."""
    monkeypatch.setattr(sk.ShadowCore, "BATCH_STEPS", 7)
    if seed % 2:   # batches also cut by slots read, and heavy steps on their own
        monkeypatch.setattr(sk.ShadowCore, "BATCH_SLOTS", 40)
    one, many, model = open_shadow(12, B, device), open_shadow(12, B, device), _SlotModel(12)
    single: dict[int, list] = {}
    batched: dict[int, list] = {}
    modelled: dict[int, list] = {}
    for op in _chaos(seed):
        if op[0] == "step":
            _, step, loads, sched, states = op
            single[step] = _words(one.step(step, loads, sched, states))
            modelled[step] = model.step(step, loads, sched, states)
            for tag, divs in many.queue(step, loads, sched, tag=step, states=states):
                batched[tag] = _words(divs)
        elif op[0] == "add":   # only one cache is told how long each request may grow
            _, req, toks = op
            one.add_request(req, toks)
            many.add_request(req, toks, most=len(toks) + seed % 4 * 3)
            model.add_request(req, toks)
        else:
            for s in (one, many, model):
                {"append": s.append_tokens, "drop": s.drop_request}[op[0]](*op[1:])
    for tag, divs in many.flush():
        batched[tag] = _words(divs)
    assert single == modelled
    assert batched == single
    assert sum(len(v) for v in single.values()) > 10        # the run did go wrong, often
    said = [d["recorded"] for v in single.values() for d in v]
    assert any(w.startswith("state slot") for w in said)    # states read wrong, too
    assert any("its state after" in w for w in said)        # and KV read where a state was written
    for name in ("fp", "writer_req", "writer_step", "writer_pos", "writer_loaded"):
        assert _same(getattr(one, name), getattr(many, name)), name
    assert (one.slots_checked, one.slots_written, one.slots_loaded) == \
        (many.slots_checked, many.slots_written, many.slots_loaded)


# --------------------------------------------------------------------------- rows already checked


def _steady(seed: int, steps: int = 160):
    """A run that is mostly right, as a real engine's is: chunked prefill then
    decode, prefix hits that share blocks, blocks freed at the end and reused,
    preemption (tables dropped, then written again from the start). Now and then
    a bug: a block freed while still in use and handed to another request, or a
    table entry swapped for another block. Yields what ``_chaos`` yields."""
    rng = random.Random(seed)
    nblocks = 40
    refs = [0] * nblocks
    free = list(range(nblocks))
    rng.shuffle(free)
    toks: dict[str, list[int]] = {}
    goal: dict[str, int] = {}
    done: dict[str, int] = {}          # num_computed_tokens
    tables: dict[str, list[int]] = {}
    n = 0

    def release(t):
        for blk in t:
            refs[blk] -= 1
            if refs[blk] == 0:
                free.append(blk)

    def take():
        blk = free.pop(0)
        refs[blk] += 1
        return blk

    for step in range(steps):
        if len(toks) < 6 and rng.random() < 0.5:
            r = f"r{n}"
            n += 1
            donors = [d for d in toks if done[d] >= B and d in tables]
            if donors and rng.random() < 0.4:     # a prefix hit on another's full blocks
                d = rng.choice(donors)
                k = rng.randint(1, done[d] // B)
                toks[r] = toks[d][:k * B] + _prompt(2000 + n, rng.randint(1, 2 * B))
                tables[r] = tables[d][:k]
                for blk in tables[r]:
                    refs[blk] += 1
                done[r] = k * B
            else:
                toks[r] = _prompt(2000 + n, rng.randint(1, 3 * B + 3))
                tables[r], done[r] = [], 0
            goal[r] = len(toks[r]) + rng.randint(1, 3 * B)
            yield ("add", r, list(toks[r]))
        if toks and rng.random() < 0.03:          # preempted: its blocks go back
            r = rng.choice(sorted(tables))
            release(tables.pop(r))
            done[r] = 0
        if rng.random() < 0.015:                  # bug: freed while in use
            held = [blk for t in tables.values() for blk in t[:-1] if blk not in free]
            if held:
                free.insert(0, rng.choice(held))
        if rng.random() < 0.01 and tables:         # bug: a table names another block
            t = tables[rng.choice(sorted(tables))]
            if t and free:
                t[rng.randrange(len(t))] = free[-1]
        sched = []
        for r in rng.sample(sorted(toks), min(len(toks), 4)):
            t = tables.setdefault(r, [])
            num = min(len(toks[r]) - done[r], rng.randint(1, 2 * B))
            if num <= 0:
                continue
            while len(t) * B < done[r] + num and free:
                t.append(take())
            if len(t) * B < done[r] + num:
                continue
            sched.append((r, done[r], num, list(t)))
            done[r] += num
        yield ("step", step, [], sched)
        for r, c, num, _t in sched:
            if done[r] == len(toks[r]):
                if len(toks[r]) >= goal[r]:
                    release(tables.pop(r, []))
                    for m in (toks, goal, done):
                        del m[r]
                    yield ("drop", r)
                else:
                    tok = [rng.randrange(500)]
                    toks[r] += tok
                    yield ("append", r, tok)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_rows_already_checked_are_skipped_without_changing_a_word(seed, device, monkeypatch):
    """A mostly right run: rows checked before, and not written since, are not
    compared again, yet every divergence is the one a full comparison of every
    read gives, and the one the slot model gives, batched or step by step."""
    monkeypatch.setattr(sk.ShadowCore, "BATCH_STEPS", 9)
    full = open_shadow(40, B, device, skip_checked=False)
    one, many, model = open_shadow(40, B, device), open_shadow(40, B, device), _SlotModel(40)
    got: dict[str, dict[int, list]] = {"full": {}, "one": {}, "many": {}, "model": {}}
    for op in _steady(seed):
        if op[0] == "step":
            _, step, loads, sched = op
            got["model"][step] = model.step(step, loads, sched)
            got["one"][step] = _words(one.step(step, loads, sched))
            for name, s in (("full", full), ("many", many)):
                for tag, divs in s.queue(step, loads, sched, tag=step):
                    got[name][tag] = _words(divs)
        else:
            fn = {"add": "add_request", "append": "append_tokens", "drop": "drop_request"}[op[0]]
            for s in (full, one, many, model):
                getattr(s, fn)(*op[1:])
    for name, s in (("full", full), ("many", many)):
        for tag, divs in s.flush():
            got[name][tag] = _words(divs)
    assert got["one"] == got["model"]
    assert got["many"] == got["model"]
    assert got["full"] == got["model"]
    wrong = sum(bool(v) for v in got["model"].values())
    assert 0 < wrong < len(got["model"]) // 2     # mostly right, and wrong somewhere
    assert full.slots_compared == full.slots_checked == many.slots_checked
    assert many.slots_compared < many.slots_checked / 2
    for name in ("fp", "writer_req", "writer_step", "writer_pos", "writer_loaded"):
        assert _same(full_t := getattr(full, name), getattr(many, name)), name
        assert _same(full_t, getattr(one, name)), name


def test_a_checked_row_written_by_another_request_is_compared_again():
    s = ShadowKV(32, B, "cpu")
    s.add_request("a", _prompt(30, 8))
    ta = [3, 4, 5]
    assert s.step(0, [], [("a", 0, 8, ta)]) == []
    s.append_tokens("a", [1])
    assert s.step(1, [], [("a", 8, 1, ta)]) == []
    compared = s.slots_compared
    s.append_tokens("a", [2])
    assert s.step(2, [], [("a", 9, 1, ta)]) == []
    assert s.slots_compared - compared == 1          # only the partial row
    s.add_request("b", _prompt(31, 2))
    assert s.step(3, [], [("b", 0, 2, [4])]) == []     # block 4, a's second row
    s.append_tokens("a", [3])
    d = _one(s.step(4, [], [("a", 10, 1, ta)]), "a", 4)
    assert _where(d) == (4, 0, 4)
    assert "written by b at step 3 (its position 0)" in d.recorded
    assert _count(d) == (2, 10)
    # Still wrong at the next read: a wrong row is never counted as checked.
    d = _one(s.step(5, [], [("a", 10, 1, ta)]), "a", 5)
    assert _count(d) == (2, 10)


def test_a_read_within_checked_rows_compares_nothing():
    s = ShadowKV(32, B, "cpu")
    s.add_request("a", _prompt(33, 8))
    assert s.step(0, [], [("a", 0, 8, [3, 4, 5])]) == []
    s.append_tokens("a", [1])
    assert s.step(1, [], [("a", 8, 1, [3, 4, 5])]) == []       # rows 0 and 1 checked
    checked, compared = s.slots_checked, s.slots_compared
    assert s.step(2, [], [("a", 6, 0, [3, 4, 5])]) == []       # ends inside row 1
    assert (s.slots_checked - checked, s.slots_compared - compared) == (6, 0)


def test_a_checked_row_under_a_changed_table_is_compared_again():
    s = ShadowKV(32, B, "cpu")
    s.add_request("a", _prompt(32, 8))
    assert s.step(0, [], [("a", 0, 8, [3, 4, 5])]) == []
    s.append_tokens("a", [1])
    assert s.step(1, [], [("a", 8, 1, [3, 4, 5])]) == []
    d = _one(s.step(2, [], [("a", 8, 1, [3, 9, 5])]), "a", 2)
    assert _where(d) == (9, 0, 4)
    assert "never written" in d.recorded


def test_the_memory_replay_reserves_per_slot_is_the_shadow_caches():
    """replay refuses a KV cache whose shadow would not fit before building it,
    from a count of bytes per slot that must match ShadowKV's tensors."""
    from kvtrace.replay.plan import SHADOW_BYTES_PER_SLOT

    kv = ShadowKV(num_blocks=7, block_size=4, device="cpu")
    per_slot = sum(t.element_size() * t.numel() for t in
                   (kv._fp, kv._wreq, kv._wstep, kv._wpos, kv._wload, kv._first)) / ((7 + 1) * 4)
    assert per_slot == SHADOW_BYTES_PER_SLOT


def test_a_tables_ids_follow_every_change_to_it():
    """A table keeps its ids as a C array for the batch, converting only what
    was appended: every other change to the list converts them again, and a
    copy has its own."""
    import copy
    import pickle

    t = sk.Table([5, 6])
    changes = [lambda t: t.append(7), lambda t: t.extend([8, 9]), lambda t: t.__iadd__([1]),
               lambda t: t.__setitem__(0, 4), lambda t: t.__setitem__(slice(1, 3), [2]),
               lambda t: t.__delitem__(0), lambda t: t.pop(), lambda t: t.insert(0, 3),
               lambda t: t.remove(3), lambda t: t.sort(), lambda t: t.sort(reverse=True),
               lambda t: t.sort(key=lambda x: -x), lambda t: t.reverse(),
               lambda t: t.__imul__(2), lambda t: t.clear(), lambda t: t.append(1)]
    for change in changes:
        assert list(t.ids()) == list(t)
        change(t)
        assert list(t.ids()) == list(t)
    t.extend([2, 3])
    t.ids()
    for u in (copy.copy(t), copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        u.append(9)
        t[0] = 7
        assert list(u.ids()) == list(u) == [1, 2, 3, 9] and list(t.ids()) == list(t)
        t[0] = 1


def test_a_block_replaced_in_a_kept_table_is_read_through_its_new_id():
    """The check keeps each request's table from step to step (a Table); a
    block id changed in place is the one the next read goes through."""
    s = open_shadow(8, 4, "numpy")
    s.add_request("a", list(range(8)))
    table = sk.Table([1, 2])
    assert s.step(0, [], [("a", 0, 8, table)]) == []
    assert s.step(1, [], [("a", 8, 0, table)]) == []
    table[1] = 3   # never written
    divs = s.step(2, [], [("a", 8, 0, table)])
    assert [d.recorded for d in divs] == [
        "block 3 slot 0 (position 4): never written; 4 of 8 positions read are wrong"]
