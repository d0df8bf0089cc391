"""Random mutations of the real traces in traces/, through every command that
reads a trace. The reader (``TraceReader`` with its checks) is the one judge of
what is unusable: where it refuses a mutant, every command refuses it with its
words, at its line (exit 2, one line on stderr); where it reads the mutant to
the end, every command reads on and answers 0 or 1. Never a traceback, and
never one command refusing what another reads.

Each mutant changes the records after the header (the header has tests of its
own, and replay alone refuses some headers, docs/reference/bad-input.md): one value
anywhere in one record set to an edge value or to a value from elsewhere in the
trace, a key dropped or added, a record dropped, repeated or swapped with the
next, or the file cut at a byte. CI runs ``MUTANTS`` per trace, the same ones
every time; ``KVTRACE_MUTANTS=N`` runs N, and ``KVTRACE_MUTANTS_SEED=S`` others.
With the reader of the commit before 580d725, which let an output whose step
record was dropped through to every command but replay, the 24 mutants of two
async traces fail here (the 12 of one).
"""

from __future__ import annotations

import gzip
import os
import random
from pathlib import Path

import orjson
import pytest

from kvtrace import cli
from kvtrace.trace import TraceError, TraceReader

from tests._paths import REPO

TRACES = REPO / "traces"
REAL = sorted(TRACES.glob("*.jsonl.gz")) + sorted(TRACES.glob("faults/*.jsonl.gz")) + sorted(
    TRACES.glob("vllm-bugs/*.jsonl.gz")) + sorted(TRACES.glob("data-path/*.jsonl.gz"))
MUTANTS = int(os.environ.get("KVTRACE_MUTANTS", "24"))
SEED = int(os.environ.get("KVTRACE_MUTANTS_SEED", "0"))

EDGES = (None, True, False, -1, 0, 1, 2 ** 40, 2 ** 40 + 1, 2 ** 63, 1.5, "", "x", "RUNNING",
         [], {}, [None], [-1], ["x"], [1.5], [2 ** 41], {"x": 1}, [[1]])


def _paths(node, path=()):
    """Every place in a JSON value: (path, value)."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _mutant(rng: random.Random, lines: list[bytes]) -> tuple[bytes, str]:
    """A mutant of a trace's lines (the header first), and what was done."""
    objs = [orjson.loads(x) for x in lines]
    i = rng.randrange(1, len(objs))
    op = rng.choice(("edge", "edge", "edge", "elsewhere", "drop-key", "add-key",
                     "drop-record", "repeat-record", "swap-records", "cut"))
    what = f"line {i + 1}: {op}"
    if op in ("edge", "elsewhere", "drop-key", "add-key"):
        places = [(p, v) for p, v in _paths(objs[i]) if p]
        path, _ = rng.choice(places)
        parent, key = _at(objs[i], path[:-1]), path[-1]
        if op == "edge":
            parent[key] = rng.choice(EDGES)
        elif op == "elsewhere":   # a value of the same trace: another id, step, block, count
            _, v = rng.choice([pv for o in objs[1:] for pv in _paths(o)
                               if not isinstance(pv[1], (dict, list))])
            parent[key] = v
        elif op == "drop-key":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        else:
            target = parent if isinstance(parent, dict) else objs[i]
            target["unknown_key"] = rng.choice(EDGES)
        what += f" at {'.'.join(map(str, path))}"
        out = [orjson.dumps(o) + b"\n" for o in objs]
    else:
        out = [orjson.dumps(o) + b"\n" for o in objs]
        if op == "drop-record":
            del out[i]
        elif op == "repeat-record":
            out.insert(i, out[i])
        elif op == "swap-records" and i + 1 < len(out):
            out[i], out[i + 1] = out[i + 1], out[i]
        elif op == "cut":
            data = b"".join(out)
            at = rng.randrange(len(out[0]) + 1, len(data))
            return data[:at], f"cut at byte {at}"
    return b"".join(out), what


def _verdict(path: Path) -> str | None:
    """The reader's error for the file, or None where it reads it to the end."""
    try:
        with TraceReader(path) as r:
            for _ in r:
                pass
    except TraceError as e:
        return str(e)
    return None


def _has_step(path: Path) -> bool:
    """Whether a file the reader reads to its end holds a step record."""
    with TraceReader(path) as r:
        return any(e.kind == "step" for e in r)


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.run([str(a) for a in argv])
    _, err = capsys.readouterr()
    return code, err


@pytest.mark.parametrize("trace", REAL, ids=lambda p: p.name)
def test_every_command_refuses_a_mutant_where_the_reader_does(trace, tmp_path, capsys):
    lines = gzip.decompress(trace.read_bytes()).splitlines(keepends=True)
    rng = random.Random(f"{trace.name}:{SEED}")
    refused = 0
    for n in range(MUTANTS):
        data, what = _mutant(rng, lines)
        m = tmp_path / f"m{n}.jsonl"
        m.write_bytes(data)
        verdict = _verdict(m)
        refused += verdict is not None
        # Replay of a file with no step checked nothing: exit 4, unless it diverges;
        # so may a diff with it, which can then have compared no request.
        passed = (0, 1) if verdict is not None or _has_step(m) else (1, 4)
        compared = (0, 1) if verdict is not None or _has_step(m) else (0, 1, 4)
        out = tmp_path / "out"
        for argv in (["replay", "--device", "cpu", m], ["replay", "--no-kv-check", m],
                     ["diff", m, trace], ["diff", trace, m], ["show", m],
                     ["redact", m, out.with_suffix(".jsonl")],
                     ["export", "-o", out.with_suffix(".json"), m],
                     ["report", "-o", out.with_suffix(".html"), m]):
            code, err = _run(capsys, *argv)
            where = f"{trace.name} mutant {n} ({what}), kvtrace {argv[0]}"
            assert "Traceback" not in err, (where, err)
            if verdict is not None:
                assert code == 2 and err.splitlines() == [f"kvtrace: {verdict}"], (where, code, err)
            else:
                assert code in (passed if argv[0] == "replay" else compared if argv[0] == "diff"
                                else (0, 1)), (where, code, err)
    # The mutants must test both sides: some refused, some read on.
    if MUTANTS >= 12:
        assert 0 < refused < MUTANTS, (trace.name, refused)
