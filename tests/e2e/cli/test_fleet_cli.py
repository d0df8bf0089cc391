"""``kvtrace replay`` of rank 0's trace of a data-parallel run, and ``kvtrace
diff --match handoff`` of a fleet's traces, as a user runs them: what each
prints, and its exit code. The runs and fleets are the hand-made ones of
tests/unit/trace/test_ranks.py and tests/unit/diff/test_handoffs.py."""

from __future__ import annotations

import orjson

from kvtrace import cli

from tests.mini_traces import load_records, save_records
from tests.unit.diff.test_handoff import DECODE, PREFILL, TRACES
from tests.unit.diff.test_handoffs import split
from tests.unit.trace.test_ranks import as_rank, make_run, rank_name


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_rank_0s_trace_replays_every_rank_as_one_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    run = make_run(tmp_path, 2)
    code, out, err = _run(capsys, "replay", run)
    assert code == 0 and err == "", err
    text = " ".join(out.split())
    assert "data-parallel run of 2 ranks, in lockstep" in text
    assert "rank 0: run.jsonl · " in text and f"rank 1: {rank_name(run, 1).name} · " in text
    assert "across ranks: no divergence; checked: the ranks' headers (DP1)" in text
    assert "2 ranks replayed, 0 with divergences" in text
    code, out, _ = _run(capsys, "replay", "--json", run)
    doc = orjson.loads(out)
    assert code == 0 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["run"]["size"] == 2 and doc["run"]["missing"] == []
    assert all(r["divergences"] == [] for r in doc["ranks"])


def test_a_missing_rank_is_said_and_fails_the_run(tmp_path, capsys):
    run = make_run(tmp_path, 3)
    rank_name(run, 1).unlink()
    code, out, _ = _run(capsys, "replay", run)
    assert code == 1
    assert "rank 1: missing: no trace of it beside run.jsonl" in " ".join(out.split())
    code, out, _ = _run(capsys, "replay", "--json", run)
    assert code == 1 and orjson.loads(out)["run"]["missing"] == [1]


def test_a_disagreement_across_ranks_fails_the_run_and_names_its_rank(tmp_path, capsys):
    """A step of rank 1 that held prefills back where the shared counter let
    them in: its replay, fed the flag, follows it; the cadence names it."""
    at = {}

    def held(recs):
        s = next(r for r in recs if r.get("kind") == "step" and not r["throttle_prefills"]
                 and r["step"] > 5)
        s["throttle_prefills"] = True
        at["step"] = s["step"]

    run = make_run(tmp_path, 2)
    as_rank(rank_name(run, 1), 1, change=held)
    code, out, _ = _run(capsys, "replay", "--json", run)
    doc = orjson.loads(out)
    (d,) = doc["across_ranks"]["divergences"]
    assert code == 1 and doc["ranks"][0]["divergences"] == []
    assert (d["rank"], d["step"], d["field"], d["rule"][:4]) == (1, at["step"],
                                                                 "throttle_prefills", "DP3:")
    assert d["why"].endswith("where the shared counter was a multiple of 3, it is one")


def test_an_unusable_rank_is_one_line_and_exit_2(tmp_path, capsys):
    run = make_run(tmp_path, 2)
    rank_name(run, 1).write_text('{"kind": "header"}\n')
    code, out, err = _run(capsys, "replay", run)
    assert code == 2 and "rank 1: " in out and "unusable" in out
    assert len(err.splitlines()) == 1 and str(rank_name(run, 1)) in err


def test_one_rank_alone_where_a_replay_writes_or_starts_late(tmp_path, capsys):
    """-o and --from-step work on one trace: rank 0's, as named."""
    run = make_run(tmp_path, 2)
    code, out, _ = _run(capsys, "replay", "--json", "-o", tmp_path / "out.jsonl", run)
    doc = orjson.loads(out)
    assert code == 0 and "run" not in doc and doc["trace"] == str(run)


def test_a_fleets_handoffs_are_diffed_from_directories(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    (tmp_path / "p").mkdir(), (tmp_path / "d").mkdir()
    split(PREFILL, tmp_path / "p", 3, "prefill")
    decodes = split(DECODE, tmp_path / "d", 2, "decode")
    code, out, err = _run(capsys, "diff", tmp_path / "p", tmp_path / "d")
    text = " ".join(out.split())
    assert code == 0 and err == "" and "8 handoffs compared across 5 traces, 0 diverge" in text
    recs = load_records(decodes[0])
    arrival = next(r for r in recs if r.get("kind") == "arrival")
    arrival["prompt_token_ids"][3] += 1
    save_records(recs, decodes[0])
    code, out, _ = _run(capsys, "diff", "--json", "--match", "handoff", tmp_path / "p",
                        tmp_path / "d")
    doc = orjson.loads(out)
    (d,) = doc["divergences"]
    assert code == 1 and d["decode_trace"] == str(decodes[0]) and d["req"] == arrival["req"]
    assert d["prefill_trace"].startswith(str(tmp_path / "p")) and d["field"] == "prompt_token_ids"
    assert doc["summary"]["handoffs_compared"] == 8


def test_a_fleet_diff_refuses_what_it_cannot_pair(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, said in [(["--match", "id", PREFILL, DECODE, PREFILL], "paired by handoff"),
                       ([empty, DECODE], "holds no trace"),
                       ([PREFILL, DECODE, TRACES / "preemption.jsonl.gz"], "no KV connector")]:
        code, out, err = _run(capsys, "diff", *argv)
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and said in err, err


def test_one_directory_holds_a_whole_fleet_and_one_file_is_no_diff(tmp_path, capsys):
    split(PREFILL, tmp_path, 2, "prefill")
    split(DECODE, tmp_path, 2, "decode")
    code, out, _ = _run(capsys, "diff", "--json", tmp_path)
    assert code == 0 and orjson.loads(out)["summary"]["handoffs_compared"] == 8
    code, out, err = _run(capsys, "diff", PREFILL)
    assert code == 2 and out == "" and "Missing argument 'B'" in err and len(err.splitlines()) == 1
