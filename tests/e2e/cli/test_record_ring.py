"""'kvtrace record --ring' at its edges: a directory another recorder holds,
-o naming a file, and what the help says -o is."""

from __future__ import annotations

import os

from kvtrace import cli
from kvtrace.record.folder import open_folder


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
