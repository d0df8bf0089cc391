"""One path for every field: each event, with every field set to something other
than its default, goes recorder -> sink -> writer -> reader -> bridge and comes
out as it went in. A field added to the schema fails ``test_every_field_is_set``
until it is set here, and then the round trip checks it."""

from __future__ import annotations

import enum
import hashlib

import msgspec
import pytest

from kvtrace import bridge
from kvtrace.record.capture import (
    RawOutput,
    RawStep,
    RunningColumns,
    Sampled,
    Scheduled,
    Snapshot,
    StateCounters,
)
from kvtrace.record.sink import ProcessSink, TraceSink
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

DIGEST = hashlib.sha256(b"rows").hexdigest()


class Status(enum.IntEnum):   # as vLLM's RequestStatus: statuses travel as values
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 6


def _filled_features() -> ev.SchedulerFeatures:
    """Every feature key set to a value that is not its default."""
    values = {bool: True, int: 3, float: 0.5, str: "x"}
    info = msgspec.inspect.type_info(ev.SchedulerFeatures)
    d = {}
    for f in info.fields:
        if f.name == "extra":
            continue
        t = next(t for t in f.type.types if not isinstance(t, msgspec.inspect.NoneType))
        if isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type,
                                                                  msgspec.inspect.StructType):
            d[f.name] = [{"kind": "SlidingWindowSpec", "block_size": 16, "sliding_window": 32,
                          "admission_blocks": 4, "layers": ["layers.0"], "mamba_type": "mamba2",
                          "mamba_cache_mode": "align", "num_speculative_blocks": 2,
                          "num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}]
        elif isinstance(t, msgspec.inspect.ListType):
            d[f.name] = [values[t.item_type.cls]] if hasattr(t.item_type, "cls") else \
                ["x" if isinstance(t.item_type, msgspec.inspect.StrType) else 3]
        else:
            d[f.name] = {msgspec.inspect.BoolType: True, msgspec.inspect.IntType: 3,
                         msgspec.inspect.FloatType: 0.5, msgspec.inspect.StrType: "x"}[type(t)]
    d["hash_block_size"] = 16          # the arrival's one digest covers its 5 tokens
    d["num_kv_cache_groups"] = 2       # the records' tables: group 0's and one in more_groups
    d["newer_key"] = {"kept": True}   # a key this version does not know
    return ev.features_from(d)


HEADER = ev.Header(
    engine="vllm", engine_version="0.32.0", counters="legacy",
    config=ev.SchedulerConfig(
        block_size=16, num_blocks=64, max_num_batched_tokens=48, max_num_seqs=3,
        max_model_len=512, enable_prefix_caching=False, policy="priority",
        long_prefill_token_threshold=32, max_num_scheduled_tokens=40, watermark_blocks=2,
        connector=ev.ConnectorConfig("ExampleConnector", load_failure_policy="recompute")),
    features=_filled_features(),
    meta={"workload": "round-trip"},
)

# A step's state with one KV-cache group's table, an output's with two.
STEP_STATE = ev.RequestState(req="a", status="RUNNING", num_computed_tokens=5, num_tokens=9,
                             num_preemptions=1, block_ids=[3, 7])
STATE = msgspec.structs.replace(STEP_STATE, more_groups=[[2]])

EVENTS = [
    ev.Arrival(seq=0, req="a", prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=4, arrival_time=1.5,
               priority=-2, cache_salt="salt", eos_token_id=2, stop_token_ids=[9], min_tokens=1,
               ignore_eos=True, skip_reading_prefix_cache=True, resumable=True,
               structured_output=True, pooling=True,
               repetition_detection={"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3},
               prompt_embeds=[DIGEST], prompt_is_token_ids=[[0, 2]],
               lora={"id": 1, "name": "ad", "path": "/l"},
               kv_transfer_params={"remote_request_id": "p-1", "do_remote_prefill": True}),
    *(PADDING := [ev.Arrival(seq=0, req=r, prompt_token_ids=[1], max_tokens=1)
                  for r in "bcdef"]),   # the other requests the records name
    ev.Abort(seq=0, reqs=["b"], status="FINISHED_STOPPED"),
    ev.RequestFinished(seq=0, req="a", delay_free=True, kv_transfer_params={"remote_block_ids": [3]}),
    ev.ResetPrefixCache(seq=0, reset_running_requests=True, succeeded=False, reset_connector=True),
    ev.PauseState(seq=0, state="PAUSED_NEW"),
    ev.Keyframe(seq=0, step=0, format=1, version="0.0.1",
                state={"root": {"r": 0}, "objects": [{"o": "m:C", "f": {"x": [1]}}], "packed": {}},
                live=["a", "c"], sessions=["a"], finished=["b"], awaiting=[7],
                last_output_step=6),
    ev.Step(seq=0, step=0,
            new=[ev.ScheduledNew("a", 0, 5, [3, 7])],
            resumed=[ev.ScheduledNew("c", 2, 1, [4], more_groups=[[5]])],
            running=[ev.ScheduledRunning("d", 6, 2, [8], more_groups=[[9]])],
            preempted=["e"], finished=["f"],
            lookups=[ev.Lookup(req="a", local=0, ext=2, load_async=True)],
            loads=[ev.KVLoad(req="a", start=0, end=2)],
            states=[STEP_STATE], num_free_blocks=50, spec={"a": [5, -1]}, grammar={"a": "ready"},
            throttle_prefills=True),
    ev.Output(seq=0, step=0, sampled={"a": [11, 12]},
              connector=ev.ConnectorOutput(finished_recving=["a"], finished_sending=["f"],
                                           failed_recving=["c"], invalid_block_ids=[4]),
              finished={"a": "length"}, states=[STATE], grammar_rejected=["d"], pooled=["a"],
              connector_cache=ev.CacheStats(requests=1, queries=2, hits=3, preempted_requests=4,
                                            preempted_queries=5, preempted_hits=6)),
    ev.Drafts(seq=0, step=0, drafts={"a": [7, 8]}),
    ev.KVAudit(seq=0, step=0, view="metadata", rank=1, group=0, stopped="OSError: gone",
               loaded=[("a", 3, "0123456789abcdef", -5, 1 << 62, True, False)],
               saved=[("a", 7, "fedcba9876543210", -(1 << 63))], cached=[("d", 8, "00ff", 2)],
               hits=[("c", 4, "0a", (1 << 63) - 1)]),
    ev.PromptStats(seq=0, step=0, req="a",
                   prefill_stats=ev.PrefillStats(5, 2, 1, 3, 5, 2),
                   legacy=ev.LegacyCounters(-1, 1)),
    # the engine stops at a step whose schedule() raised: only the end follows
    ev.StepFailed(seq=0, step=1, error="AssertionError: a padded decode lost its padding",
                  where="vllm/v1/core/sched/scheduler.py:1372 in schedule",
                  lookups=[ev.Lookup(req="c", local=4, ext=None)],
                  loads=[ev.KVLoad(req="c", start=4, end=8)], grammar={"d": "error"},
                  throttle_prefills=True),
]
STEP, OUTPUT, STATS = (next(e for e in EVENTS if type(e) is t)
                       for t in (ev.Step, ev.Output, ev.PromptStats))
END = ev.End(seq=0, status="interrupted", error="stopped by a signal", dropped_events=2)


def _non_defaults(obj: msgspec.Struct) -> set[str]:
    """The fields of ``obj`` that hold something other than their default."""
    info = msgspec.inspect.type_info(type(obj))
    out = set()
    for f in info.fields:
        v = getattr(obj, f.name)
        default = f.default if f.default is not msgspec.NODEFAULT else (
            f.default_factory() if f.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT)
        if v != default:
            out.add(f.name)
    return out


@pytest.mark.parametrize("obj", [*(e for e in EVENTS if e not in PADDING), END, HEADER, HEADER.config, HEADER.config.connector,
                                 HEADER.features, HEADER.features.kv_cache_groups[0], STEP.lookups[0],
                                 STEP.resumed[0], STEP.running[0],
                                 OUTPUT.connector, STATS.prefill_stats, STATS.legacy, STATE],
                         ids=lambda o: type(o).__name__)
def test_every_field_is_set(obj):
    """Every field of every event (and of the parts they hold) is set to
    something other than its default, and the set covers every kind of record."""
    fixed = {"seq", "schema", "step"}   # numbered or versioned by the writer
    assert _non_defaults(obj) - fixed == set(type(obj).__struct_fields__) - fixed
    assert {type(e) for e in EVENTS} | {ev.End} == set(ev.Event.__args__)


def _with_seq(events: list) -> list:
    return [msgspec.structs.replace(e, seq=i) for i, e in enumerate(events)]


@pytest.mark.parametrize("sink_cls, suffix", [(TraceSink, ".jsonl"), (ProcessSink, ".jsonl.zst"),
                                              (TraceSink, ".jsonl.gz")])
def test_every_field_survives_sink_writer_and_reader(tmp_path, sink_cls, suffix):
    path = tmp_path / f"t{suffix}"
    sink = sink_cls(path, HEADER)
    for e in EVENTS:
        sink.put(e)
    sink.close(status=END.status, error=END.error)
    reader = TraceReader(path)
    got = list(reader)
    assert reader.header == HEADER
    assert reader.header.features.extra == {"newer_key": {"kept": True}}
    assert got[:-1] == _with_seq(EVENTS)
    assert (got[-1].status, got[-1].error) == (END.status, END.error)


class _Block:
    def __init__(self, i: int):
        self.block_id = i


def test_the_recorders_capture_becomes_the_schemas_records(tmp_path):
    """What the vLLM recorder captures on the engine's thread (named tuples of
    the engine's values, block objects read later) becomes records with every
    field of a step and an output set."""
    # With several KV-cache groups, the block ids of groups 1, 2, ... become more_groups.
    assert Scheduled._fields + ("more_groups",) == ev.ScheduledNew.__struct_fields__
    assert StateCounters._fields + ("block_ids", "more_groups") == ev.RequestState.__struct_fields__
    blocks = [_Block(3), _Block(7)]
    counters = [StateCounters("a", Status.RUNNING, 5, 9, 1)]
    states = Snapshot(req_ids=["a"], counters=counters, blocks=[blocks], lengths=[2])
    # Several groups: the KV manager's get_block_ids is read at the snapshot.
    grouped = Snapshot(req_ids=["a"], counters=counters, blocks=[[[3, 7], [2]]], lengths=None)
    step = RawStep(
        step=0, new=[Scheduled("a", 0, 5, [3, 7])], resumed=[Scheduled("c", 2, 1, [[4], [5]])],
        running=RunningColumns(req_ids=["d"], num_computed_tokens=[6], new_block_ids=[([8], [9])],
                               num_scheduled_tokens={"a": 5, "c": 1, "d": 2}),
        preempted=["e"], finished=["f"], lookups=[ev.Lookup(req="a", local=0, ext=2, load_async=True)],
        loads=[ev.KVLoad(req="a", start=0, end=2)], states=states, num_free_blocks=50,
        rare={"spec": {"a": [5, -1]}, "grammar": {"a": "ready"}, "throttle_prefills": True})
    output = RawOutput(
        step=0, sampled=Sampled(req_ids=["a", "d"], sampled_token_ids=[[11, 12], []],
                                req_id_to_index={"a": 0, "d": 1}),
        connector=OUTPUT.connector, finished={"a": "length"}, states=grouped,
        rare={"grammar_rejected": ["d"], "pooled": ["a"],
              "connector_cache": {"requests": 1, "queries": 2, "hits": 3, "preempted_requests": 4,
                                  "preempted_queries": 5, "preempted_hits": 6}})
    arrivals = [e for e in EVENTS if type(e) is ev.Arrival]
    for sink_cls in (TraceSink, ProcessSink):
        path = tmp_path / f"{sink_cls.__name__}.jsonl"
        sink = sink_cls(path, HEADER)
        for a in arrivals:
            sink.put(a)
        sink.put(step)
        blocks.append(_Block(9))   # grows after the snapshot: not in it
        sink.put(output)
        sink.close()
        *_, got_step, got_output, _ = list(TraceReader(path))
        n = len(arrivals)
        assert got_step == msgspec.structs.replace(STEP, seq=n)
        assert got_output == msgspec.structs.replace(OUTPUT, seq=n + 1)


def test_the_bridge_hands_every_input_field_to_the_reference():
    """Each Arrival field reaches the reference's Request, each Output input
    field its ModelOutput, each config field its SchedulerConfig. The fields the
    reference does not read are named, with the reader that does."""
    a = EVENTS[0]
    r = bridge.request_from_arrival(a, block_size=16)
    arrival = {
        "req": r.request_id == "a",
        "prompt_token_ids": r.prompt_token_ids == [1, 2, 3, 4, 5],
        "max_tokens": r.max_tokens == 4,
        "arrival_time": r.arrival_time == 1.5,
        "priority": r.priority == -2,
        "cache_salt": r.cache_salt == "salt",
        "eos_token_id": r.eos_token_id == 2,
        "stop_token_ids": r.stop_token_ids == (9,),
        "min_tokens": r.min_tokens == 1,
        "ignore_eos": r.ignore_eos is True,
        "skip_reading_prefix_cache": r.skip_reading_prefix_cache is True,
        "resumable": r.resumable is True,
        "structured_output": r.grammar == "compiling",
        "pooling": r.pooling is True,
        "repetition_detection": r.repetition == (4, 2, 3),
        "prompt_embeds": r.prompt_embeds.digests == (DIGEST,),
        "prompt_is_token_ids": r.prompt_embeds.token_runs == ((0, 2),),
        "lora": r.lora == (1, "ad", "/l"),
        "kv_transfer_params": "read by kvtrace diff's handoff pairing, not the scheduler",
    }
    assert set(arrival) == set(ev.Arrival.__struct_fields__) - {"seq"}
    assert [k for k, ok in arrival.items() if ok is not True and not isinstance(ok, str)] == []

    o = OUTPUT
    m = bridge.model_output_from_event(o)
    output = {
        "sampled": m.sampled_token_ids == {"a": [11, 12]},
        "connector": (m.finished_recving, m.finished_sending, m.failed_recving,
                      m.invalid_block_ids) == ({"a"}, {"f"}, {"c"}, {4}),
        "grammar_rejected": m.grammar_rejected == {"d"},
        "pooled": m.pooled == {"a"},
        "finished": m.error_order == () and bridge.model_output_from_event(
            msgspec.structs.replace(o, finished={"b": "error", "a": "length", "c": "error"})
        ).error_order == ("b", "c"),   # an outcome replay compares; its errors' order feeds it
        "states": "an outcome: replay compares it, it feeds nothing",
        "connector_cache": "an outcome: replay compares it with its count (rule 5.4)",
    }
    assert set(output) == set(ev.Output.__struct_fields__) - {"seq", "step"}
    assert [k for k, ok in output.items() if ok is not True and not isinstance(ok, str)] == []

    c = bridge.config_from_header(HEADER)
    t = HEADER.config
    config = {
        "block_size": c.block_size == t.block_size,
        "num_blocks": c.num_blocks == t.num_blocks,
        "max_num_batched_tokens": c.max_num_batched_tokens == t.max_num_batched_tokens,
        "max_num_seqs": c.max_num_seqs == t.max_num_seqs,
        "max_model_len": c.max_model_len == t.max_model_len,
        "enable_prefix_caching": c.enable_prefix_caching is False,
        "policy": c.policy == "priority",
        "long_prefill_token_threshold": c.long_prefill_token_threshold == 32,
        "max_num_scheduled_tokens": c.max_num_scheduled_tokens == 40,
        "watermark_blocks": c.watermark_blocks == 2,
        "connector": c.load_failure_policy == "recompute",
    }
    assert set(config) == set(ev.SchedulerConfig.__struct_fields__)
    assert [k for k, ok in config.items() if ok is not True] == []
