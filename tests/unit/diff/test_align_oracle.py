"""The aligner gives the same result as the aligner it replaced (oracle_align.py,
kept unchanged), on pairs of stored traces that agree and that differ: each
trace with itself, recordings of one workload by different releases, each
trace with the next one stored (other workloads, other configs: most requests
differ), each trace cut off against the whole, under each match mode, and
recordings of faults and of vLLM's bugs against their replay. Same result:
the same DiffResult, the same ``--json`` document and the same text report."""

from __future__ import annotations

import gzip
import io
from collections import defaultdict

import pytest
from rich.console import Console

from kvtrace.diff import diff_files
from kvtrace.report import terminal
from kvtrace.trace.io import TraceError, TraceReader

from tests._paths import REPO
from tests.unit.diff import oracle_align

TRACES = REPO / "traces"
STORED = sorted(TRACES.rglob("*.jsonl.gz"))


def _text(result) -> str:
    out = io.StringIO()
    terminal.print_diff(result, console=Console(file=out, width=100, color_system=None))
    return out.getvalue()


def _result(diff, a, b, **kw):
    try:
        return diff(a, b, **kw)
    except TraceError as e:
        return f"TraceError: {e}"


def _same(a, b, **kw) -> None:
    new, old = _result(diff_files, a, b, **kw), _result(oracle_align.diff_files, a, b, **kw)
    if isinstance(old, str):
        assert new == old
        return
    assert new.to_json() == old.to_json()
    assert new == old
    assert _text(new) == _text(old)


def _is_handoff(a, b) -> bool:
    from kvtrace.diff.handoff import is_handoff_pair

    with TraceReader(a) as ra, TraceReader(b) as rb:
        return is_handoff_pair(ra.header, rb.header)


def _pairs() -> list[tuple]:
    """Each trace with itself, with the others of its name (another release's
    recording of the workload, a fault put in) and with the next trace stored."""
    by_name = defaultdict(list)
    for p in STORED:
        by_name[p.name].append(p)
    pairs = [(p, p) for p in STORED]
    pairs += [(x, y) for same in by_name.values() for x in same for y in same if x != y]
    pairs += [(x, y) for x, y in zip(STORED, STORED[1:] + STORED[:1])]
    return pairs


@pytest.mark.parametrize("a,b", _pairs(), ids=lambda p: str(p.relative_to(TRACES)))
def test_stored_pairs(a, b):
    _same(a, b)


@pytest.mark.parametrize("match", ["id", "id-prefix", "arrival"])
def test_match_modes(match):
    for a, b in zip(STORED[::3], STORED[1::3]):
        if not _is_handoff(a, b):
            _same(a, b, match=match)


def _cut(src, dst, fraction: float, mid_line: bool):
    data = gzip.decompress(src.read_bytes())
    at = max(int(len(data) * fraction), data.index(b"\n") + 1)   # past the header
    if not mid_line:
        at = data.rfind(b"\n", 0, at) + 1
    dst.write_bytes(data[:at])
    return dst


@pytest.mark.parametrize("path", STORED[::2], ids=lambda p: str(p.relative_to(TRACES)))
def test_cut_traces(path, tmp_path):
    """A cut trace is diffed up to its cut: against the whole trace, the whole
    against it, against another cut of itself, and against the next trace."""
    other = STORED[(STORED.index(path) + 1) % len(STORED)]
    for fraction in (0.2, 0.6, 0.9):
        cut = _cut(path, tmp_path / f"cut-{fraction}.jsonl", fraction, mid_line=fraction == 0.6)
        early = _cut(path, tmp_path / f"early-{fraction}.jsonl", fraction / 2, mid_line=False)
        for a, b in ((cut, path), (path, cut), (cut, early), (early, cut), (cut, other), (other, cut)):
            _same(a, b)


@pytest.mark.parametrize("path", sorted(TRACES.glob("faults/*.jsonl.gz"))
                         + sorted(TRACES.glob("vllm-bugs/*.jsonl.gz"))
                         + sorted(TRACES.glob("vllm-0.33/*.jsonl.gz")), ids=lambda p: p.name)
def test_a_recording_and_its_replay(path, tmp_path):
    from kvtrace.replay import replay_file

    out = tmp_path / "replayed.jsonl"
    replay_file(path, out=out, device=None, worker=0)
    _same(path, out)
    _same(out, path)


def _broken(path, tmp_path, name: str, edit) -> object:
    """``path`` as plain text with ``edit`` applied to its records (dicts)."""
    import orjson

    objs = [orjson.loads(x) for x in gzip.decompress(path.read_bytes()).splitlines() if x.strip()]
    edit(objs)
    out = tmp_path / name
    out.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    return out


def _late_step_repeated(objs):
    """A step record near the end numbered as the one before it."""
    steps = [i for i, o in enumerate(objs) if o.get("kind") == "step"]
    objs[steps[-2]]["step"] = objs[steps[-3]]["step"]


def _early_block_out_of_range(objs):
    step = next(o for o in objs if o.get("kind") == "step" and (o.get("new") or o.get("running")))
    part = (step.get("new") or step.get("running"))[0]
    part["block_ids" if "block_ids" in part else "new_block_ids"] = [10 ** 9]


def _unknown_request_scheduled(objs):
    step = [o for o in objs if o.get("kind") == "step" and o.get("running")][-3]
    step["running"][0]["req"] = "never-arrived"


@pytest.mark.parametrize("name", ["preemption.jsonl.gz", "async-preemption.jsonl.gz",
                                  "faults/stale-computed-on-preempt.jsonl.gz"])
def test_broken_inputs(name, tmp_path):
    """A broken input stops the diff with the same error as before, whichever
    input is broken, and which one is named when both are."""
    path = TRACES / name
    broken = [_broken(path, tmp_path, f"{edit.__name__}.jsonl", edit)
              for edit in (_late_step_repeated, _early_block_out_of_range, _unknown_request_scheduled)]
    for bad in broken:
        for a, b in ((bad, path), (path, bad)):
            _same(a, b)
            assert isinstance(_result(diff_files, a, b), str)
    for x in broken:
        for y in broken:
            _same(x, y)


@pytest.mark.parametrize("a,b", [(TRACES / "preemption.jsonl.gz", TRACES / "vllm-0.18" / "preemption.jsonl.gz"),
                                 (TRACES / "connector.jsonl.gz", TRACES / "vllm-0.18" / "connector.jsonl.gz"),
                                 (TRACES / "speculative.jsonl.gz", TRACES / "vllm-0.33" / "speculative.jsonl.gz")],
                         ids=["preemption", "connector", "speculative"])
def test_with_a_worker_per_input(a, b):
    """Each input's records checked in a worker process of its own."""
    _same(a, b, worker=True)
    _same(b, a, worker=True)
