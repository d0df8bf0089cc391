"""Streaming-input sessions (vLLM's resumable requests) in the trace format:
each input chunk is an arrival under the session's id, marked ``resumable``,
and the end of its input an arrival under that id without the mark. The
reader accepts them; the reference refuses them by name at the first chunk.
The real engine's recording is in tests/test_vllm_recorder.py."""

from __future__ import annotations

import pytest

from kvtrace import cli
from kvtrace.replay import replay_file
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace.events import Arrival, to_json
from mini_traces import load_records, save_records, write_mini_trace


def _arrival(req: str, prompt: list[int], seq: int, **kw) -> dict:
    return to_json(Arrival(seq=seq, req=req, prompt_token_ids=prompt, max_tokens=3, **kw))


def _with_second_arrival(tmp_path, first_resumable: bool, resumable: bool):
    """A mini trace whose first request (marked ``first_resumable``) gets a
    second arrival (marked ``resumable``) right after its first one (line 3),
    the later records renumbered."""
    records = load_records(write_mini_trace(tmp_path / "base.jsonl"))
    first = records[1]
    assert first["kind"] == "arrival"
    if first_resumable:
        first["resumable"] = True
    extra = _arrival(first["req"], [7, 8, 9], 0, resumable=resumable)
    records.insert(2, extra)
    for seq, r in enumerate(records[1:]):
        r["seq"] = seq
    return save_records(records, tmp_path / "edited.jsonl"), first["req"]


def test_an_ordinary_arrival_is_written_as_before():
    """The flag is written only when it is set: traces without sessions keep
    their bytes."""
    assert "resumable" not in _arrival("r", [1, 2], 0)
    assert _arrival("r", [1, 2], 0, resumable=True)["resumable"] is True


def test_a_session_s_further_chunks_and_the_end_of_its_input_are_read(tmp_path):
    for resumable in (True, False):   # a further chunk, or the end of the input
        path, req = _with_second_arrival(tmp_path, first_resumable=True, resumable=resumable)
        with TraceReader(path) as reader:
            arrivals = [e for e in reader if e.kind == "arrival" and e.req == req]
        assert [a.resumable for a in arrivals] == [True, resumable]
        assert arrivals[1].prompt_token_ids == [7, 8, 9]


def test_a_second_arrival_of_an_ordinary_request_is_still_refused(tmp_path):
    path, req = _with_second_arrival(tmp_path, first_resumable=False, resumable=True)
    with pytest.raises(TraceError) as e, TraceReader(path) as reader:
        list(reader)
    assert (e.value.line, e.value.problem) == (3, f"request '{req}' arrives twice")


def test_the_flag_must_be_a_boolean(tmp_path, capsys):
    records = load_records(write_mini_trace(tmp_path / "base.jsonl"))
    records[1]["resumable"] = "yes"
    path = save_records(records, tmp_path / "bad.jsonl")
    assert cli.run(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"kvtrace: {path}:2: field 'resumable' must be true or false, got a string"


@pytest.mark.parametrize("device", [None, "cpu"], ids=["counts", "content"])
def test_the_reference_refuses_a_session_by_name_at_its_first_chunk(tmp_path, capsys, device):
    path, req = _with_second_arrival(tmp_path, first_resumable=True, resumable=True)
    with pytest.raises(TraceError) as e:
        replay_file(path, device=device)
    assert e.value.line == 2
    assert e.value.problem.startswith(f"request '{req}' is a streaming-input session")
    assert cli.run(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{path}:2: request '{req}'" in err
