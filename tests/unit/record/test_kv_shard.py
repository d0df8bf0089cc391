"""The KV audit's worker side (kvtrace.record.vllm.kv_shard) and the channel
its records take to the engine core's trace (kv_channel), without vLLM: a
worker in the engine core's process, and one in a process of its own."""

from __future__ import annotations

import pickle
import subprocess
import sys
from types import SimpleNamespace as NS

import torch

from kvtrace.record.vllm import kv_channel, kv_shard
from kvtrace.record.vllm.kv_digest import BlockDigests
from kvtrace.trace.events import KVAudit

from tests._paths import REPO


class Connector:
    """A worker-side connector's methods, as the model runner calls them,
    over a KV cache of two layers of 8 blocks."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.kv = [torch.randint(-99, 99, (8, 2, 4, 16), generator=g, dtype=torch.int16)
                   for _ in range(2)]
        layers = {f"l{i}": NS(kv_cache=t) for i, t in enumerate(self.kv)}
        self._vllm_config = NS(compilation_config=NS(static_forward_context=layers))
        self.calls: list[str] = []

    def bind_connector_metadata(self, meta):
        self.calls.append("bind")

    def clear_connector_metadata(self):
        self.calls.append("clear")

    def get_transfer_results(self, finished):
        return NS(finished_recving=set(), failed_recving=set(), finished_sending=set())

    def get_block_ids_with_load_errors(self):
        return set()


def group(g=None, layers=None, **kw) -> dict:
    return dict({"group": g, "layers": layers, "view": "metadata",
                 "targets": [("r", 2, "aa", True, True)], "issued": [], "saves": [("r", 5, "bb")],
                 "cached": [("r", 5, "bb")], "hits": [("q", 1, "cc")]}, **kw)


def plan(to: str, step: int = 3, groups=None) -> dict:
    return {"step": step, "num_blocks": 8, "to": to, "groups": groups or [group()]}


def test_a_worker_digests_its_blocks_around_the_step_and_its_record_reaches_the_trace():
    conn = Connector()
    got: list = []
    channel = kv_channel.Channel(got.append)
    try:
        kv_shard.watch(conn)
        assert kv_shard.watch(conn) is kv_shard.shard_audit(conn)   # once
        digests = BlockDigests(conn.kv, 8)
        before = digests([2])[0]
        conn.bind_connector_metadata(NS(kvtrace_audit_plan=plan(channel.path)))
        for t in conn.kv:   # the step's load writes block 2
            t[2] = 7
        conn.get_transfer_results(set())
        conn.clear_connector_metadata()
    finally:
        channel.close()
    assert conn.calls == ["bind", "clear"]   # the connector's own methods still run
    [e] = got
    assert (e.step, e.view, e.rank) == (3, "metadata", None)
    after, five, one = digests([2, 5, 1])
    assert before != after
    assert e.loaded == [("r", 2, "aa", before, after, True, True)]
    assert e.saved == e.cached == [("r", 5, "bb", five)] and e.hits == [("q", 1, "cc", one)]


def test_a_step_without_a_plan_is_not_audited():
    conn = Connector()
    got: list = []
    channel = kv_channel.Channel(got.append)
    try:
        kv_shard.watch(conn)
        conn.bind_connector_metadata(NS())
        conn.clear_connector_metadata()
    finally:
        channel.close()
    assert got == [] and conn.calls == ["bind", "clear"]


def test_the_plan_is_builtins_only_so_a_worker_without_kvtrace_unpickles_it():
    """The plan rides on the connector's metadata to every worker: pickled
    and read back in a Python that cannot import kvtrace, it is the same."""
    p = plan("/tmp/x")
    code = ("import pickle, sys; sys.modules['kvtrace'] = None; "
            "print(repr(pickle.loads(sys.stdin.buffer.read())))")
    out = subprocess.run([sys.executable, "-I", "-c", code], input=pickle.dumps(p),
                         capture_output=True, check=True).stdout.decode()
    assert eval(out) == p


def test_records_from_another_process_arrive_whole_and_in_order():
    """A worker in a process of its own (a tensor-parallel rank) appends its
    records to the channel's file for its rank; the engine core reads the
    whole lines that have come, and a line cut short waits for its end."""
    got: list = []
    channel = kv_channel.Channel(got.append)
    try:
        code = (
            "import sys; from kvtrace.record.vllm.kv_channel import deliver; "
            "from kvtrace.trace.events import KVAudit; "
            "[deliver(sys.argv[1], 1, KVAudit(seq=0, step=s, rank=1, "
            "hits=[('a', s, 'ff', -s)])) for s in range(3)]")
        subprocess.run([sys.executable, "-c", code, channel.path], check=True, cwd=REPO)
        assert channel.collect() == 3
        assert [(e.step, e.rank, e.hits) for e in got] == [(s, 1, [("a", s, "ff", -s)])
                                                           for s in range(3)]
        line = (kv_channel.msgspec.json.encode(KVAudit(seq=0, step=7, rank=1)) + b"\n")
        with open(f"{channel.path}/rank1.jsonl", "ab") as f:
            f.write(line[:9])
            f.flush()
            assert channel.collect() == 0
            f.write(line[9:])
        assert channel.collect() == 1 and got[-1].step == 7
    finally:
        channel.close()
    assert not __import__("os").path.exists(channel.path)


def test_a_worker_that_cannot_reach_the_channel_loses_its_record_not_the_step(caplog):
    e = KVAudit(seq=0, step=1, rank=1)
    kv_channel.deliver("/nonexistent/kvtrace-channel", 1, e)
    kv_channel.deliver("/nonexistent/kvtrace-channel", 1, e)
    said = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(said) == 1   # said once


def test_a_cache_the_audit_cannot_read_stops_the_audit_not_the_worker_and_says_so(caplog):
    """The worker goes on; its log says why once, and so does the trace, in
    a last record that replay reports."""
    from kvtrace.replay.data_path import DataPath
    from kvtrace.report.terminal import audit_line

    conn = Connector()
    got: list = []
    channel = kv_channel.Channel(got.append)
    try:
        kv_shard.watch(conn)
        p = dict(plan(channel.path, step=30), num_blocks=5)   # no dimension of 5 blocks
        conn.bind_connector_metadata(NS(kvtrace_audit_plan=p))
        conn.clear_connector_metadata()
        conn.bind_connector_metadata(NS(kvtrace_audit_plan=p))
    finally:
        channel.close()
    assert conn.calls == ["bind", "clear", "bind"]
    assert kv_shard.shard_audit(conn).off
    assert sum("no KV audit on this worker" in r.getMessage() for r in caplog.records) == 1
    [e] = got
    assert e.step == 30 and e.stopped.startswith("ValueError: ") and not e.loaded
    dp = DataPath()
    dp.feed(e)
    line = audit_line(dict(dp.checked, loads=1))
    assert "the audit stopped: at step 30 (ValueError: " in line
    assert line.endswith("its later steps not audited")


def test_each_kv_cache_group_is_digested_over_its_own_layers_and_named():
    """Several KV-cache groups: a record per group, each block's digest over
    that group's layers alone."""
    conn = Connector()
    got: list = []
    channel = kv_channel.Channel(got.append)
    try:
        kv_shard.watch(conn)
        conn.bind_connector_metadata(NS(kvtrace_audit_plan=plan(channel.path, groups=[
            group(0, ["l0"]), group(1, ["l1"], targets=[], saves=[], hits=[])])))
        conn.clear_connector_metadata()
    finally:
        channel.close()
    zero, one = got
    assert (zero.group, one.group) == (0, 1)
    d0, d1 = BlockDigests(conn.kv[:1], 8), BlockDigests(conn.kv[1:], 8)
    assert zero.cached == [("r", 5, "bb", d0([5])[0])]
    assert one.cached == [("r", 5, "bb", d1([5])[0])] and d0([5]) != d1([5])
    assert zero.loaded and not one.loaded
