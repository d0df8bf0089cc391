"""The KV data path: the digests of real block bytes that the recorder takes
where the connector's worker side runs (kvtrace.record.vllm.kv_audit), and the
checks replay makes of them (kvtrace.replay.data_path, rules D1-D3)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

from kvtrace.record.vllm.kv_digest import BlockDigests
from kvtrace.replay.data_path import D1, D2, D3, DataPath
from kvtrace.trace.events import KVAudit

from tests._paths import REPO


def audit(step, loaded=(), saved=(), cached=(), hits=()):
    return KVAudit(seq=step, step=step, view="metadata", loaded=list(loaded), saved=list(saved),
                   cached=list(cached), hits=list(hits))


def rules(divs):
    return [(d.step, d.req, d.rule[:2]) for d in divs]


def test_a_load_of_the_saved_bytes_passes_and_a_missing_or_wrong_one_does_not():
    dp = DataPath()
    dp.feed(audit(0, saved=[("a", 3, "h1", 111), ("a", 4, "h2", 222)], cached=[("a", 3, "h1", 111)]))
    ok = dp.feed(audit(5, loaded=[("b", 7, "h1", 999, 111, True, True)]))
    missing = dp.feed(audit(6, loaded=[("c", 8, "h2", 555, 555, True, False)]))
    wrong = dp.feed(audit(7, loaded=[("d", 9, "h2", 555, 556, True, True)]))
    assert ok == []
    assert rules(missing) == [(6, "c", "D1")] and missing[0].rule == D1
    assert "block 8 not loaded" in missing[0].recorded
    assert rules(wrong) == [(7, "d", "D2")] and wrong[0].rule == D2
    assert dp.checked["loads"] == 3 and dp.checked["saves"] == 2


def test_an_unchanged_block_that_already_held_the_hash_is_loaded():
    """A block given back and taken again still holds the hash's bytes: the
    load that writes the same bytes, or none, leaves it right."""
    dp = DataPath()
    dp.feed(audit(0, cached=[("a", 3, "h1", 111)]))
    assert dp.feed(audit(4, loaded=[("b", 3, "h1", 111, 111, True, False)])) == []


def test_no_comparison_is_made_across_recomputation():
    """The same tokens computed twice, in other batches and blocks, give other
    bytes: neither a load of one computation's save nor a hit on the block of
    the other is flagged; a load is held to the saves only."""
    dp = DataPath()
    dp.feed(audit(0, saved=[("a", 1, "h", 10)], cached=[("a", 1, "h", 10)]))
    dp.feed(audit(9, cached=[("b", 2, "h", 20)]))                        # recomputed elsewhere
    assert dp.feed(audit(10, hits=[("c", 2, "h", 20)])) == []             # its own bytes
    assert dp.feed(audit(11, loaded=[("d", 5, "h", 0, 10, True, True)])) == []   # the save's
    flagged = dp.feed(audit(12, loaded=[("e", 6, "h", 0, 20, True, True)]))
    assert rules(flagged) == [(12, "e", "D2")]   # bytes computed, never saved: not a copy


def test_a_load_with_no_save_seen_is_counted_not_flagged():
    """A store filled before the trace began (or a black-box connector, whose
    saves are not known): a load that changed the block cannot be judged."""
    dp = DataPath()
    assert dp.feed(audit(3, loaded=[("a", 4, "h", 1, 2, True, True)])) == []
    assert dp.checked["unchecked loads"] == 1


def test_a_prefix_hit_on_an_overwritten_block_is_flagged():
    dp = DataPath()
    dp.feed(audit(0, cached=[("a", 3, "h1", 111), ("a", 4, "h2", 222)]))
    assert dp.feed(audit(2, hits=[("b", 3, "h1", 111)])) == []
    over = dp.feed(audit(3, hits=[("c", 3, "h1", 112)]))
    other = dp.feed(audit(4, hits=[("d", 4, "h9", 222)]))
    assert rules(over) == [(3, "c", "D3")] and over[0].rule == D3
    assert "overwritten since step 0" in over[0].recorded
    assert rules(other) == [(4, "d", "D3")] and "holds block hash h2" in other[0].recorded


def test_a_block_filled_with_no_hash_yet_is_compared_with_nothing_later():
    """Under async scheduling a decode's last token is a placeholder when its
    step is scheduled: the block it fills has no hash yet. What the block held
    before is forgotten, so a later hit on it is not held to old bytes."""
    dp = DataPath()
    dp.feed(audit(0, cached=[("a", 3, "h1", 111)]))
    dp.feed(audit(5, cached=[("b", 3, "", 222)]))
    assert dp.feed(audit(9, hits=[("c", 3, "h2", 222)])) == []
    assert dp.checked["filled"] == 1


def test_within_a_step_loads_and_fills_come_before_hits():
    """A step's hit may be on a block the same step filled, or one its loads
    wrote over (ExampleConnector loads a whole prompt, shared blocks too)."""
    dp = DataPath()
    dp.feed(audit(0, saved=[("a", 3, "h1", 5)], cached=[("a", 3, "h1", 4)]))
    assert dp.feed(audit(1, loaded=[("b", 3, "h1", 4, 5, False, True)], hits=[("c", 3, "h1", 5)],
                         cached=[("c", 6, "h7", 70)])) == []
    assert dp.feed(audit(2, cached=[("e", 8, "h8", 80)], hits=[("f", 8, "h8", 80)])) == []


# -- the digests -------------------------------------------------------------------


@pytest.mark.parametrize("shape, dim", [((12, 2, 4, 16), 0), ((2, 12, 4, 2, 8), 1), ((12, 3, 5), 0)],
                         ids=["blocks-first", "k-and-v-first", "odd-bytes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_digest_changes_with_any_byte_of_its_block_and_no_other(shape, dim, dtype):
    g = torch.Generator().manual_seed(1)
    layers = [torch.randint(0, 200, shape, generator=g).to(dtype) for _ in range(3)]
    d = BlockDigests(layers, 12)
    before = d([0, 5, 11])
    assert before == d([0, 5, 11]) and len(set(before)) == 3
    for layer in range(3):
        for _ in range(5):
            block = layers[layer].select(dim, 5)   # a view: writes reach the cache
            idx = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in block.shape)
            old = block[idx].clone()
            block[idx] = old + 1
            after = d([0, 5, 11])
            assert after[0] == before[0] and after[2] == before[2]
            assert after[1] != before[1]
            block[idx] = old
            assert d([0, 5, 11]) == before
    # Other blocks' bytes do not matter.
    layers[0].select(dim, 3).fill_(7)
    assert d([0, 5, 11]) == before


def test_equal_bytes_in_two_blocks_give_equal_digests():
    t = torch.randn(6, 2, 4, 8).to(torch.bfloat16)
    t[4] = t[1]
    d = BlockDigests([t], 6)
    a, b = d([1, 4])
    assert a == b


def test_the_digest_needs_the_block_dimension():
    with pytest.raises(ValueError, match="no dimension of 10 blocks"):
        BlockDigests([torch.zeros(4, 5)], 10)
    with pytest.raises(ValueError, match="no dimension of 8 blocks"):
        BlockDigests([torch.zeros(4, 5, 8)], 8)   # blocks come first or second in vLLM's layouts
    with pytest.raises(ValueError, match="more than one dimension of 4 blocks"):
        BlockDigests([torch.zeros(4, 4, 8)], 4)
    assert BlockDigests([torch.zeros(6, 2, 6)], 6).layers[0][1] == 0   # a head size may match


@pytest.mark.parametrize("bit", [63, 62, 33, 31, 0])
def test_the_same_bit_flipped_in_two_words_changes_the_digest(bit):
    """A weighted sum of words modulo 2^64 cannot see two flips of a high bit
    (2^63 times any odd weight is 2^63): the words are mixed first."""
    t = torch.zeros(3, 64, dtype=torch.int64)
    d = BlockDigests([t], 3)
    before = d([1])[0]
    seen = set()
    for i, j in [(0, 1), (2, 9), (5, 40), (62, 63), (10, 11)]:
        for k in (i, j):
            t[1, k] ^= -(1 << 63) if bit == 63 else 1 << bit
        seen.add(d([1])[0])
        for k in (i, j):
            t[1, k] ^= -(1 << 63) if bit == 63 else 1 << bit
    assert before not in seen and len(seen) == 5
    assert d([1])[0] == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape, dim", [((12, 2, 4, 16), 0), ((2, 12, 4, 2, 8), 1), ((12, 3, 5), 0)],
                         ids=["blocks-first", "k-and-v-first", "odd-bytes"])
def test_the_same_bytes_give_the_same_digest_on_cuda_as_on_the_cpu(shape, dim):
    g = torch.Generator().manual_seed(2)
    layers = [torch.randint(0, 250, shape, generator=g).to(torch.bfloat16) for _ in range(4)]
    blocks = [0, 3, 7, 11, 5]
    cpu = BlockDigests(layers, 12)(blocks)
    on_cuda = BlockDigests([t.cuda() for t in layers], 12)
    cuda = on_cuda(blocks)
    assert cuda == cpu and len(set(cpu)) == len(blocks)
    # The Triton kernel gave them, but where a block is no whole number of words.
    assert (on_cuda.kernel_off is None) == (shape != (12, 3, 5)), on_cuda.kernel_off


def test_a_negative_answer_of_vllms_example_connector_is_read_and_flagged():
    """traces/data-path/negative-external-hit: vLLM 0.32's ExampleConnector
    answers 64 - 96 = -32 external tokens for a prompt whose local hit goes
    further than the key it looks up. The trace holds the answer as it was
    (a reader that refused it would refuse the very run to look at); replay
    flags it (I7) and the PrefillStats it leads to, where the recording has
    them."""
    from pathlib import Path

    from kvtrace.replay import replay_file
    from kvtrace.trace import events as ev
    from kvtrace.trace.io import TraceReader

    path = REPO / "traces" / "data-path" / "negative-external-hit.jsonl.gz"
    with TraceReader(path) as r:
        events = list(r)
    neg = [(e.step, lk.req, lk.ext) for e in events if isinstance(e, ev.Step)
           for lk in e.lookups if lk.ext is not None and lk.ext < 0]
    stats = [(e.step, e.req) for e in events if isinstance(e, ev.PromptStats)
             and e.prefill_stats.num_external_cached_tokens < 0]
    assert [x[2] for x in neg] == [-32] and stats == [neg[0][:2]]
    divs = replay_file(path).divergences
    assert [(d.step, d.req, d.field, d.rule.split(":")[0].split(" ")[0]) for d in divs] == [
        (*neg[0][:2], "lookup.ext", "I7"), (*stats[0], "prefill_stats", "5.3")]


def test_the_plan_leaves_out_async_loads_and_names_blocks_with_no_hash_yet():
    """``KVAudit.plan`` on the scheduler's side of a step: a synchronous load
    of a request scheduled now is a target; an async load (its request parked
    until the load ends) is not; a decode that fills a block whose hash is not
    known yet names it with an empty hash."""
    from types import SimpleNamespace as NS

    from kvtrace.record.vllm.kv_audit import KVAudit
    from kvtrace.record.vllm.kv_shard import PLAN_ATTR
    from kvtrace.trace.events import KVLoad, Lookup

    tables = {"new": [5, 6, 7], "parked": [8, 9], "old": [1, 2, 3]}
    kvm = NS(get_block_ids=lambda rid: (tables[rid],), block_pool=NS(num_gpu_blocks=16))
    requests = {"new": NS(block_hashes=[b"\x01" * 8, b"\x02" * 8, b"\x03" * 8]),
                "parked": NS(block_hashes=[b"\x04" * 8, b"\x05" * 8]),
                "old": NS(block_hashes=[b"\x06" * 8, b"\x07" * 8])}   # block 3's not yet
    sched = NS(cache_config=NS(block_size=4), kv_cache_manager=kvm, requests=requests)
    audit = KVAudit(sched)
    meta = NS()
    out = NS(kv_connector_metadata=meta, num_scheduled_tokens={"new": 4, "old": 1},
             scheduled_spec_decode_tokens={},
             scheduled_new_reqs=[NS(req_id="new", num_computed_tokens=8)],
             scheduled_cached_reqs=NS(req_ids=["old"], num_computed_tokens=[11],
                                      resumed_req_ids=set()))
    lookups = [Lookup(req="new", local=4, ext=4), Lookup(req="parked", local=0, ext=8,
                                                         load_async=True)]
    loads = [KVLoad(req="new", start=4, end=8), KVLoad(req="parked", start=0, end=8)]
    audit.plan(3, out, sched, lookups, loads)
    plan = getattr(meta, PLAN_ATTR)   # what the workers get, on the step's metadata
    [p] = plan["groups"]   # one KV-cache group: all layers
    h = [bytes([i]) * 8 for i in range(8)]
    assert p["targets"] == [("new", 6, h[2].hex(), True, False)]   # asked; no metadata view
    assert p["issued"] == [("parked", 8, h[4].hex()), ("parked", 9, h[5].hex())]
    assert p["hits"] == [("new", 5, h[1].hex())]
    assert p["cached"] == [("new", 7, h[3].hex()), ("old", 3, "")]
    assert (plan["step"], plan["num_blocks"], p["group"], p["layers"]) == (3, 16, None, None)


def test_the_plan_forgets_every_block_a_steps_drafts_write_into():
    """Under speculative decoding a step's own tokens fill a block, and its
    drafts write past them: the blocks they write into are named with an
    empty hash, so that what replay held for them (a filling by an earlier
    owner) is never compared with a later hit; a block the drafts complete
    is digested by no step."""
    from types import SimpleNamespace as NS

    from kvtrace.record.vllm.kv_audit import KVAudit
    from kvtrace.record.vllm.kv_shard import PLAN_ATTR

    tables = {"a": [1, 2, 3, 4], "b": [5, 6, 7]}
    kvm = NS(get_block_ids=lambda rid: (tables[rid],), block_pool=NS(num_gpu_blocks=16))
    requests = {"a": NS(block_hashes=[b"\x01" * 8, b"\x02" * 8]),
                "b": NS(block_hashes=[b"\x03" * 8])}
    sched = NS(cache_config=NS(block_size=4), kv_cache_manager=kvm, requests=requests)
    kv = KVAudit(sched)
    meta = NS()
    # a: 7 computed, 1 token + 3 drafts: its own token ends block 1 (8), the
    # drafts write 8..10, into block 2; b: 2 computed, 1 + 3 drafts (one a
    # padding -1): 2..5, into blocks 0 and 1.
    out = NS(kv_connector_metadata=meta, num_scheduled_tokens={"a": 4, "b": 4},
             scheduled_spec_decode_tokens={"a": [9, 9, 9], "b": [9, 9, -1]},
             scheduled_new_reqs=[],
             scheduled_cached_reqs=NS(req_ids=["a", "b"], num_computed_tokens=[7, 2],
                                      resumed_req_ids=set()))
    kv.plan(4, out, sched, [], [])
    cached = getattr(meta, PLAN_ATTR)["groups"][0]["cached"]
    h = [bytes([i]) * 8 for i in range(4)]
    assert cached == [("a", 2, h[2].hex()), ("a", 3, ""), ("b", 5, ""), ("b", 6, "")]
    # Replay: block 3 held another hash from an earlier owner; after the
    # drafts wrote into it, a hit on it (completed by accepted drafts) is not
    # compared with that.
    dp = DataPath()
    dp.feed(audit(1, cached=[("x", 3, "aa", 11)]))
    dp.feed(audit(4, cached=[(r, b, hh, 0) for r, b, hh in cached]))
    assert dp.feed(audit(6, hits=[("c", 3, "bb", 12)])) == []
    assert (dp.checked["hits"], dp.checked["unchecked hits"]) == (0, 1)   # nothing compared


def ranked(step, rank, loaded=(), saved=()):
    return KVAudit(seq=step, step=step, view="metadata", rank=rank, loaded=list(loaded),
                   saved=list(saved))


def test_each_tensor_parallel_rank_is_held_to_its_own_saves_and_named():
    """A rank holds other heads than the others, so other bytes: rank 1's
    load of rank 0's saved bytes for the same hash is D2, named by rank;
    each rank's own bytes pass."""
    dp = DataPath()
    dp.feed(ranked(0, 0, saved=[("a", 3, "h1", 111)]))
    dp.feed(ranked(0, 1, saved=[("a", 3, "h1", 222)]))
    assert dp.feed(ranked(4, 0, loaded=[("b", 7, "h1", 5, 111, True, True)])) == []
    assert dp.feed(ranked(4, 1, loaded=[("b", 7, "h1", 5, 222, True, True)])) == []
    wrong = dp.feed(ranked(9, 1, loaded=[("c", 8, "h1", 6, 111, True, True)]))
    assert rules(wrong) == [(9, "c", "D2")]
    assert wrong[0].recorded == "block 8 of rank 1 loaded with other bytes"
    assert dp.checked["rank 0 records"] == 2 and dp.checked["rank 1 records"] == 3
    assert dp.checked["loads"] == 3


def test_a_block_a_flagged_load_wrote_is_judged_again_at_its_next_load():
    """A load flagged D2 leaves bytes no save had; the same block loaded
    again with the same bytes is flagged again, not taken as what the
    block rightly held for the hash."""
    dp = DataPath()
    dp.feed(audit(0, saved=[("a", 3, "h1", 111)]))
    assert rules(dp.feed(audit(4, loaded=[("b", 7, "h1", 5, 999, True, True)]))) == [(4, "b", "D2")]
    assert rules(dp.feed(audit(8, loaded=[("c", 7, "h1", 999, 999, False, True)]))) == \
        [(8, "c", "D2")]
    # A block that rightly holds the hash's bytes passes when loaded again.
    dp.feed(audit(9, cached=[("d", 6, "h2", 50)]))
    assert dp.feed(audit(12, loaded=[("e", 6, "h2", 50, 50, False, True)])) == []


def test_the_summary_names_the_ranks_audited_and_a_rank_that_sent_nothing():
    from kvtrace.report.terminal import audit_line

    both = audit_line({"loads": 4, "rank 0 records": 2, "rank 1 records": 2,
                       "tensor_parallel_size": 2})
    assert both.endswith("over the shards of tensor-parallel ranks 0, 1")
    one = audit_line({"loads": 2, "rank 0 records": 2, "tensor_parallel_size": 2})
    assert "tensor-parallel rank 0;" in one and "rank 1 of 2 sent no record (not audited)" in one
    assert "rank" not in audit_line({"loads": 2})


def test_a_metadata_that_takes_no_plan_turns_the_audit_off_and_nothing_else():
    """A connector's metadata that refuses a new attribute (``__slots__``,
    a frozen dataclass, a validating ``__setattr__``): the audit is off from
    there; the step, and the recording, go on."""
    from dataclasses import dataclass
    from types import SimpleNamespace as NS

    from kvtrace.record.vllm.kv_audit import KVAudit

    class Slots:
        __slots__ = ()

    @dataclass(frozen=True)
    class Frozen:
        pass

    class Strict:
        def __setattr__(self, name, value):
            raise ValueError(f"no field {name}")

    kvm = NS(get_block_ids=lambda rid: ([],), block_pool=NS(num_gpu_blocks=16))
    sched = NS(cache_config=NS(block_size=4), kv_cache_manager=kvm, requests={})
    for meta in (Slots(), Frozen(), Strict()):
        audit = KVAudit(sched)
        out = NS(kv_connector_metadata=meta, num_scheduled_tokens={},
                 scheduled_spec_decode_tokens={}, scheduled_new_reqs=[],
                 scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[],
                                          resumed_req_ids=set()))
        audit.plan(0, out, sched, [], [])
        assert audit.off, type(meta).__name__


def test_a_connectors_entry_lines_up_with_a_table_that_starts_with_dropped_blocks():
    """A sliding window's table may start with null blocks (0): the entry's
    blocks are read by position, so it still names its request, and its
    saves and loads are that request's."""
    from types import SimpleNamespace as NS

    import torch as t

    from kvtrace.record.vllm.kv_audit import _metadata_view

    bs = 4
    table = [0, 0, 2, 3]
    slots = t.tensor([b * bs + o for b in table for o in range(bs)])
    meta = NS(requests=[NS(slot_mapping=slots, slot_mappings=[slots, slots], is_store=True)])
    assert _metadata_view(meta, bs, 0) == ([], [table])
    assert _metadata_view(meta, bs, None) == ([], [table])


def test_a_load_of_no_known_hash_leaves_nothing_to_compare_a_hit_with():
    dp = DataPath()
    dp.feed(audit(1, cached=[("a", 2, "h1", 10)]))
    dp.feed(audit(5, loaded=[("", 2, "", 10, 7, False, True)], hits=[("r", 2, "h2", 7)]))
    assert dp.divergences == []
    assert dp.checked["unchecked hits"] == 1 and dp.checked["hits"] == 0


def _digest_as_documented(layers, num_blocks, blocks):
    """The digest as docs/reference/trace-format.md states it, written
    plainly: each layer's block as 64-bit words, each word mixed (xor-shift,
    times its position's weight, xor-shift, times the mix, xor-shift),
    summed modulo 2^64, the layers folded in order."""
    from kvtrace.record.vllm.kv_digest import _FOLD, _MIX

    d = BlockDigests(layers, num_blocks)   # for its weights and block dimensions
    idx = torch.as_tensor(blocks)
    acc = None
    for t, dim in d.layers:
        x = t.index_select(dim, idx).movedim(dim, 0).contiguous().view(torch.uint8)
        x = x.reshape(len(blocks), -1)
        x = x.view(torch.int64) if x.shape[1] % 8 == 0 else x.to(torch.int64)
        x = x ^ ((x >> 31) & 0x1FFFFFFFF)
        x = x * d._w(x.shape[1])
        x = x ^ ((x >> 29) & 0x7FFFFFFFF)
        x = x * _MIX
        x = x ^ ((x >> 32) & 0xFFFFFFFF)
        s = x.sum(dim=1)
        acc = s if acc is None else acc * _FOLD + s
    return acc.tolist()


@pytest.mark.parametrize("shape,dtype", [((20, 2, 4, 16), torch.bfloat16),
                                         ((2, 20, 4, 8), torch.float16),
                                         ((20, 3, 5), torch.uint8),
                                         ((20, 2, 4, 16), torch.float32)],
                         ids=["cpu-packed", "k-v-first", "odd-bytes", "float32"])
def test_the_in_place_digest_is_the_documented_one(shape, dtype):
    """The digest mixes in place in kept buffers (for speed); it gives what
    the documented mix gives, on vLLM's layouts (blocks first, or K and V
    first) and on blocks that are no multiple of 8 bytes."""
    g = torch.Generator().manual_seed(1)
    layers = [torch.randint(-100, 100, shape, generator=g).to(dtype) for _ in range(3)]
    d = BlockDigests(layers, 20)
    for blocks in ([1, 2, 3], list(range(20)), [7], [4, 4]):
        assert d(blocks) == _digest_as_documented(layers, 20, blocks)
    assert len(set(d(list(range(20))))) == 20
    from kvtrace import compiled

    if compiled.COMPILED and dtype != torch.uint8:   # 5 bytes a block: no kernel reads it
        assert d.kernel_off is None   # the kernel in C gave them
    arrays = BlockDigests(layers, 20)
    arrays._call = None   # the array path alone
    assert arrays(list(range(20))) == d(list(range(20)))


def test_a_kernel_that_differs_gives_way_to_the_numpy_chunks(monkeypatch):
    """The kernel in C runs once its first digests equal the NumPy chunks';
    where they differ, the chunks give every digest from there, and
    ``kernel_off`` says why. Without the compiled path, the chunks alone."""
    from kvtrace import compiled
    from kvtrace.record.vllm import kv_digest

    g = torch.Generator().manual_seed(3)
    layers = [torch.randint(-100, 100, (20, 2, 4, 16), generator=g).to(torch.bfloat16)]
    want = _digest_as_documented(layers, 20, [3, 1, 4])

    def off_by_one(n_layers, *args):   # the kernel's arguments; writes out[i] = i + 1
        n, out = args[-2], args[-1]
        np.frombuffer((ctypes.c_int64 * n).from_address(out), dtype=np.int64)[:] = \
            np.arange(1, n + 1)

    monkeypatch.setattr(kv_digest, "_KERNEL", (off_by_one, ""))
    d = BlockDigests(layers, 20)
    assert d.kernel_off is None
    assert d([3, 1, 4]) == want and "differ" in d.kernel_off
    assert d([3, 1, 4]) == want and d._call is None
    monkeypatch.setattr(kv_digest, "_KERNEL", None)
    monkeypatch.setattr(compiled, "COMPILED", False)
    monkeypatch.setattr(compiled, "REASON", "KVTRACE_PURE is set")
    d = BlockDigests(layers, 20)
    assert d([3, 1, 4]) == want and d.kernel_off == "the pure path runs: KVTRACE_PURE is set"


def test_a_kernel_that_fails_gives_way_to_the_array_path(monkeypatch):
    """A kernel that raises (Triton's compiler, say) is turned off, and the
    array path gives that call's digests and every later one."""
    from kvtrace.record.vllm import kv_digest

    g = torch.Generator().manual_seed(4)
    layers = [torch.randint(-100, 100, (20, 2, 4, 16), generator=g).to(torch.bfloat16)]
    want = _digest_as_documented(layers, 20, [2, 9])

    def fails(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(kv_digest, "_KERNEL", (fails, ""))
    d = BlockDigests(layers, 20)
    assert d.kernel_off is None and d._call is not None
    assert d([2, 9]) == want and d._call is None
    assert d.kernel_off == "it failed: RuntimeError: no compiler"
    assert d([2, 9]) == want


def test_a_kernel_out_of_memory_gives_way_for_that_call_alone(monkeypatch):
    """Memory may be found at the next call: the kernel stays on."""
    from kvtrace.record.vllm import kv_digest

    g = torch.Generator().manual_seed(5)
    layers = [torch.randint(-100, 100, (20, 2, 4, 16), generator=g).to(torch.bfloat16)]
    d = BlockDigests(layers, 20)
    calls = []

    def short_once(blocks):
        calls.append(blocks)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no memory")
        return _digest_as_documented(layers, 20, blocks)

    d._call = short_once
    assert d([2, 9]) == _digest_as_documented(layers, 20, [2, 9])
    assert d._call is short_once and d.kernel_off is None
    assert d([3]) == _digest_as_documented(layers, 20, [3]) and len(calls) == 2


def test_a_layer_listed_twice_counts_once_and_another_view_of_its_memory_counts():
    g = torch.Generator().manual_seed(6)
    a = torch.randint(-100, 100, (8, 2, 4, 4), generator=g).to(torch.float32)
    b = torch.randint(-100, 100, (8, 4, 8), generator=g).to(torch.float32)
    c = a.view(8, 4, 8)   # a's memory, b's shape
    assert len(BlockDigests([a, b, a], 8).layers) == 2
    d = BlockDigests([a, b, c], 8)
    assert len(d.layers) == 3
    assert d([5]) == _digest_as_documented([a, b, c], 8, [5])


def test_the_kernel_is_checked_until_a_digest_is_not_zero(monkeypatch):
    """Blocks of zeros (a fresh cache's) digest to 0 whatever the kernel does
    with its weights: the check goes on until a digest other than 0 was
    compared, and catches a kernel that writes 0 for everything there."""
    from kvtrace.record.vllm import kv_digest

    def zeros(n_layers, *args):
        n, out = args[-2], args[-1]
        np.frombuffer((ctypes.c_int64 * n).from_address(out), dtype=np.int64)[:] = 0

    monkeypatch.setattr(kv_digest, "_KERNEL", (zeros, ""))
    layers = [torch.zeros(8, 2, 8, dtype=torch.float32)]
    d = BlockDigests(layers, 8)
    assert d([1, 2]) == [0, 0] and d.kernel_off is None
    layers[0][3] = 1.5
    want = _digest_as_documented(layers, 8, [3])
    assert want != [0]
    assert d([3]) == want and "differ" in d.kernel_off


def test_a_layer_given_other_memory_turns_the_kernel_off():
    """The kernel reads the memory each layer had at the first digest: a
    tensor given other memory since (torch's set_) goes to the NumPy chunks,
    which read it where it is now."""
    from kvtrace import compiled

    if not compiled.COMPILED:
        if os.environ.get("KVTRACE_REQUIRE_COMPILED") == "1":
            pytest.fail(f"KVTRACE_REQUIRE_COMPILED=1, but the pure path runs: {compiled.REASON}")
        pytest.skip(f"needs the compiled path ({compiled.REASON}); THIS TEST DID NOT RUN")
    t = torch.ones(6, 2, 8, dtype=torch.float32)
    d = BlockDigests([t], 6)
    before = d([1])
    assert d.kernel_off is None
    t.set_(torch.zeros_like(t))
    assert d([1]) == [0] != before and "moved" in d.kernel_off


def test_a_block_outside_the_cache_is_refused_before_the_kernel_reads_it():
    layers = [torch.zeros(6, 2, 8, dtype=torch.float32)]
    d = BlockDigests(layers, 6)
    for bad in ([0, 6], [-1]):
        with pytest.raises((IndexError, RuntimeError)):
            d(bad)


@pytest.mark.parametrize("chunk_words", [1, 40, 1 << 15], ids=["a-block-a-chunk", "a-few-blocks",
                                                                 "all-at-once"])
@pytest.mark.parametrize("shape", [(20, 2, 4, 16), (2, 20, 4, 8)], ids=["cpu-packed", "k-v-first"])
def test_the_cpu_digest_in_chunks_is_the_documented_one(shape, chunk_words):
    """On the CPU the blocks are mixed a chunk at a time (so that they stay
    in the core's cache); a chunk's edges change no digest."""
    g = torch.Generator().manual_seed(2)
    layers = [torch.randint(-100, 100, shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    d = BlockDigests(layers, 20)
    d._call = None   # the NumPy chunks, not the kernel
    d._CHUNK_WORDS = chunk_words
    for blocks in ([1, 2, 3], list(range(20)), [19, 0, 7, 7]):
        assert d(blocks) == _digest_as_documented(layers, 20, blocks)
