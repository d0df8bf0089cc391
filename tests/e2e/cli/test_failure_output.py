"""What a person reads first: replay's failure output for each seeded fault.

Each fault of the embedded engine is recorded, replayed, and the output at 80
columns is checked for what the investigator needs on the first screen (24
lines): the verdict, the first divergence (the likely cause, in causal order,
not the first row), the derivation of the expected value in numbers, and the
rule with its id. Expected values are derived here from the trace itself, not
taken from the code under test."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvtrace.engine import record_embedded
from kvtrace.findings import Divergence, by_request, causal_key, headline
from kvtrace.replay import replay_file

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]
FIRST_SCREEN = 24


def _record(tmp_path: Path, fault: str) -> Path:
    from kvtrace.engine.faults import FAULT_WORKLOADS

    out = tmp_path / f"{fault}.jsonl.gz"
    record_embedded(out, FAULT_WORKLOADS[fault], fault=fault, seed=0)
    return out


def _run(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([*KVTRACE, *args], capture_output=True, text=True, env=env)


def _records(path: Path) -> list[dict]:
    with gzip.open(path, "rb") as f:
        return [orjson.loads(line) for line in f]


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("faults")
    return {f: _record(tmp, f) for f in (
        "stale-cached-on-preempt", "negative-external-on-invalid-blocks",
        "stale-computed-after-failed-schedule", "no-reload-after-preempt",
        "async-load-overshoot")}


def test_every_line_fits_80_columns_and_none_ends_in_spaces(faults):
    for fault, path in faults.items():
        out = _run("replay", str(path)).stdout
        for line in out.splitlines():
            assert len(line) <= 80, (fault, line)
            assert line == line.rstrip(), (fault, line)


def test_wide_terminal_uses_the_width(faults):
    path = faults["stale-cached-on-preempt"]
    narrow = _run("replay", str(path), columns=80).stdout.splitlines()
    wide = _run("replay", str(path), columns=200).stdout.splitlines()
    assert len(wide) < len(narrow)
    assert max(map(len, wide)) > 80


def test_first_screen_names_the_cause_of_each_fault(faults):
    """The first 24 lines hold the verdict, the first divergence and its rule id."""
    needles = {
        # a negative counter, the rule that forbids it
        "negative-external-on-invalid-blocks": [r"recorded -16", r"num_external_computed_tokens >= 0"],
        # the two counters from lookups at different steps, the resume named
        "stale-cached-on-preempt": [r"from the lookup at step \d+", r"a resume after preemption"],
        # the stale count, derived: local + external hit
        "stale-computed-after-failed-schedule": [
            r"num_computed_tokens: recorded 104, expected 48",
            r"expected 48 = local prefix hit 48 \+ external hit 0"],
        # the load that was never made, and why it was due
        "no-reload-after-preempt": [r"kv_load", r"recorded: no load",
                                    r"admitted again after 1 preemption"],
        "async-load-overshoot": [r"recorded 40, expected 37",
                                 r"expected 37 = local prefix hit 32 \+ external hit 5"],
    }
    for fault, path in faults.items():
        res = _run("replay", str(path))
        assert res.returncode == 1, (fault, res.stderr)
        screen = "\n".join(res.stdout.splitlines()[:FIRST_SCREEN])
        assert screen.startswith("FAILED: "), (fault, screen)
        assert "first: step" in screen
        assert re.search(r"rule [A-Za-z0-9./-]+: ", screen) or "rule: " in screen, screen
        flat = " ".join(screen.split())   # wrapped lines read as one
        for n in needles[fault]:
            assert re.search(n, flat), (fault, n, screen)


def test_the_headline_is_the_cause_not_the_first_row(faults):
    """With stale-computed-after-failed-schedule, the first row in trace order is a
    consequence (long-3's chunk, cut by the budget long-2's stale count took);
    the headline is long-2's num_computed_tokens, the stale value."""
    divs = replay_file(faults["stale-computed-after-failed-schedule"], device=None).divergences
    first_row = divs[0]
    head = headline(by_request(divs))
    assert (head.req, head.field, head.step) == ("long-2", "num_computed_tokens", 37)
    assert (first_row.req, first_row.field) != (head.req, head.field)
    # Same step, and the cause's rank comes first.
    assert first_row.step == head.step and causal_key(head) < causal_key(first_row)


def test_derivation_adds_up_from_the_trace(faults):
    """'expected 37 = local prefix hit 32 + external hit 5 (the reference's
    lookup at step S)': with the connector, the numbers are those of the
    trace's own lookup record at step S."""
    path = faults["async-load-overshoot"]
    divs = replay_file(path, device=None).divergences
    d = next(d for d in divs if d.field == "num_computed_tokens" and d.why)
    m = re.fullmatch(r"(\d+) = local prefix hit (\d+) \+ external hit (\d+) "
                     r"\(the reference's lookup at step (\d+)\)", d.why)
    assert m, d.why
    total, local, ext, step = map(int, m.groups())
    assert total == d.expected == local + ext
    lookups = [lk for r in _records(path) if r["kind"] == "step" and r["step"] == step
               for lk in r.get("lookups") or () if lk["req"] == d.req]
    assert lookups and (lookups[-1]["local"], lookups[-1]["ext"]) == (local, ext)


def test_every_derivation_states_the_expected_value(faults):
    for path in faults.values():
        for d in replay_file(path, device=None).divergences:
            if d.why and "=" in d.why.split(":")[0]:
                lhs = d.why.split(" = ")[0]
                shown = (f"({', '.join(f'{x:,}' for x in d.expected)})"
                         if isinstance(d.expected, tuple) else f"{d.expected:,}")
                assert lhs == shown, (d, d.why)
                # the terms on the right add up to it
                terms = re.findall(r"([+-]) [a-z -]*?(\d+)(?= |$|\))", " + " + d.why.split(" = ", 1)[1])
                if terms and "budget" not in d.why and "remains" not in d.why:
                    total = sum(int(n) if s == "+" else -int(n) for s, n in terms)
                    assert total == d.expected, (d.why, terms)


def test_filters_select_and_exit_code_counts_everything(faults):
    path = str(faults["stale-computed-after-failed-schedule"])
    res = _run("replay", path, "--request", "long-5")
    assert res.returncode == 1
    heads = [l for l in res.stdout.splitlines() if " · step " in l and "─" in l]
    assert heads and all(l.startswith("long-5 ") for l in heads), heads
    # The first divergence named stays the trace's own, whatever is shown.
    assert res.stdout.splitlines()[1].startswith("first: step 37 (line 95), long-2,")
    res = _run("replay", path, "--first")
    assert len([l for l in res.stdout.splitlines() if " · step " in l and "─" in l]) == 1
    res = _run("replay", path, "--max", "3")
    assert len([l for l in res.stdout.splitlines() if " · step " in l and "─" in l]) == 3
    flat = " ".join(res.stdout.split())
    assert "more requests and the step-wide counts also diverge" in flat, res.stdout
    res = _run("replay", path, "--field", "num_free_blocks", "--json")
    doc = orjson.loads(res.stdout)
    assert doc["divergences"] and {d["field"] for d in doc["divergences"]} == {"num_free_blocks"}
    assert res.returncode == 1
    # A filter that matches nothing still fails a trace that diverges.
    res = _run("replay", path, "--request", "no-such-request")
    assert res.returncode == 1 and "0 of the" in res.stdout


def test_json_is_unchanged_by_the_view(faults):
    """--json lists every divergence with the same keys as before: no derivation."""
    path = faults["async-load-overshoot"]
    doc = orjson.loads(_run("replay", str(path), "--json").stdout)
    assert len(doc["divergences"]) == len(replay_file(path).divergences)
    assert set(doc["divergences"][0]) == {"step", "req", "field", "recorded", "expected",
                                          "rule", "kind", "seq", "line"}


def test_kv_content_names_the_clobbering_write_in_full(faults):
    out = _run("replay", str(faults["no-reload-after-preempt"]), "--field", "kv-content").stdout
    assert re.search(r"written by \S+ at step \d+ \(its\s+position \d+\); \d+ of \d+\s+positions"
                     r"\s+read are wrong", out), out


def test_stories_order_causes_before_effects():
    d = [Divergence(7, "b", "num_scheduled_tokens", 3, 2, "2.1/2.2: x", seq=7),
         Divergence(7, "a", "num_computed_tokens", 9, 5, "1.3: y", seq=7),
         Divergence(8, "a", "state.block_ids", [1], [2], "4.5/4.7: z", "block", seq=8),
         Divergence(9, "a", "state.block_ids", [1], [3], "4.5/4.7: z", "block", seq=9)]
    findings = by_request(d)
    assert [s.req for s in findings] == ["a", "b"]
    assert findings[1].after is findings[0].cause          # b's chunk follows from a's count
    assert findings[0].folds[0].count == 2 and findings[0].folds[0].last_step == 9


def test_an_output_read_after_the_next_step_is_ordered_at_that_step():
    """Under async scheduling the output of step 8 comes after step 9's record
    and shows the tables step 9 left: step 9's decision is the cause."""
    d = [Divergence(9, "a", "block_ids", [8], [31], "4.9: x", "block", seq=27),
         Divergence(8, "a", "state.more_groups", [[7]], [[32]], "4.9: x", "block", seq=28),
         Divergence(9, "b", "state.block_ids", [1], [2], "4.5/4.7: z", "block", seq=27)]
    findings = by_request(d)
    assert headline(findings) is d[0] and findings[0].cause is d[0]
    assert findings[0].folds[0].first is d[1]
    # In a synchronous trace, step order and file order agree: nothing moves.
    d[1].seq = 26
    assert headline(by_request(d)) is d[1]


def test_diff_speaks_of_a_and_b_with_lines_in_both(tmp_path, faults):
    from kvtrace.engine.faults import FAULT_WORKLOADS

    clean = tmp_path / "clean.jsonl.gz"
    record_embedded(clean, FAULT_WORKLOADS["async-load-overshoot"], seed=0)
    res = _run("diff", str(faults["async-load-overshoot"]), str(clean))
    assert res.returncode == 1
    assert "recorded" not in res.stdout and "expected" not in res.stdout
    m = re.search(r"step (\d+), A line (\d+), B line (\d+)", res.stdout)
    assert m, res.stdout
    step, la, lb = map(int, m.groups())
    for path, line in ((faults["async-load-overshoot"], la), (clean, lb)):
        rec = _records(path)[line - 1]
        assert rec["kind"] == "step" and rec["step"] == step
    assert "knock-on effects" in res.stdout
    doc = orjson.loads(_run("diff", "--json", str(faults["async-load-overshoot"]), str(clean)).stdout)
    assert doc["divergences"][0]["line_b"] == lb


def test_a_planted_fault_that_shows_nothing_is_said(tmp_path):
    """A trace recorded with --fault whose replay is clean says so: the fault
    never fired, or replay missed it. Without the fault, no such note."""
    planted, clean = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    record_embedded(planted, "shared-prefix", fault="async-load-overshoot", seed=0)
    record_embedded(clean, "shared-prefix", seed=0)
    res = _run("replay", str(planted))
    assert res.returncode == 0 and "fault async-load-overshoot planted" in " ".join(res.stdout.split())
    res = _run("replay", str(clean))
    assert res.returncode == 0 and "recorded with the fault" not in " ".join(res.stdout.split())


def test_several_traces_keep_their_own_stories(tmp_path, faults):
    """Two ranks' traces with one file name: each keeps its own blocks, named
    by path, and no block links into the other trace."""
    import shutil

    for rank in ("r0", "r1"):
        (tmp_path / rank).mkdir()
        shutil.copy(faults["async-load-overshoot"], tmp_path / rank / "t.jsonl.gz")
    res = _run("replay", str(tmp_path / "r0" / "t.jsonl.gz"), str(tmp_path / "r1" / "t.jsonl.gz"),
               "--max", "50", columns=200)
    assert res.returncode == 1
    heads = [l for l in res.stdout.splitlines() if " · step " in l and "─" in l]
    single = _run("replay", str(faults["async-load-overshoot"]), "--max", "50", columns=200)
    n = len([l for l in single.stdout.splitlines() if " · step " in l and "─" in l])
    assert len(heads) == 2 * n
    assert sum(str(tmp_path / "r0") in h for h in heads) == n
    assert "follows from" not in res.stdout or all(
        "r1" not in l for l in res.stdout.splitlines() if "follows from" in l)


def test_scheduler_vllm_refuses_the_view_options(faults):
    res = _run("replay", "--scheduler", "vllm", "--first", str(faults["async-load-overshoot"]))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--scheduler vllm" in res.stderr


def test_a_stale_recorded_count_is_traced_to_the_lookup_that_found_it(faults):
    """stale-computed-after-failed-schedule keeps the hit of a lookup whose
    admission did not happen: the recorded 104 is named as what an earlier
    lookup found. The step named is one where the trace does not schedule
    long-2 (the admission did not happen)."""
    path = faults["stale-computed-after-failed-schedule"]
    d = next(d for d in replay_file(path, device=None).divergences
             if (d.req, d.field) == ("long-2", "num_computed_tokens"))
    m = re.search(r"the recorded 104 is the hit the reference's lookup at step (\d+) found", d.why)
    assert m, d.why
    step = int(m.group(1))
    assert step < d.step
    rec = next(r for r in _records(path) if r["kind"] == "step" and r["step"] == step)
    scheduled = {x["req"] for part in ("new", "resumed", "running") for x in rec.get(part) or ()}
    assert "long-2" not in scheduled


def test_a_negative_legacy_count_names_the_failed_load(faults):
    path = faults["negative-external-on-invalid-blocks"]
    divs = replay_file(path, device=None).divergences
    assert divs and all("a KV load of this request failed before" in (d.why or "") for d in divs)
    # and the expected count (alone, or in the expected pair) is the external hit
    # of a lookup in the trace
    recs = _records(path)
    for d in divs:
        step = int(re.search(r"lookup at step (\d+)", d.why).group(1))
        hits = [lk["ext"] for r in recs if r["kind"] == "step" and r["step"] == step
                for lk in r.get("lookups") or () if lk["req"] == d.req]
        expected = d.expected[1] if isinstance(d.expected, tuple) else d.expected
        assert expected in hits, (d, hits)


def test_the_pattern_line_counts_likely_causes_and_followers(faults):
    """Third line: the likely causes by field and rule, and how many requests may
    follow from them; the two counts add up to the requests that diverge."""
    for fault, path in faults.items():
        out = _run("replay", str(path), columns=200).stdout.splitlines()
        findings = by_request(replay_file(path, device=None).divergences)
        reqs = [s for s in findings if s.req is not None]
        if len(reqs) < 2:
            continue
        line = out[2]
        assert line.startswith("likely cause"), (fault, out[:4])
        roots = sum(int(n) for n in re.findall(r" in (\d+)", line))
        follow = re.search(r"; (\d+) more requests? may follow", line)
        assert roots + (int(follow.group(1)) if follow else 0) == len(reqs), (fault, line)
    line = _run("replay", str(faults["no-reload-after-preempt"]), columns=200).stdout.splitlines()[2]
    assert line.startswith("likely causes: kv_load (rule I9) in "), line
