"""The compiled path (kvtrace/compiled.py, built by kvtrace/compile.py) runs
the same code as the pure one: every stored trace replays to the same JSON on
both. The compiled path is asked for by KVTRACE_REQUIRE_COMPILED=1 (.ci/run
sets it): there, a test that finds it not built fails; elsewhere it skips
loudly."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys

import pytest

from kvtrace import compiled
from tests._paths import REPO

REQUIRED = os.environ.get("KVTRACE_REQUIRE_COMPILED") == "1"
TRACES = sorted(str(p.relative_to(REPO)) for p in (REPO / "traces").rglob("*.jsonl.gz"))

# Run in a process of its own: replay each trace given, as `kvtrace replay
# --json` does, and print which file each compiled module was loaded from.
_CHILD = """
import contextlib, io, json, sys
from kvtrace import cli, compiled
out = {}
for path in sys.argv[1:]:
    raw, stderr = io.BytesIO(), io.StringIO()
    stdout = io.TextIOWrapper(raw, encoding="utf-8")   # the JSON is written as bytes
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.run(["replay", path, "--json"])
    stdout.flush()
    out[path] = [code, raw.getvalue().decode(), stderr.getvalue()]
print(json.dumps({"compiled": compiled.COMPILED, "reason": compiled.REASON,
                  "files": {m: getattr(sys.modules.get(m), "__file__", None)
                            for m in compiled.MODULES},
                  "replays": out}))
"""


def _replay_all(pure: bool) -> dict:
    env = {**os.environ, "KVTRACE_PURE": "1" if pure else "0", "COLUMNS": "80",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD, *TRACES], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _is_extension(path: str | None) -> bool:
    return path is not None and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _need_compiled() -> None:
    ok, reason = compiled.choose()
    if ok:
        return
    if REQUIRED:
        pytest.fail(f"KVTRACE_REQUIRE_COMPILED=1, but the compiled path does not run: {reason}")
    pytest.skip(f"the compiled path does not run ({reason}); THESE TESTS DID NOT RUN")


def test_every_stored_trace_replays_to_the_same_json_compiled_and_pure():
    _need_compiled()
    assert len(TRACES) > 100
    fast, pure = _replay_all(pure=False), _replay_all(pure=True)
    # Each side ran what it says: every compiled module an extension, or its source.
    assert fast["compiled"] and not pure["compiled"], (fast["reason"], pure["reason"])
    assert all(_is_extension(f) for f in fast["files"].values()), fast["files"]
    assert all(f is not None and f.endswith(".py") for f in pure["files"].values()), pure["files"]
    assert fast["replays"].keys() == pure["replays"].keys() == set(TRACES)
    differ = [p for p in TRACES if fast["replays"][p] != pure["replays"][p]]
    assert differ == [], f"{len(differ)} traces replay differently, the first {differ[0]}"
    # The replays are real ones: most traces replay clean, some find divergences.
    codes = [code for code, _, _ in pure["replays"].values()]
    assert codes.count(0) > 50 and 1 in codes
    assert all(json.loads(out)["steps"] > 0 for code, out, _ in pure["replays"].values()
               if code in (0, 1))


def _tree(tmp_path, built: bool = True):
    """A copy of the compiled modules' and kernels' layout: their sources, an
    extension file beside each (an empty stand-in), and the manifest of a build."""
    root = tmp_path / "root"
    for m in compiled.MODULES + compiled.KERNELS:
        src = root.joinpath(*m.split(".")).with_suffix(".c" if m in compiled.KERNELS else ".py")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {m}\n")
        if built:
            src.with_suffix(importlib.machinery.EXTENSION_SUFFIXES[0]).write_text("")
    if built:
        (root / "kvtrace" / "compiled.json").write_text(json.dumps(
            {"python": sys.implementation.cache_tag, "mypy": "x",
             "sources": compiled.manifest(str(root))}))
    return root


def test_the_compiled_path_runs_only_on_extensions_built_from_the_sources_there(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTRACE_PURE", raising=False)
    root = _tree(tmp_path)
    assert compiled.choose(str(root)) == (True, f"{len(compiled.MODULES)} modules compiled with "
                                                f"mypyc x, and 1 kernel in C")
    kernel = root / "kvtrace" / "record" / "vllm" / "_kv_digest.c"
    kernel.write_text(kernel.read_text() + "/* changed */\n")
    assert compiled.choose(str(root)) == (
        False, "kvtrace.record.vllm._kv_digest changed since the build (rebuild)")
    src = root / "kvtrace" / "reference" / "scheduler.py"
    src.write_text(src.read_text() + "# changed\n")
    assert compiled.choose(str(root)) == (
        False, "kvtrace.reference.scheduler changed since the build (rebuild)")
    monkeypatch.setenv("KVTRACE_PURE", "1")
    assert compiled.choose(str(root)) == (False, "KVTRACE_PURE is set")


def test_the_pure_path_runs_where_nothing_is_built(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTRACE_PURE", raising=False)
    root = _tree(tmp_path, built=False)
    assert compiled.choose(str(root)) == (False, "not built (python -m kvtrace.compile builds it)")


def test_status_says_which_path_runs_and_require_fails_on_the_pure_one():
    env = {**os.environ, "KVTRACE_PURE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvtrace.compile", "--status", "--require"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stdout.startswith("kvtrace runs its pure Python path: KVTRACE_PURE is set")
    assert "SourceFileLoader" in done.stdout


def test_status_names_the_compiled_path_where_it_runs():
    _need_compiled()
    env = {**os.environ, "KVTRACE_PURE": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvtrace.compile", "--status", "--require"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("kvtrace runs its compiled path: ")
    assert "ExtensionFileLoader" in done.stdout
