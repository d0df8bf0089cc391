"""The command line against hostile surroundings rather than hostile traces:
outputs that are devices or named pipes, existing outputs and a bad input,
file names that are not UTF-8, a standard output that is full, closed or whose
reader went away, and arguments that name what the machine lacks. Each answer
is an exit code and at most one line of ours on stderr, never a traceback, and
no file the user had is lost or replaced by something else."""

from __future__ import annotations

import gzip
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from kvtrace import cli

from tests._paths import REPO

TRACES = REPO / "traces"
CLEAN = TRACES / "preemption.jsonl.gz"
DIVERGENT = TRACES / "faults" / "spec-rejected-kept.jsonl.gz"
KVTRACE = [sys.executable, "-m", "kvtrace.cli"]
NOT_UTF8 = os.fsdecode(b"trace-\xff.jsonl.gz")


def _run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _bad_mid_trace(tmp_path: Path) -> Path:
    """The clean trace with line 51 broken: unusable, found only midway."""
    lines = gzip.decompress(CLEAN.read_bytes()).splitlines(keepends=True)
    lines[50] = b'{"seq": 4, oops}\n'
    bad = tmp_path / "mid.jsonl"
    bad.write_bytes(b"".join(lines))
    return bad


def _leftovers(folder: Path) -> list[str]:
    """Temporary outputs left behind."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


@pytest.mark.parametrize("argv", [
    ["redact", "{bad}", "{out}"],
    ["export", "--no-divergences", "{bad}", "-o", "{out}"],
    ["export", "{bad}", "-o", "{out}"],
    ["report", "{bad}", "-o", "{out}"],
    # Once put in place, ending 'interrupted', against the sentence before it in bad-input.md.
    ["replay", "{bad}", "-o", "{out}"],
], ids=["redact", "export-no-divergences", "export", "report", "replay"])
def test_a_bad_input_leaves_an_existing_output_as_it_was(tmp_path, capsys, argv):
    bad = _bad_mid_trace(tmp_path)
    out = tmp_path / "keep.jsonl"
    out.write_bytes(b"what the user had\n")
    code, _, err = _run(capsys, *(a.format(bad=bad, out=out) for a in argv))
    assert code == 2 and err.startswith(f"kvtrace: {bad}:51: ") and len(err.splitlines()) == 1
    assert out.read_bytes() == b"what the user had\n"
    assert _leftovers(tmp_path) == []


def test_an_input_named_like_a_temporary_file_is_not_destroyed(tmp_path, capsys):
    """Outputs are written under a fresh temporary name, never OUT.tmp, which
    could be the input."""
    src = tmp_path / "r.html.tmp"
    src.write_bytes(CLEAN.read_bytes())
    code, _, err = _run(capsys, "report", src, "-o", tmp_path / "r.html")
    assert code == 0, err
    assert src.read_bytes() == CLEAN.read_bytes()
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert _leftovers(tmp_path) == []
    umask = os.umask(0o022)
    os.umask(umask)
    # A report holds no prompt: the mode a new file gets (a trace's is 0600).
    assert stat.S_IMODE((tmp_path / "r.html").stat().st_mode) == 0o666 & ~umask


def test_an_output_in_a_missing_folder_is_named_as_given(tmp_path, capsys):
    for argv in (["report", CLEAN, "-o", "{o}.html"], ["export", CLEAN, "-o", "{o}.json"],
                 ["redact", CLEAN, "{o}.jsonl"], ["replay", CLEAN, "-o", "{o}.jsonl"]):
        missing = str(tmp_path / "no" / "such")
        code, _, err = _run(capsys, *(str(a).format(o=missing) for a in argv))
        assert code == 2, (argv[0], err)
        suffix = Path(argv[-1]).suffix
        assert err == f"kvtrace: {missing}{suffix}: No such file or directory\n", (argv[0], err)


@pytest.mark.parametrize("cmd", ["report", "export", "redact", "replay"])
def test_a_named_pipe_as_the_output_is_written_into_not_replaced(tmp_path, capsys, cmd):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    argv = {"report": ["report", CLEAN, "-o", fifo], "export": ["export", CLEAN, "-o", fifo],
            "redact": ["redact", CLEAN, fifo], "replay": ["replay", CLEAN, "-o", fifo]}[cmd]
    code, _, err = _run(capsys, *argv)
    reader.join(60)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got and len(got[0]) > 1000
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node (a private /dev/full) needs root")
@pytest.mark.parametrize("argv", [
    ["report", CLEAN, "-o", "{dev}"], ["export", CLEAN, "-o", "{dev}"],
    ["export", "--no-divergences", CLEAN, "-o", "{dev}"], ["redact", CLEAN, "{dev}"],
    ["replay", CLEAN, "-o", "{dev}"], ["record", "-o", "{dev}", "--workload", "offload"],
], ids=["report", "export", "export-no-divergences", "redact", "replay", "record"])
def test_a_full_device_as_the_output_is_named_and_left_alone(tmp_path, capsys, argv):
    dev = tmp_path / "full"
    os.mknod(dev, 0o644 | stat.S_IFCHR, os.makedev(1, 7))   # what /dev/full is
    code, _, err = _run(capsys, *(str(a).format(dev=dev) for a in argv))
    assert (code, err) == (2, f"kvtrace: {dev}: No space left on device\n")
    st = os.lstat(dev)
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert st.st_rdev == os.makedev(1, 7)
    assert _leftovers(tmp_path) == []


def test_file_names_that_are_not_utf8_are_shown_escaped(tmp_path, capsys):
    src = tmp_path / NOT_UTF8
    src.write_bytes(CLEAN.read_bytes())
    shown = str(tmp_path / "trace-\\xff.jsonl.gz")
    code, out, err = _run(capsys, "replay", "--json", src)
    assert code == 0 and orjson.loads(out)["trace"] == shown, err
    code, out, err = _run(capsys, "diff", "--json", src, CLEAN)
    assert code == 0 and orjson.loads(out)["a"]["path"] == shown, err
    code, _, err = _run(capsys, "replay", src, "-o", tmp_path / "r.jsonl")
    assert code == 0, err
    header = orjson.loads((tmp_path / "r.jsonl").read_bytes().split(b"\n")[0])
    assert header["meta"]["replayed_from"] == shown
    code, _, err = _run(capsys, "export", src, "-o", tmp_path / "e.json")
    assert code == 0 and orjson.loads((tmp_path / "e.json").read_bytes())["metadata"]["trace"] == shown
    code, _, err = _run(capsys, "report", CLEAN, "--against", src, "-o", tmp_path / "r.html")
    assert code == 0, err
    code, _, err = _run(capsys, "report", src, "-o", tmp_path / "s.html")
    assert code == 0 and "trace-\\xff.jsonl.gz" in (tmp_path / "s.html").read_text(), err


def _kvtrace(argv, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("env", dict(os.environ, KVTRACE_QUIET="1"))
    return subprocess.run(KVTRACE + [str(a) for a in argv], timeout=300, **kw)


def _kvtrace_with_no_reader(argv) -> subprocess.CompletedProcess:
    """kvtrace with standard output a pipe whose reader is gone: every write
    fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        return _kvtrace(argv, stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)


@pytest.mark.parametrize("trace,want", [(CLEAN, 0), (DIVERGENT, 1)], ids=["clean", "divergent"])
@pytest.mark.parametrize("json", [False, True], ids=["text", "json"])
def test_a_reader_that_went_away_leaves_the_exit_code_to_the_replay(trace, want, json):
    """`kvtrace replay T | head -1`: the pipe is gone before the report is
    written; the exit code still says whether T diverges (rich's default
    would exit 1 for a clean trace)."""
    p = _kvtrace_with_no_reader(["replay", *(["--json"] if json else []), trace])
    assert p.returncode == want and p.stderr == b"", p.stderr


@pytest.mark.parametrize("argv", [["show", CLEAN], ["replay", "--json", CLEAN], ["diff", CLEAN, CLEAN],
                                  ["record", "-o", "{tmp}/t.jsonl", "--workload", "offload"],
                                  ["--version"]], ids=["show", "replay-json", "diff", "record", "version"])
def test_a_full_standard_output_is_one_line(tmp_path, argv):
    """Named as standard output where kvtrace writes it; click's own --version
    gets the error without a name, one line all the same."""
    with open("/dev/full", "wb") as full:
        p = _kvtrace([str(a).format(tmp=tmp_path) for a in argv], stdout=full, stderr=subprocess.PIPE)
    want = (b"kvtrace: No space left on device (ENOSPC)\n" if argv == ["--version"]
            else b"kvtrace: standard output: No space left on device\n")
    assert (p.returncode, p.stderr) == (2, want)


def test_a_closed_standard_output_is_said_and_a_closed_stderr_keeps_the_exit_code(tmp_path):
    cmd = " ".join(KVTRACE)
    p = subprocess.run(f"{cmd} replay --json {CLEAN} >&-", shell=True, stderr=subprocess.PIPE,
                       timeout=300)
    assert (p.returncode, p.stderr) == (2, b"kvtrace: standard output is closed: nowhere to "
                                           b"write the report\n")
    bad = _bad_mid_trace(tmp_path)
    p = subprocess.run(f"{cmd} replay {bad} 2>&-", shell=True, stdout=subprocess.PIPE, timeout=300)
    assert (p.returncode, p.stdout) == (2, b"")   # the error never lands on stdout


def test_more_jobs_than_traces_start_one_process_per_trace(monkeypatch, capsys):
    """-j 10000 on two traces once started 10000 processes, and hung."""
    import concurrent.futures

    from kvtrace.replay import many

    asked = []

    class Pool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers):
            asked.append(max_workers)
            super().__init__(max_workers)

    monkeypatch.setattr(many, "ProcessPoolExecutor", Pool)
    code, out, err = _run(capsys, "replay", "--no-kv-check", "-j", "10000", CLEAN, DIVERGENT)
    assert asked == [2] and code == 1, err
    assert CLEAN.name in out and DIVERGENT.name in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is present")
def test_cuda_asked_for_on_a_machine_without_it_is_a_bad_argument(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    for argv in (["replay", "--device", "cuda", CLEAN, "-o", out],
                 ["replay", "--device", "cuda", CLEAN, DIVERGENT]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("kvtrace: device 'cuda' was asked for, but torch "), err
        assert not out.exists()


def test_a_seed_out_of_range_is_refused_before_the_output_is_touched(tmp_path, capsys):
    out = tmp_path / "keep.jsonl.gz"
    out.write_bytes(b"what the user had\n")
    code, _, err = _run(capsys, "record", "-o", out, "--workload", "offload",
                        "--seed", str(2 ** 64))
    assert code == 2 and "Invalid value for '--seed'" in err and len(err.splitlines()) == 1
    assert out.read_bytes() == b"what the user had\n"


@pytest.mark.vllm
@pytest.mark.parametrize("cls,why", [("nonexistent.Mod", "cannot import 'nonexistent'"),
                                     ("os.path", "'os.path' is not a class")])
def test_a_scheduler_class_that_names_no_class_is_a_bad_argument(capsys, cls, why):
    from tests._require import require

    require("vllm", "replay --scheduler-cls loads vLLM")
    code, _, err = _run(capsys, "replay", "--scheduler-cls", cls, CLEAN)
    ours = [line for line in err.splitlines() if line.startswith("kvtrace:")]
    assert code == 2 and len(ours) == 1 and why in ours[0], err
    assert "Traceback" not in err


def test_dev_stdout_as_the_output_is_written_through_the_descriptor(tmp_path):
    """-o /dev/stdout names this process's standard output: through a pipe it
    is written into, and a file the shell opened to append to (>>) is appended
    to, not replaced or written over from its start."""
    p = _kvtrace(["export", "--no-divergences", CLEAN, "-o", "/dev/stdout"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.returncode == 0 and p.stdout.startswith(b'{"displayTimeUnit"'), p.stderr
    log = tmp_path / "log"
    log.write_bytes(b"OLD\n")
    with open(log, "ab") as f:
        p = _kvtrace(["export", "--no-divergences", CLEAN, "-o", "/dev/stdout"], stdout=f,
                     stderr=subprocess.PIPE)
    assert p.returncode == 0, p.stderr
    got = log.read_bytes()
    assert got.startswith(b'OLD\n{"displayTimeUnit"') and got.endswith(b"wrote /dev/stdout\n")


@pytest.mark.parametrize("argv", [["replay", CLEAN, "-o", "{out}"], ["redact", CLEAN, "{out}"],
                                  ["export", CLEAN, "-o", "{out}"], ["report", CLEAN, "-o", "{out}"]],
                         ids=["replay", "redact", "export", "report"])
def test_an_output_that_outgrows_the_file_size_limit_leaves_the_old_file(tmp_path, argv):
    """A write that fails (here: past the process's file-size limit, EFBIG)
    puts nothing in place, not even a cut replayed trace."""
    import resource

    out = tmp_path / "out.jsonl"
    out.write_bytes(b"what the user had\n")
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))  # noqa: E731
    p = _kvtrace([str(a).format(out=out) for a in argv], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, preexec_fn=limit)
    assert (p.returncode, p.stderr) == (2, f"kvtrace: {out}: File too large\n".encode())
    assert out.read_bytes() == b"what the user had\n"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("argv", [["export", "--no-divergences", CLEAN, "-o", "{tmp}/e.json"],
                                  ["report", CLEAN, "-o", "{tmp}/r.html"],
                                  ["redact", CLEAN, "{tmp}/r.jsonl"],
                                  ["record", "-o", "{tmp}/t.jsonl", "--workload", "offload"]],
                         ids=["export", "report", "redact", "record"])
def test_a_reader_that_went_away_does_not_fail_a_command_that_wrote_its_file(tmp_path, argv):
    p = _kvtrace_with_no_reader([str(a).format(tmp=tmp_path) for a in argv])
    assert p.returncode == 0 and p.stderr == b"", p.stderr   # click alone would exit 1


def test_a_replaced_output_keeps_its_mode_and_a_long_name_fits(tmp_path, capsys):
    out = tmp_path / "e.json"
    out.write_bytes(b"old")
    out.chmod(0o640)
    code, _, err = _run(capsys, "export", "--no-divergences", CLEAN, "-o", out)
    assert code == 0 and stat.S_IMODE(out.stat().st_mode) == 0o640, err
    long = tmp_path / ("a" * 250 + ".html")   # 255 bytes: the most a name may have
    code, _, err = _run(capsys, "report", CLEAN, "-o", long)
    assert code == 0 and long.read_text().startswith("<!DOCTYPE html>"), err


@pytest.mark.parametrize("signals,code,said", [
    ([signal.SIGINT], 130, "interrupted"),
    ([signal.SIGINT, signal.SIGINT], 130, "interrupted"),   # a double Ctrl-C
    ([signal.SIGTERM], 143, "stopped by SIGTERM"),
    ([signal.SIGHUP], 129, "stopped by SIGHUP"),
], ids=["int", "int-int", "term", "hup"])
def test_a_signal_unwinds_replay_and_its_output_ends_interrupted(tmp_path, signals, code, said):
    """The replay waits on a named pipe for more of its trace when the signal
    comes: one line on stderr, and -o's output in place, ending interrupted,
    with no temporary file left (SIGTERM once left both the temporary file and
    no output; two Ctrl-Cs close together, the old file)."""
    import time

    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"what the user had\n")
    def as_at_a_terminal():
        # kvtrace leaves a signal it inherits ignored as it is (nohup, a
        # background job): a test run under nohup must not hand that on.
        for s in (signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)

    p = subprocess.Popen(KVTRACE + ["replay", "--no-kv-check", str(fifo), "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, KVTRACE_QUIET="1"), preexec_fn=as_at_a_terminal)
    lines = gzip.decompress(CLEAN.read_bytes()).splitlines(keepends=True)
    with open(fifo, "wb") as w:
        w.write(b"".join(lines[:40]))
        w.flush()
        deadline = time.monotonic() + 120
        while not _leftovers(tmp_path) and time.monotonic() < deadline:   # -o is open
            time.sleep(0.05)
        assert _leftovers(tmp_path), "replay never opened its output"
        time.sleep(0.3)   # it reads the 40 lines, then waits for more
        for sig in signals:
            p.send_signal(sig)
            time.sleep(0.01)
        _, err = p.communicate(timeout=120)
    assert (p.returncode, err.decode()) == (code, f"kvtrace: {said}\n")
    last = orjson.loads(out.read_bytes().splitlines()[-1])
    assert (last["kind"], last["status"]) == ("end", "interrupted")
    assert _leftovers(tmp_path) == []


def test_redaction_keys_are_bounded_and_named(tmp_path, capsys):
    dst = tmp_path / "r.jsonl"
    for key, want in ((["--key-hex", ""], "--key-hex gives 0 bytes; a redaction key must be 16 to "
                                          "4096 bytes"),
                      (["--key-file", "/dev/zero"], "/dev/zero: a redaction key must be 16 to 4096 "
                                                    "bytes; this file holds more than 4096")):
        code, _, err = _run(capsys, "redact", *key, CLEAN, dst)
        assert (code, err) == (2, f"kvtrace: {want}\n")
        assert not dst.exists()


@pytest.mark.parametrize("argv,what", [(["show", ""], "'TRACE'"),
                                       (["replay", CLEAN, "-o", ""], "'-o' / '--out'"),
                                       (["report", CLEAN, "--against", "", "-o", "r.html"],
                                        "'--against'")])
def test_an_empty_file_name_is_refused_as_such(capsys, argv, what):
    """pathlib makes '' the current folder: the error named '.'."""
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.startswith(f"kvtrace: Invalid value for {what}: an empty file name"), err


def test_a_terminal_that_is_not_utf8_gets_escapes_not_an_internal_error():
    p = _kvtrace(["show", CLEAN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 env=dict(os.environ, KVTRACE_QUIET="1", PYTHONIOENCODING="ascii"))
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert b"\\xb7 engine vllm" in p.stdout   # the report's middle dot


def test_a_sigterm_to_record_is_passed_on_to_the_recorded_command(tmp_path):
    """kvtrace record -- CMD stopped with SIGTERM, sent to kvtrace alone: the
    command gets it and shuts down its own way (a vLLM server ends its trace
    there), rather than running on without kvtrace or being killed."""
    import time

    script = ('trap "echo passed on > got; exit 0" TERM; echo > ready; '
              'while :; do sleep 0.05; done')
    p = subprocess.Popen(KVTRACE + ["record", "-o", str(tmp_path / "t.jsonl"), "--", "sh", "-c",
                                    script], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, KVTRACE_QUIET="1"))
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert p.returncode == 143
    assert (tmp_path / "got").read_text() == "passed on\n"


def test_an_error_quoting_a_huge_value_keeps_its_start_and_end(capsys):
    """An error line that quotes what it was given (here a request id of a
    million characters) is cut to 1000 characters, its start and its end kept."""
    code, _, err = _run(capsys, "show", CLEAN, "--request", "x" * 1_000_000)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and len(lines[0]) <= 1000 + len("kvtrace: "), err[:2000]
    assert lines[0].startswith(f"kvtrace: {CLEAN}") and "characters left out" in lines[0], lines[0]


def test_record_help_names_the_marks_it_prints(capsys):
    """The help said "the workload in brackets" and printed parentheses."""
    from kvtrace.catalog import EMBEDDED_FAULT_WORKLOADS, EMBEDDED_FAULTS

    code, out, _ = _run(capsys, "record", "--help")
    text = " ".join(out.split())
    fault = next(iter(EMBEDDED_FAULTS))
    assert code == 0 and f"({EMBEDDED_FAULT_WORKLOADS[fault]})" in text, text
    assert "the workload in parentheses" in text and "brackets" not in text, text


@pytest.mark.parametrize("fmt", ["perfetto", "parquet"])
def test_export_finds_an_output_it_cannot_write_before_it_replays(tmp_path, capsys, monkeypatch,
                                                                  fmt):
    """It replayed the whole trace first, and only then found the folder missing."""
    import kvtrace.replay

    def replayed(*a, **kw):
        raise AssertionError("replayed before the output was found unwritable")

    monkeypatch.setattr(kvtrace.replay, "replay_file", replayed)
    out = tmp_path / "missing" / ("e.json" if fmt == "perfetto" else "tables")
    code, _, err = _run(capsys, "export", "--format", fmt, CLEAN, "-o", out)
    assert (code, err) == (2, f"kvtrace: {out}: No such file or directory\n")
    assert _leftovers(tmp_path) == []


def test_report_finds_an_output_it_cannot_write_before_it_replays(tmp_path, capsys, monkeypatch):
    """It replayed (and diffed) the whole trace first, and only then found the folder missing."""
    import kvtrace.replay

    def replayed(*a, **kw):
        raise AssertionError("replayed before the output was found unwritable")

    monkeypatch.setattr(kvtrace.replay, "replay_file", replayed)
    out = tmp_path / "missing" / "r.html"
    code, _, err = _run(capsys, "report", CLEAN, "-o", out)
    assert (code, err) == (2, f"kvtrace: {out}: No such file or directory\n")
    assert _leftovers(tmp_path) == []


def test_two_commands_writing_one_output_at_once_leave_one_whole_file(tmp_path):
    """Each writes its own temporary file and renames it into place: the
    output is the one or the other, whole, never a mix, and nothing is left."""
    out = tmp_path / "e.json"
    want = set()
    for src in (CLEAN, DIVERGENT):
        alone = tmp_path / f"alone-{src.name}.json"
        assert _kvtrace(["export", "--no-divergences", src, "-o", alone]).returncode == 0
        want.add(alone.read_bytes())
    procs = [subprocess.Popen(KVTRACE + ["export", "--no-divergences", str(src), "-o", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for src in (CLEAN, DIVERGENT, CLEAN, DIVERGENT)]
    for p in procs:
        assert p.wait(300) == 0, p.stderr.read()
        p.stderr.close()
    assert out.read_bytes() in want
    assert _leftovers(tmp_path) == []


def test_a_recording_that_outgrows_the_file_size_limit_says_so_in_one_line(tmp_path):
    """The embedded engine's writer process meets the error (EFBIG past the
    process's file-size limit, which it inherits) and says it in the ring;
    record names the trace, exit 2, and the engine does not wait for a
    writer that has stopped writing. (A ring smaller than the limit: the
    ring is a file too.)"""
    import resource

    out = tmp_path / "t.jsonl"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))  # noqa: E731
    p = _kvtrace(["record", "-o", out, "--workload", "offload"], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, preexec_fn=limit,
                 env=dict(os.environ, KVTRACE_QUIET="1", KVTRACE_RING_BYTES="4096"))
    assert (p.returncode, p.stderr, p.stdout) == (2, f"kvtrace: {out}: File too large\n".encode(), b"")
