"""The content check in a worker process gives the replay the same result as the
check in process: the same divergences, in the same order and the same words,
also when replay stops early, the trace is cut off, or a record is bad."""

from __future__ import annotations

import orjson
import pytest

from kvtrace.workers import policy as workers
from kvtrace.replay.kv_content import worker as content_worker
from kvtrace.replay import replay_file
from kvtrace.replay.replayer import Replayer
from kvtrace.trace import TraceError, TraceReader

from tests._paths import REPO
from tests.mini_traces import load_records, save_records
from tests.unit.workers import test_record_worker as rw
from tests.unit.workers.test_record_worker import REAL

TRACES = REPO / "traces"


def both(path, **kw) -> tuple:
    """(in process, in a worker): the replay results as JSON, and the check's counts."""
    out = []
    for worker in (False, True):
        r = replay_file(path, device="cpu", worker=worker, **kw)
        out.append(([d.to_json() for d in r.divergences], r.slots_checked, r.assumed_loads,
                    r.device, r.stopped, r.truncation))
    return out[0], out[1]


def kv(divs: list[dict]) -> list[dict]:
    return [d for d in divs if d["kind"] == "kv-content"]


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.jsonl.gz")) + sorted(TRACES.glob("faults/*.jsonl.gz"))
                         + sorted(TRACES.glob("vllm-bugs/*.jsonl.gz")), ids=lambda p: p.name)
def test_real_vllm_traces_replay_the_same_with_a_worker(path):
    here, there = both(path)
    assert there == here
    assert here[1] > 0   # the check ran


def test_divergences_keep_their_place_among_the_others(faulty, monkeypatch):
    """Content divergences interleave with counter divergences; with the main
    process far ahead of the worker, or made to wait for it, they land where the
    check in process puts them."""
    here, there = both(faulty)
    divs = here[0]
    assert len(kv(divs)) >= 2 and len({d["kind"] for d in divs}) >= 2
    assert there == here
    monkeypatch.setattr(content_worker, "MAX_LAG", 1)   # wait for the worker at every step
    assert both(faulty)[1] == here


def test_a_trace_cut_off_replays_the_same_up_to_the_cut(faulty, tmp_path):
    recs = load_records(faulty)
    steps = [i for i, r in enumerate(recs) if r["kind"] == "step"]
    cut = steps[len(steps) * 3 // 4]
    data = b"".join(orjson.dumps(r) + b"\n" for r in recs[:cut]) + orjson.dumps(recs[cut])[:40]
    path = tmp_path / "cut.jsonl"
    path.write_bytes(data)
    here, there = both(path)
    assert here[5] and "cut off" in here[5]
    assert kv(here[0])
    assert there == here


def test_a_replay_stopped_by_an_engine_assertion_drops_later_content_results(faulty, tmp_path):
    """Replay stops at the assertion; the worker checks the whole file, but what
    it finds after the stop is not reported."""
    recs = load_records(faulty)
    whole = replay_file(faulty, device="cpu", worker=False)
    last_kv = max(d.seq for d in whole.divergences if d.kind == "kv-content")
    # A step between the first content divergence and the last, where the
    # connector's answer now claims more cached tokens than the request has.
    first_kv = min(d.seq for d in whole.divergences if d.kind == "kv-content")
    at = next(i for i, r in enumerate(recs) if r["kind"] == "step" and first_kv < r["seq"] < last_kv
              and r.get("lookups"))
    for lk in recs[at]["lookups"]:
        lk["ext"] = 800 - lk["local"]
    path = save_records(recs, tmp_path / "stops.jsonl")
    here, there = both(path)
    assert here[4] and "assertion" in here[4]
    assert kv(here[0]) and max(d["seq"] for d in kv(here[0])) < recs[at]["seq"]
    assert there == here


def _stopped_early(faulty) -> tuple[list[dict], int]:
    """The faulty trace with an engine assertion between its first content
    divergence and its last, and the line of the first step after it."""
    recs = load_records(faulty)
    whole = replay_file(faulty, device="cpu", worker=False)
    kv_seqs = [d.seq for d in whole.divergences if d.kind == "kv-content"]
    at = next(i for i, r in enumerate(recs) if r["kind"] == "step" and min(kv_seqs) < r["seq"] < max(kv_seqs)
              and r.get("lookups"))
    for lk in recs[at]["lookups"]:
        lk["ext"] = 800 - lk["local"]
    after = next(i for i in range(at + 1, len(recs)) if recs[i]["kind"] == "step")
    return recs, after + 1   # the header is line 1


# The content check is robust to every record the reader passes, so a check
# that breaks is made so: the worker processes of a test load this hook.
_HOOK = """
import os
_at = os.environ.get("KVTRACE_TEST_BREAK_CHECK_AT")
if _at:
    from kvtrace.replay.kv_content import check as content
    _real = content.ContentCheck.step
    def _step(self, rec, line, tag=None):
        if line is not None and line >= int(_at):
            raise RuntimeError("the check broken on purpose")
        return _real(self, rec, line, tag)
    content.ContentCheck.step = _step
"""


@pytest.fixture
def break_the_worker_check(monkeypatch, tmp_path):
    """``break_the_worker_check(line)``: worker processes started from now on
    raise in their content check at the first step at or after ``line``."""
    import os

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    return lambda line: monkeypatch.setenv("KVTRACE_TEST_BREAK_CHECK_AT", str(line))


def test_records_after_the_stop_that_fail_the_worker_do_not_fail_the_replay(faulty, tmp_path,
                                                                            break_the_worker_check):
    """After an engine assertion the main process replays nothing more, but the
    worker goes on; its check breaking there must not cost the results of the
    steps before the stop."""
    recs, after = _stopped_early(faulty)
    path = save_records(recs, tmp_path / "stops.jsonl")
    here = replay_file(path, device="cpu", worker=False)
    assert here.stopped and kv([d.to_json() for d in here.divergences])
    break_the_worker_check(after)
    there = replay_file(path, device="cpu", worker=True)
    assert [d.to_json() for d in there.divergences] == [d.to_json() for d in here.divergences]
    assert (there.slots_checked, there.stopped) == (here.slots_checked, here.stopped)
    # The hook does break the worker: a replay that needs a result past it fails.
    break_the_worker_check(3)
    with pytest.raises(content_worker.ContentWorkerError, match="the check broken on purpose"):
        replay_file(path, device="cpu", worker=True)


def test_a_check_that_never_starts_fails_even_without_steps(tmp_path):
    header = load_records(TRACES / "preemption.jsonl.gz")[0]
    arrival = next(r for r in load_records(TRACES / "preemption.jsonl.gz") if r["kind"] == "arrival")
    path = save_records([header, dict(arrival, seq=1)], tmp_path / "no-steps.jsonl")
    with pytest.raises(ValueError, match="unknown device"):
        replay_file(path, device="no-such-device", worker=False)
    with pytest.raises(content_worker.ContentWorkerError, match="unknown device"):
        replay_file(path, device="no-such-device", worker=True)


def test_bad_input_gets_the_same_error_and_leaves_no_worker(faulty, tmp_path):
    recs = load_records(faulty)
    mid = len(recs) // 2
    recs[mid]["seq"] = "seven"
    path = save_records(recs, tmp_path / "bad.jsonl")
    errors = []
    for worker in (False, True):
        with pytest.raises(TraceError) as e:
            replay_file(path, device="cpu", worker=worker)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and f":{mid + 1}: field 'seq'" in errors[0]   # the header is line 1


def test_a_worker_that_dies_is_an_error_not_a_clean_replay(faulty):
    """Results the worker never sent must not read as 'no divergence'."""
    reader = TraceReader(faulty)
    rp = Replayer(reader.header, str(faulty), device="cpu", content_worker=True)
    rp.content._proc.kill()
    rp.content._proc.wait()
    with pytest.raises(content_worker.ContentWorkerError, match="exit code -9"):
        with reader:
            for e in reader:
                rp.feed(e, reader.last_line)
        rp.finish()
    rp.close()


def test_the_command_reports_the_same_with_a_worker(faulty, monkeypatch, capsysbinary):
    from kvtrace.cli import run

    outputs = []
    for choice in ("0", "1"):
        monkeypatch.setenv(workers.ENV, choice)
        assert run(["replay", "--json", "--device", "cpu", str(faulty)]) == 1
        outputs.append(capsysbinary.readouterr().out)
    assert b"kv-content" in outputs[0]
    assert outputs[1] == outputs[0]


def test_a_worker_that_read_less_than_was_replayed_is_an_error(faulty, tmp_path):
    """A worker that found the file's end before a step the main process
    replayed (here: it was given a shorter file; replay shares one file and one
    end between them) has not checked that step: replay says so instead of
    reporting it as checked."""
    recs = load_records(faulty)
    short = save_records(recs[: len(recs) // 2], tmp_path / "short.jsonl")
    rp = Replayer(TraceReader(short).header, str(short), device="cpu", content_worker=True)
    with TraceReader(faulty) as reader:
        for e in reader:
            rp.feed(e, reader.last_line)
    with pytest.raises(content_worker.ContentWorkerError,
                       match=r"stopped at line \d+ of the trace: it found the end of the file there"):
        rp.finish()
    rp.close()


def test_a_worker_that_cannot_start_its_check_fails_the_replay_early(faulty, monkeypatch):
    """A device the worker cannot use ends the replay at once, with the reason."""
    import time

    from kvtrace.replay import replayer

    reader = TraceReader(faulty)
    rp = Replayer(reader.header, str(faulty), device="no-such-device", content_worker=True)
    deadline = time.monotonic() + 60
    with pytest.raises(content_worker.ContentWorkerError, match="unknown device 'no-such-device'"):
        with reader:
            for e in reader:
                rp.feed(e, reader.last_line)
                if isinstance(e, replayer.ev.Step):
                    time.sleep(0.05)        # give the worker time to start
                assert time.monotonic() < deadline
    rp.close()


# --------------------------------------------------------------------------- the checks across records
# The content check's worker runs the reader's checks across records too, and
# the own checks of outputs, and the main process hands them over to it once
# it has caught up. Where that happens depends on timing; these tests choose
# the line, and count the main process's own checks, so that the worker's
# verdict is what they test.


@pytest.fixture
def hand_over(monkeypatch) -> dict:
    """``hand_over["at"] = line`` makes the main process hand the checks across
    records over at ``line`` (None: never); ``hand_over["took"]`` is where it
    did, and ``hand_over["own"]`` how many records it checked across records
    itself."""
    from kvtrace.trace import validate

    state: dict = {"at": None, "took": None, "own": 0}

    def takes_over(self, line):
        if state["at"] is None or line < state["at"]:
            return False
        state["took"] = line
        self.wait(line)
        return True

    real_check = validate.Validator.check

    def check(self, e):
        state["own"] += 1
        return real_check(self, e)

    monkeypatch.setattr(content_worker.ContentWorker, "takes_over", takes_over)
    monkeypatch.setattr(validate.Validator, "check", check)
    return state


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_vllm_traces_replay_the_same_when_the_worker_checks_across_records(path, hand_over):
    here = rw.result(path, 0, "cpu")
    assert hand_over["own"] > 0
    hand_over.update(own=0)
    hand_over["at"] = 2   # the first record after the header
    assert rw.result(path, 1, "cpu") == here
    # From the hand-over on, the main process runs no check across records.
    assert hand_over["took"] == 2 and hand_over["own"] == 0


@pytest.mark.parametrize("spoil", [rw._bad_schema, rw._unknown_request, rw._undecodable,
                                   rw._block_out_of_range, rw._out_of_order, rw._after_the_end,
                                   rw._bad_output, rw._undecodable_output, rw._kind_not_a_name],
                         ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("at", ["start", "the bad line", "never"])
def test_bad_input_gets_the_same_error_wherever_the_checks_are_handed_over(faulty, tmp_path, spoil,
                                                                           at, hand_over):
    recs = load_records(faulty)
    spoil(recs)
    path = save_records(recs, tmp_path / "bad.jsonl")
    here = rw.error(path, 0, "cpu")
    assert here.startswith(f"{path}:")
    bad_line = int(here[len(f"{path}:"):].split(":")[0])
    hand_over["at"] = {"start": 2, "the bad line": bad_line, "never": None}[at]
    hand_over.update(own=0)
    assert rw.error(path, 1, "cpu") == here
    # Lines 2 to the bad one reach the checks across records, but for a record
    # its own checks refuse.
    across = spoil in (rw._unknown_request, rw._block_out_of_range)
    if at == "start":   # the worker's checks across records alone
        assert hand_over["own"] == 0 and hand_over["took"] == 2
    if at == "never":
        assert hand_over["took"] is None and hand_over["own"] == bad_line - 2 + across
    if at == "the bad line" and across:   # the worker refuses it
        assert hand_over["took"] == bad_line and hand_over["own"] == bad_line - 2


@pytest.mark.parametrize("at", [2, None], ids=["handed-over", "kept"])
def test_a_cut_trace_replays_the_same_when_the_worker_checks_across_records(faulty, tmp_path, at,
                                                                             hand_over):
    recs = load_records(faulty)
    cut = len(recs) * 2 // 3
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs[:cut]) + orjson.dumps(recs[cut])[:40])
    here = rw.result(path, 0, "cpu")
    assert here[3] and "cut off" in here[3] and kv(here[0])
    hand_over["at"] = at
    assert rw.result(path, 1, "cpu") == here
    assert hand_over["took"] == at


def test_a_check_that_fails_after_the_stop_still_passes_the_later_records(faulty, tmp_path, hand_over,
                                                                        break_the_worker_check):
    """The worker's content check breaks after an engine assertion; the main
    process, which has handed the checks across records over, still needs the
    worker to pass every later record, and gets the replay it gets in one
    process."""
    recs, after = _stopped_early(faulty)
    path = save_records(recs, tmp_path / "stops.jsonl")
    here = rw.result(path, 0, "cpu")
    assert here[4] and kv(here[0])
    hand_over.update(at=2, own=0)
    break_the_worker_check(after)
    assert rw.result(path, 1, "cpu") == here
    assert hand_over["took"] == 2 and hand_over["own"] == 0


def test_a_worker_that_read_less_than_the_hand_over_needs_is_an_error(faulty, tmp_path, hand_over):
    """As above, past the hand-over: the main process waits for the worker's
    checks of each line, and a worker that has ended without them is an error."""
    recs = load_records(faulty)
    short = save_records(recs[: len(recs) // 2], tmp_path / "short.jsonl")
    rp = Replayer(TraceReader(short).header, str(short), device="cpu", content_worker=True, gate=True)
    hand_over["at"] = 2
    with pytest.raises(content_worker.ContentWorkerError, match="it found the end of the file there"):
        with TraceReader(faulty) as reader:
            for e in reader.checked_elsewhere(rp.content):
                rp.feed(e, reader.last_line)
    assert hand_over["took"] == 2 and reader.last_line == len(recs) // 2 + 1
    rp.close()



# --------------------------------------------------------------------------- a worker ahead


def _after_a_step(recs) -> int:
    return [i for i, r in enumerate(recs) if r["kind"] == "step" and r.get("running")][2] + 1


def _unknown_kind(recs):
    i = _after_a_step(recs)
    recs[i] = {"kind": "nonsense", "seq": recs[i]["seq"]}


def _not_an_object(recs):
    recs[_after_a_step(recs)] = [1, 2]


def _bad_arrival(recs):
    i = _after_a_step(recs)
    recs[i] = {"kind": "arrival", "seq": recs[i]["seq"], "req": "zz", "prompt_token_ids": "x"}


@pytest.mark.parametrize("spoil", [_unknown_kind, _not_an_object, _bad_arrival],
                         ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_record_right_after_a_step_gets_the_same_error_when_the_worker_is_ahead(
        faulty, tmp_path, spoil, workers, monkeypatch):
    """The worker decodes this record unchecked (its kind is not an output's)
    and fails on it with some exception. It must still report the step just
    before it, which the main process replays before it reaches the bad line
    and refuses it. Here the main process hands that step over only once the
    worker has ended."""
    recs = load_records(faulty)
    spoil(recs)
    path = save_records(recs, tmp_path / "bad.jsonl")
    here = rw.error(path, 0, "cpu")
    bad_line = int(here[len(f"{path}:"):].split(":")[0])
    real = content_worker.ContentWorker.step
    waited = []

    def step(self, rec, line, tag=None):
        if line == bad_line - 1:
            self._proc.wait(timeout=60)
            waited.append(line)
        return real(self, rec, line, tag)

    monkeypatch.setattr(content_worker.ContentWorker, "step", step)
    assert rw.error(path, workers, "cpu") == here
    assert waited == [bad_line - 1]
