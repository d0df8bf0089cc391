"""Keyframes: a replay from each keyframe of a trace finds exactly what the
replay of the whole trace finds from that step on, on every stored trace and
on embedded-engine runs with faults; a damaged keyframe is one line and
exit 2; what a replay from a keyframe checks is said."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from bench.keyframes import check
from kvtrace import cli
from kvtrace.engine import record_embedded
from kvtrace.replay import replay_file
from kvtrace.replay.keyframes import add_keyframes, replay_from
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO as ROOT
STORED = sorted(p.relative_to(ROOT / "traces").as_posix()
                for p in (ROOT / "traces").rglob("*.jsonl*"))


def run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", STORED)
def test_replay_from_every_keyframe_equals_the_whole_replay(name, tmp_path):
    c = check(ROOT / "traces" / name, 3, tmp_path)
    assert c.keyframes >= 1 or "step_failed" in name
    assert c.mismatches == []


@pytest.mark.parametrize("workload, fault, seed, async_", [
    ("offload", "stale-cached-on-preempt", 3, False),
    ("offload", "async-load-overshoot", 4, True),
    ("kv-pressure", "stale-computed-after-failed-schedule", 5, False),
    ("hybrid-state-pressure", "state-key-outlives-eviction", 6, False),
    ("hybrid-three-kinds", None, 7, True),
    ("load-failures", None, 8, False),
])
def test_embedded_runs_with_faults_replay_the_same_from_each_keyframe(
        workload, fault, seed, async_, tmp_path):
    src = tmp_path / "run.jsonl.gz"
    record_embedded(src, workload, fault, seed=seed, async_scheduling=async_)
    c = check(src, 5, tmp_path)
    assert c.keyframes >= 3
    assert c.mismatches == []


def _keyframed(tmp_path, every=20) -> Path:
    src = ROOT / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz"
    dst = tmp_path / "kf.jsonl.gz"
    made, steps = add_keyframes(src, dst, every)
    assert made == (steps - 1) // every
    return dst


def _rewrite(src: Path, dst: Path, change) -> None:
    with gzip.open(src, "rb") as f, gzip.open(dst, "wb") as g:
        for line in f:
            rec = orjson.loads(line)
            if rec.get("kind") == "keyframe":
                change(rec)
            g.write(orjson.dumps(rec) + b"\n")


def test_a_changed_keyframe_changes_what_replay_from_it_finds(tmp_path):
    """The equivalence could fail: a keyframe whose pool has one more reference
    on a free block is not what the replay had there."""
    good = _keyframed(tmp_path)
    whole = replay_file(good, device=None)
    bad = tmp_path / "bad.jsonl.gz"

    def leak(rec):
        pool = rec["state"]["packed"]["pool"]
        free = pool["free"]
        first = free[0][0]
        pool["ref_cnt"][first] += 1       # a free block, held by no one
        free[0] = [first + 1, free[0][1] - 1] if free[0][1] > 1 else None
        pool["free"] = [r for r in free if r]

    _rewrite(good, bad, leak)
    part = replay_from(bad, 40)
    cut = len(whole.divergences) - len(part.divergences)
    assert [d.to_json() for d in part.divergences] != [d.to_json() for d in whole.divergences[cut:]]


def test_replay_from_step_says_what_it_checked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    kf = _keyframed(tmp_path)
    code, out, _ = run(capsys, "replay", kf, "--from-step", 50)
    assert code == 1   # the fault's divergences after step 40
    assert "steps 40 to 133 of 134, from a keyframe" in " ".join(out.split())
    assert "KV content not checked: a replay from a keyframe" in out
    code, out, _ = run(capsys, "replay", kf, "--from-step", 50, "--json")
    doc = orjson.loads(out)
    assert doc["from_keyframe"] == 40 and doc["steps_checked"] == 94
    assert doc["kv_content"]["device"] is None


def test_no_keyframe_before_the_step_is_one_line(tmp_path, capsys):
    kf = _keyframed(tmp_path)
    code, out, err = run(capsys, "replay", kf, "--from-step", 5)
    assert code == 2 and out == ""
    line, = err.strip().splitlines()
    assert line.startswith(f"kvtrace: {kf}:") and "no keyframe at or before step 5" in line


@pytest.mark.parametrize("change, words", [
    (lambda rec: rec.update(format=99), "keyframe of format 99"),
    (lambda rec: rec["state"]["objects"][0].update(o="os:system"), "not kvtrace's"),
    (lambda rec: rec["state"].pop("root"), "no root"),
])
def test_a_keyframe_this_kvtrace_cannot_read_is_one_line(tmp_path, capsys, change, words):
    bad = tmp_path / "bad.jsonl.gz"
    _rewrite(_keyframed(tmp_path), bad, change)
    code, _, err = run(capsys, "replay", bad, "--from-step", 45)
    assert code == 2
    line, = err.strip().splitlines()
    assert line.startswith(f"kvtrace: {bad}") and words in line, line


def test_replay_from_a_keyframe_of_a_cut_trace_goes_up_to_the_cut(tmp_path):
    kf = _keyframed(tmp_path, every=10)
    lines = gzip.open(kf, "rb").read().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl.gz"
    with gzip.open(cut, "wb") as g:
        g.writelines(lines[: len(lines) * 2 // 3])
    whole = replay_file(cut, device=None)
    part = replay_from(cut, 60)
    assert part.truncation is not None and part.truncation == whole.truncation
    assert part.steps == whole.steps
    got = [d.to_json() for d in part.divergences]
    assert got == [d.to_json() for d in whole.divergences[len(whole.divergences) - len(got):]]


def test_the_keyframe_and_the_step_after_it_share_a_sequence_number(tmp_path):
    kf = _keyframed(tmp_path)
    seen = []
    with TraceReader(kf) as r:
        events = list(r)
    for a, b in zip(events, events[1:]):
        if type(a) is ev.Keyframe:
            assert type(b) is ev.Step and (b.seq, b.step) == (a.seq, a.step)
            seen.append(a.step)
    assert seen == [20, 40, 60, 80, 100, 120]


def test_a_keyframe_after_its_step_is_refused(tmp_path):
    kf = _keyframed(tmp_path)
    lines = gzip.open(kf, "rb").read().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if b'"kind":"keyframe"' in line)
    lines[i], lines[i + 1] = lines[i + 1], lines[i]          # the step first
    rec = orjson.loads(lines[i + 1])
    rec["seq"] = orjson.loads(lines[i])["seq"] + 1
    lines[i + 1] = orjson.dumps(rec) + b"\n"
    bad = tmp_path / "late.jsonl.gz"
    with gzip.open(bad, "wb") as g:
        g.writelines(lines)
    with pytest.raises(TraceError, match="a keyframe comes before its step"):
        replay_file(bad, device=None)


def test_replay_o_from_a_keyframe_writes_a_trace_that_starts_there(tmp_path):
    kf = _keyframed(tmp_path)
    out = tmp_path / "out.jsonl.gz"
    part = replay_from(kf, 60, out=out)
    with TraceReader(out) as r:
        events = list(r)
    assert type(events[0]) is ev.Keyframe and events[0].step == 60
    again = replay_from(out, 60)
    assert again.steps == part.steps


def test_a_trace_that_starts_with_a_keyframe_replays_from_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    kf = _keyframed(tmp_path)
    out = tmp_path / "out.jsonl.gz"
    replay_from(kf, 60, out=out)
    code, text, _ = run(capsys, "replay", out, "--json")
    assert orjson.loads(text)["from_keyframe"] == 60
    code, text, _ = run(capsys, "replay", out, "--from-step", 0, "--json")
    assert orjson.loads(text)["from_keyframe"] == 60   # nothing comes before it


def test_redact_leaves_keyframes_out(tmp_path, capsys):
    kf = _keyframed(tmp_path)
    red = tmp_path / "red.jsonl.gz"
    code, out, _ = run(capsys, "redact", kf, red)
    assert code == 0 and "6 keyframes left out" in out
    assert b'"keyframe"' not in gzip.open(red, "rb").read()


def test_the_equivalence_check_sees_a_lost_divergence(tmp_path, monkeypatch):
    """A replay from a keyframe that lost a divergence the whole replay finds
    after the keyframe is a mismatch (the check compares with what the whole
    replay had not found when it reached the keyframe, not with its tail)."""
    import bench.keyframes as bk
    import kvtrace.replay.keyframes as kfm

    real = kfm.replay_from

    def lossy(*a, **k):
        r = real(*a, **k)
        r.divergences = r.divergences[1:]
        return r

    monkeypatch.setattr(kfm, "replay_from", lossy)
    c = bk.check(ROOT / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz", 3, tmp_path)
    assert c.keyframes >= 3 and c.mismatches


def test_a_keyframe_must_come_right_before_its_step(tmp_path):
    kf = _keyframed(tmp_path)
    lines = gzip.open(kf, "rb").read().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if b'"kind":"keyframe"' in line)
    rec = orjson.loads(lines[i])
    rec["step"] += 3   # names a later step than the record after it
    lines[i] = orjson.dumps(rec) + b"\n"
    bad = tmp_path / "misplaced.jsonl.gz"
    with gzip.open(bad, "wb") as g:
        g.writelines(lines)
    with pytest.raises(TraceError, match="a keyframe comes right before its step's record"):
        replay_file(bad, device=None)


def test_a_keyframe_replays_only_under_the_profile_that_made_it(tmp_path, capsys):
    src = ROOT / "traces" / "vllm-0.18" / "preemption.jsonl.gz"
    dst = tmp_path / "q.jsonl.gz"
    add_keyframes(src, dst, 20, profile="0.32")
    code, _, err = run(capsys, "replay", dst, "--from-step", 40)
    assert code == 2 and "made under the 0.32 profile, not legacy" in err
    code, _, _ = run(capsys, "replay", dst, "--from-step", 40, "--profile", "0.32")
    assert code in (0, 1)


@pytest.mark.parametrize("change, words", [
    (lambda st: st["packed"]["pool"].update(num_blocks=10**9), "blocks, the header's"),
    (lambda st: st["objects"][0]["f"].update(steps="five"), "not before step"),
    (lambda st: st["objects"][0]["f"].update(stopped="x"), "had stopped"),
    (lambda st: st["packed"]["pool"]["free"].append(st["packed"]["pool"]["free"][0]),
     "free queue"),
    (lambda st: st["objects"][0].update(o="kvtrace.record.step_writer:subprocess.Popen"),
     "not a class of kvtrace's"),
])
def test_a_damaged_state_is_refused_before_replay_runs(tmp_path, capsys, change, words):
    bad = tmp_path / "bad.jsonl.gz"
    _rewrite(_keyframed(tmp_path), bad, lambda rec: change(rec["state"]))
    code, _, err = run(capsys, "replay", bad, "--from-step", 45)
    assert code == 2, err
    line, = err.strip().splitlines()
    assert words in line, line


def test_the_same_trace_gives_the_same_keyframes_in_every_process(tmp_path):
    """Sets of request ids are written in order, not in the order string
    hashing (which changes from process to process) gives them."""
    import os
    import subprocess
    import sys

    src = ROOT / "traces" / "hybrid-state" / "qwen3-next-connector.jsonl.gz"
    made = []
    for seed in ("1", "2"):
        dst = tmp_path / f"kf{seed}.jsonl.gz"
        subprocess.run([sys.executable, "-c", "import sys; from kvtrace.cli import main; "
                        "sys.argv[0] = 'kvtrace'; main()", "keyframes", str(src), str(dst),
                        "--every", "5"], check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        made.append(gzip.decompress(dst.read_bytes()))
    assert made[0].count(b'"keyframe"') >= 3
    assert made[0] == made[1]
