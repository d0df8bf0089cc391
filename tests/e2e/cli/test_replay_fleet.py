"""``kvtrace replay`` of many traces and segment directories: a directory is
one item of the report among traces; ``--ray`` gives, byte for byte, the
report and the exit code of replay on this machine, a bad file named among
them, and splits one trace with keyframes into tasks; ``--parquet`` holds every trace's divergences as ``kvtrace export``
writes them, with the trace's path."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvtrace import cli
from kvtrace.flight.replay import replay_folder

from tests._paths import REPO
from tests._ray import local_cluster

TRACES = REPO / "traces"
STORED = sorted(TRACES.rglob("*.jsonl.gz"))
DIVERGENT = [TRACES / "faults" / "async-load-overshoot.jsonl.gz",
             TRACES / "vllm-bugs" / "spec-session-overshoot.jsonl.gz",
             TRACES / "data-path" / "negative-external-hit.jsonl.gz"]
CLEAN = TRACES / "pooling.jsonl.gz"
FLEET = 200


# Ray may run in this process (its threads), from a test before: the local
# replays here run in it (-j 1) or in a process of their own, and never fork it.


def run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def rings(tmp_path_factory) -> list[Path]:
    """Two segment directories of ``kvtrace record --ring``: a clean run, and
    one with a fault, which pinned its first segments; segments between them
    rotated out."""
    made = []
    for name, extra in (("clean", []), ("fault", ["--fault", "stale-cached-on-preempt"])):
        d = tmp_path_factory.mktemp("rings") / name
        code = cli.run(["record", "-o", str(d), "--workload", "offload", "--requests", "40",
                        "--seed", "3", "--ring", "192KB", "--segment", "64KB", *extra])
        assert code == 0 and len(list(d.glob("segment-*.jsonl.gz"))) > 2
        made.append(d)
    return made


@pytest.fixture(scope="module")
def fleet(rings, tmp_path_factory) -> list[str]:
    """200 items: the stored traces linked under names of their own, again
    and again, and the two directories, each twice."""
    folder = tmp_path_factory.mktemp("fleet")
    items = []
    for i, ring in enumerate(rings * 2):
        link = folder / f"ring-{i}"
        link.symlink_to(ring, target_is_directory=True)
        items.append(str(link))
    i = 0
    while len(items) < FLEET:
        trace = STORED[i % len(STORED)]
        link = folder / f"{i:03d}-{trace.name}"
        link.symlink_to(trace)
        items.append(str(link))
        i += 1
    return items


@pytest.fixture(scope="module")
def cluster():
    yield from local_cluster()


def _bad_set(rings, tmp_path) -> list[str]:
    """A few good traces, a file that is no trace, a folder with no segment, a ring."""
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b"not a trace\n"))
    empty = tmp_path / "empty"
    empty.mkdir()
    return [str(p) for p in (*DIVERGENT, bad, CLEAN, empty, rings[1])]


# --------------------------------------------------------------------------- on this machine


def test_a_directory_among_traces_is_one_item_of_the_report(rings, capsys):
    code, alone, _ = run(capsys, "replay", "--json", rings[1])
    assert code == 1
    code, out, err = run(capsys, "replay", "--json", "-j", "1", CLEAN, rings[1], DIVERGENT[0])
    assert code == 1, err
    docs = orjson.loads(out)["traces"]
    assert [d["trace"] for d in docs] == [str(CLEAN), str(rings[1]), str(DIVERGENT[0])]
    assert docs[1] == orjson.loads(alone)   # what replay of the directory alone says
    assert docs[1]["divergences"] and docs[1]["gaps"]
    code, out, _ = run(capsys, "replay", "-j", "1", CLEAN, rings[1])
    assert code == 1 and f"{rings[1]} · engine kvtrace-embedded" in out


def test_the_parquet_table_holds_each_traces_export_divergences(rings, tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    items = _bad_set(rings, tmp_path)
    table = tmp_path / "fleet.parquet"
    code, out, err = run(capsys, "replay", "--json", "-j", "1", "--parquet", table, *items)
    assert code == 2, err   # the bad file; the table is written all the same
    rows = pq.read_table(table).to_pylist()
    assert [k for k in rows[0]][:2] == ["trace", "step"]
    for trace in DIVERGENT:
        tables = tmp_path / f"export-{trace.name}"
        assert run(capsys, "export", trace, "--format", "parquet", "-o", tables)[0] == 0
        exported = pq.read_table(tables / "divergences.parquet").to_pylist()
        assert exported
        assert [{k: v for k, v in r.items() if k != "trace"} for r in rows
                if r["trace"] == str(trace)] == exported
    # the directory's: every divergence its replay finds, in that order
    found = replay_folder(rings[1]).divergences
    assert found and [(r["step"], r["req"], r["field"], r["line"]) for r in rows
                      if r["trace"] == str(rings[1])] == [(d.step, d.req, d.field, d.line)
                                                          for d in found]
    assert {r["trace"] for r in rows} == {*map(str, DIVERGENT), str(rings[1])}
    checked = orjson.loads(pq.read_schema(table).metadata[b"kvtrace.traces"])
    assert [c["trace"] for c in checked] == items
    by = {c["trace"]: c for c in checked}
    assert by[str(tmp_path / "bad.jsonl.gz")]["error"].startswith(f"{tmp_path / 'bad.jsonl.gz'}:1: ")
    assert by[str(CLEAN)] == {"trace": str(CLEAN), "steps_checked": 7, "steps_in_trace": 7,
                              "stopped_at": None, "error": None}


def test_without_ray_the_option_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)   # import ray fails
    code, out, err = run(capsys, "replay", CLEAN, DIVERGENT[0], "--ray")
    assert code == 2 and out == ""
    assert err == "kvtrace: --ray needs Ray, which is not installed: pip install 'kvtrace[ray]'\n"


@pytest.mark.parametrize("argv, needle", [
    (["--ray", str(CLEAN), str(DIVERGENT[0])], "is no Ray address (auto, HOST:PORT, "
                                               "ray://HOST:PORT): name the traces before --ray"),
    ([str(CLEAN), "--ray", "-j", "2"], "-j sets the processes of this machine"),
    ([str(CLEAN), "--ray=auto", "-o", "x.jsonl"], "--ray replays through the reference, without -o"),
    ([str(CLEAN), "--parquet", "t.parquet", "--from-step", "3"],
     "--parquet replays through the reference, without -o, --from-step"),
    ([str(CLEAN), "--parquet", str(CLEAN)], "this is the file being read"),
])
def test_what_ray_and_parquet_do_not_go_with_is_one_line(argv, needle, capsys):
    code, out, err = run(capsys, "replay", *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and needle in err, err


def test_kvtrace_replays_many_without_importing_ray():
    code = ("import sys; from kvtrace import cli; "
            f"code = cli.run(['replay', '--json', {str(CLEAN)!r}, {str(DIVERGENT[0])!r}]); "
            "sys.exit(10 + code if 'ray' in sys.modules else code)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert p.returncode == 1, p.stderr


# --------------------------------------------------------------------------- on Ray


def _env() -> dict:
    return {**os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}




@pytest.mark.ray
def test_ray_gives_the_json_and_exit_code_of_local_replay(fleet, cluster, capsys):
    local = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--json", "-j", "2",
                            *fleet], env=_env(), capture_output=True, timeout=300)
    on_ray = run(capsys, "replay", "--json", *fleet, "--ray")
    assert on_ray[0] == local.returncode == 1
    assert on_ray[1] == local.stdout.decode()
    docs = orjson.loads(on_ray[1])["traces"]
    assert len(docs) == FLEET and all("error" not in d for d in docs)
    assert sum(bool(d["divergences"]) for d in docs) > 20


@pytest.mark.ray
def test_on_ray_a_bad_file_is_named_and_the_others_still_count(rings, cluster, tmp_path,
                                                               capsys, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setenv("COLUMNS", "80")
    items = _bad_set(rings, tmp_path)
    for as_json in ([], ["--json"]):
        here = tmp_path / f"here{len(as_json)}.parquet"
        there = tmp_path / f"there{len(as_json)}.parquet"
        local = run(capsys, "replay", *as_json, "-j", "1", "--parquet", here, *items)
        on_ray = run(capsys, "replay", *as_json, "--parquet", there, "--ray", "local", *items)
        assert on_ray == local
        assert pq.read_table(there).equals(pq.read_table(here))
        assert pq.read_schema(there).metadata == pq.read_schema(here).metadata
    code, out, err = on_ray
    assert code == 2
    docs = orjson.loads(out)["traces"]
    assert [d["trace"] for d in docs] == items
    assert [bool(d.get("error")) for d in docs] == [False] * 3 + [True, False, True, False]
    assert err.splitlines() == [f"kvtrace: {d['error']}" for d in docs if d.get("error")]
    assert err.splitlines()[0].startswith(f"kvtrace: {items[3]}:1: ")


@pytest.mark.ray
def test_ray_at_an_address_from_a_process_of_its_own(cluster, tmp_path, capsys):
    names = []
    for trace in (CLEAN, *DIVERGENT):
        (tmp_path / trace.name).symlink_to(trace)
        names.append(trace.name)   # relative: read from the command's folder
    os.chdir(tmp_path)
    try:
        local = run(capsys, "replay", "--json", "-j", "1", *names)
    finally:
        os.chdir(REPO)
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--json", *names,
                        "--ray", cluster], cwd=tmp_path, env=_env(), capture_output=True,
                       timeout=300)
    assert (p.returncode, p.stdout.decode()) == local[:2], p.stderr
    assert p.stderr == b""


@pytest.mark.ray
def test_one_trace_on_ray_is_split_at_its_keyframes_with_the_report_of_a_serial_replay(
        cluster, tmp_path, capsys, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    from kvtrace.fleet import on_ray

    trace = tmp_path / "long.jsonl.gz"
    assert run(capsys, "record", "-o", trace, "--workload", "offload", "--requests", "200",
               "--fault", "stale-cached-on-preempt", "--keyframe-every", "300")[0] == 0
    split = []

    def counted(ray, s, progress, retries):
        split.append(len(s.pieces))
        return split_on(ray, s, progress, retries)

    split_on = on_ray._split_on
    monkeypatch.setattr(on_ray, "_split_on", counted)
    serial = run(capsys, "replay", "--json", "--parquet", tmp_path / "here.parquet", trace)
    assert split == []   # here: one process, the whole trace
    pieces = run(capsys, "replay", "--json", "--parquet", tmp_path / "there.parquet", trace,
                 "--ray")
    assert split and split[0] > 1, split
    assert pieces == serial and serial[0] == 1
    assert orjson.loads(serial[1])["traces"][0]["divergences"]
    assert pq.read_table(tmp_path / "there.parquet").equals(
        pq.read_table(tmp_path / "here.parquet"))
