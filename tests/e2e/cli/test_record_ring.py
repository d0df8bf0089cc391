"""'kvtrace record --ring' and '--keyframe-every' on the embedded engine: a
directory another recorder holds, -o naming a file, what the help says -o
is; the keyframes made by the writer process, never the engine's, and an
engine that exits without shutting down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtrace import cli
from kvtrace.flight import segment_files
from kvtrace.record.detached import wait_for_writers
from kvtrace.record.folder import PINS, open_folder
from kvtrace.replay.keyframes import Keyframer
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader


def run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_ring_directory_another_recorder_holds_is_refused(tmp_path, capsys):
    folder = tmp_path / "ring"
    claim = open_folder(folder)   # another 'kvtrace record --ring', before its first segment
    try:
        code, _, err = run(capsys, "record", "-o", folder, "--workload", "shared-prefix",
                           "--ring", "200KB", "--segment", "16KB")
    finally:
        os.close(claim)
    assert code == 2 and len(err.splitlines()) == 1
    assert str(folder) in err and "another recorder writes segments there now" in err
    assert os.listdir(folder) == []


def test_a_file_given_as_the_ring_directory_is_named(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("keep me\n")
    code, _, err = run(capsys, "record", "-o", f, "--workload", "shared-prefix",
                       "--ring", "200KB", "--segment", "16KB")
    assert code == 2 and len(err.splitlines()) == 1
    assert str(f) in err and "--ring writes a directory" in err
    assert f.read_text() == "keep me\n"


def test_the_help_says_out_is_a_directory_with_ring(capsys):
    code, out, _ = run(capsys, "record", "--help")
    assert code == 0
    said = " ".join(out[out.index("-o, --out"):out.index("--workload TEXT")].split())
    assert "Trace file to write" in said and "with --ring, the directory of segments" in said


# -- the flight recorder's writer process -------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]


def _record_until_exit(out: Path, *extra: str, seed: int = 3) -> int:
    """``kvtrace record`` of the embedded engine with ``extra`` arguments, in
    a process that calls ``os._exit`` as a random step begins (no shutdown, no
    end record); returns the steps it completed before."""
    r, w = os.pipe()
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from bench.hard_exit import drive_embedded; "
            f"drive_embedded({str(out)!r}, {w}, 'embedded-exit', {seed}, {extra!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(w,),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(w)
    completed = 0
    with os.fdopen(r) as progress:
        for line in progress:
            if line.strip() != "start":
                completed = int(line)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, err.decode()
    wait_for_writers(out, timeout=60)
    return completed


def _steps(path: Path) -> tuple[list[int], list[int], bool]:
    """A trace's step records, its keyframes' steps, and whether it is cut off."""
    steps, frames = [], []
    with TraceReader(path) as reader:
        for e in reader:
            if type(e) is ev.Step:
                steps.append(e.step)
            elif type(e) is ev.Keyframe:
                frames.append(e.step)
        cut = reader.truncation is not None
    return steps, frames, cut


def test_keyframes_are_made_outside_the_engines_process(tmp_path, monkeypatch):
    # The engine's process cannot make one: the writer process makes them all.
    def refuse(self, *a, **k):
        raise AssertionError("a keyframe made in the engine's process")

    monkeypatch.setattr(Keyframer, "feed", refuse)
    out = tmp_path / "k.jsonl.gz"
    assert cli.run(["record", "-o", str(out), "--workload", "offload", "--requests", "60",
                    "--keyframe-every", "20"]) == 0
    steps, frames, cut = _steps(out)
    assert not cut and steps
    assert frames == [s for s in steps if s and s % 20 == 0]


def test_a_killed_engine_keeps_its_keyframes_and_every_completed_step(tmp_path):
    out = tmp_path / "k.jsonl.gz"
    completed = _record_until_exit(out, "--keyframe-every", "25")
    assert completed > 50
    steps, frames, cut = _steps(out)
    assert cut
    assert set(range(completed)) <= set(steps)
    assert frames == [s for s in steps if s and s % 25 == 0]


def test_a_killed_engine_leaves_its_ring_replayable_and_pinned(tmp_path, capsys):
    folder = tmp_path / "ring"
    completed = _record_until_exit(folder, "--ring", "4MB", "--segment", "64KB")
    segments = segment_files(folder)
    assert len(segments) > 2
    steps, _, cut = _steps(segments[-1])
    assert cut and steps and set(range(steps[0], completed)) <= set(steps)
    pins = json.loads((folder / PINS).read_text())
    assert segments[-1].name in pins and "without its end" in pins[segments[-1].name]
    assert run(capsys, "replay", folder)[0] == 0   # clean up to the cut
