"""Records that another reader of the same file has checked, decoded without checks.

Replay can check a trace's records in a second process while the main process
replays them (replay/record_worker.py), or run its content check in a second
process while the main process checks them (replay/content_worker.py). Either
way, one side decodes records that the other side has checked already, and
decoding them again with every check would cost it half its time. ``decode``
here builds the same events as ``events.decode`` does for a record that passes
its checks, without the checks: steps and outputs, the bulk of a trace, are
built field by field; the rarer kinds go through their checked decoders.

Never use it on a record nothing has checked: a bad record gives a wrong event
or an arbitrary exception here, not a ``SchemaError``.
"""

from __future__ import annotations

from typing import Any

from . import events as ev

_New, _Running, _State = ev.ScheduledNew, ev.ScheduledRunning, ev.RequestState


def _new(d: dict) -> ev.ScheduledNew:
    return _New(d["req"], d["num_computed_tokens"], d["num_scheduled_tokens"], d["block_ids"])


def _running(d: dict) -> ev.ScheduledRunning:
    return _Running(d["req"], d["num_computed_tokens"], d["num_scheduled_tokens"], d["new_block_ids"])


def _state(d: dict) -> ev.RequestState:
    return _State(d["req"], d["status"], d["num_computed_tokens"], d["num_tokens"],
                  d["num_preemptions"], d["block_ids"])


def step(d: dict) -> ev.Step:
    get = d.get
    loads = get("loads")
    return ev.Step(
        d["seq"], d["step"],
        [_new(x) for x in get("new", ())],
        [_new(x) for x in get("resumed", ())],
        [_running(x) for x in get("running", ())],
        get("preempted", []), get("finished", []),
        [ev.Lookup.from_json(x) for x in get("lookups", ())],
        None if loads is None else [ev.KVLoad(x["req"], x["start"], x["end"]) for x in loads],
        [_state(x) for x in get("states", ())],
        get("num_free_blocks"),
        get("spec"),
        get("grammar"),
        get("throttle_prefills", False),
    )


def output(d: dict) -> ev.Output:
    get = d.get
    conn = get("connector")
    return ev.Output(
        d["seq"], d["step"], get("sampled", {}),
        None if conn is None else ev.ConnectorOutput.from_json(conn),
        get("finished", {}),
        [_state(x) for x in get("states", ())],
        get("grammar_rejected"),
        get("pooled"),
    )


_DECODERS = {"step": step, "output": output}


def decode(obj: Any) -> ev.Event:
    """A checked record's event, as ``events.decode`` builds it."""
    kind = obj["kind"]
    fast = _DECODERS.get(kind)
    return fast(obj) if fast is not None else ev.EVENT_TYPES[kind].from_json(obj)
