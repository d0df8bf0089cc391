"""The shadow-KV check's NumPy backend, and where ``--device`` puts the check:
NumPy reports what torch reports, word for word, and a small replay never
imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtrace.engine import FAULT_WORKLOADS, record_embedded
from kvtrace.replay.kv_content import device as kv_device
from kvtrace.replay import replay_file

from tests._paths import REPO

TRACES = REPO / "traces"
CHECKED = sorted(TRACES.rglob("*.jsonl.gz"))


def _same_report(path) -> int:
    """Replay ``path`` with the check on NumPy and on torch (CPU); both must give
    the same divergences, word for word, and verify as many slots. Returns the
    kv-content divergences."""
    mine, theirs = (replay_file(path, device=d, worker=0) for d in ("numpy", "torch-cpu"))
    assert (mine.device, theirs.device) == ("numpy", "cpu")
    assert [d.to_json() for d in mine.divergences] == [d.to_json() for d in theirs.divergences]
    assert mine.slots_checked == theirs.slots_checked > 0
    return sum(d.kind == "kv-content" for d in mine.divergences)


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(TRACES)))
def test_every_trace_replays_word_for_word_the_same_on_numpy_as_on_torch(path):
    _same_report(path)


def test_the_traces_compared_include_kv_content_divergences():
    """The comparison above covers the check's report, not only clean runs."""
    faulty = sorted((TRACES / "faults").glob("*.jsonl.gz"))
    assert sum(_same_report(p) > 0 for p in faulty) >= 3


@pytest.mark.parametrize("fault", sorted(FAULT_WORKLOADS))
def test_embedded_fault_traces_replay_the_same_on_numpy_as_on_torch(tmp_path, fault):
    res = record_embedded(tmp_path / "t.jsonl", workload=FAULT_WORKLOADS[fault], fault=fault)
    assert res.fault_log, f"the fault {fault} never fired"
    _same_report(res.path)


def test_the_check_in_a_worker_on_numpy_reports_what_it_reports_in_process():
    path = TRACES / "faults" / "window-freed-early.jsonl.gz"
    apart, here = (replay_file(path, device="cpu", worker=w) for w in (1, 0))
    assert apart.device == here.device == "numpy"
    assert [d.to_json() for d in apart.divergences] == [d.to_json() for d in here.divergences]
    assert apart.slots_checked == here.slots_checked > 0


# --------------------------------------------------------------------------- no torch


_RUN = """
import sys
from kvtrace.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("exit", code, "torch", "torch" in sys.modules)
"""


def _run_cli(*args: str) -> str:
    p = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True)
    return p.stdout.strip().splitlines()[-1]


def test_a_small_replay_with_the_check_does_not_import_torch(tmp_path):
    res = record_embedded(tmp_path / "s.jsonl", workload="shared-prefix", seed=0)
    assert _run_cli("replay", str(res.path)) == "exit 0 torch False"
    assert _run_cli("replay", "--device", "cpu", str(res.path)) == "exit 0 torch False"


def test_a_faulty_small_replay_does_not_import_torch():
    path = TRACES / "faults" / "async-load-overshoot.jsonl.gz"
    assert _run_cli("replay", str(path)) == "exit 1 torch False"


def test_a_trace_with_no_step_does_not_import_torch(tmp_path):
    from kvtrace.trace.io import TraceReader, TraceWriter

    empty = tmp_path / "empty.jsonl"
    TraceWriter(empty, TraceReader(TRACES / "preemption.jsonl.gz").header).close()
    assert _run_cli("replay", str(empty)) == "exit 4 torch False"


def test_torch_on_the_cpu_does_import_torch(tmp_path):
    """The probe above can see torch when it is there."""
    res = record_embedded(tmp_path / "s.jsonl", workload="shared-prefix", seed=0)
    code = ("import sys; from kvtrace.replay import replay_file; "
            f"replay_file({str(res.path)!r}, device='torch-cpu', worker=0); "
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "True", p.stderr[-2000:]


# --------------------------------------------------------------------------- --device auto


def _never() -> bool:
    raise AssertionError("asked whether torch sees CUDA")


def test_auto_takes_numpy_for_a_small_trace_without_asking_torch():
    big = kv_device.CUDA_MIN_BYTES
    many = kv_device.CUDA_MIN_SLOTS
    assert kv_device.choose("auto", big - 1, many, _never) == "numpy"
    assert kv_device.choose("auto", big, many - 1, _never) == "numpy"
    assert kv_device.choose("auto", 0, 0, _never) == "numpy"


def test_auto_takes_cuda_for_a_large_trace_of_a_large_cache_when_torch_sees_it():
    big, many = kv_device.CUDA_MIN_BYTES, kv_device.CUDA_MIN_SLOTS
    assert kv_device.choose("auto", big, many, lambda: True) == "cuda"
    assert kv_device.choose("auto", big, many, lambda: False) == "numpy"


def test_cpu_and_cuda_force_the_choice():
    big, many = kv_device.CUDA_MIN_BYTES, kv_device.CUDA_MIN_SLOTS
    assert kv_device.choose("cpu", big, many, _never) == "numpy"
    assert kv_device.choose("cuda", 0, 0, _never) == "cuda"
    assert kv_device.choose("torch-cpu", 0, 0, _never) == "cpu"
    assert kv_device.choose("numpy", big, many, _never) == "numpy"


def test_pick_backend_measures_the_file_and_the_cache(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(b"\0" * kv_device.CUDA_MIN_BYTES)
    B = 16
    blocks = kv_device.CUDA_MIN_SLOTS // B
    assert kv_device.pick_backend("auto", path, blocks - 1, B) == "numpy"
    seen = kv_device._cuda()
    assert kv_device.pick_backend("auto", path, blocks, B) == ("cuda" if seen else "numpy")


def test_replay_help_states_the_rule():
    from click.testing import CliRunner

    from kvtrace.cli import cli

    out = " ".join(CliRunner().invoke(cli, ["replay", "--help"], terminal_width=80).output.split())
    mib = kv_device.CUDA_MIN_BYTES >> 20
    slots = kv_device.CUDA_MIN_SLOTS.bit_length() - 1
    assert f"cuda only for a trace of {mib} MiB or more whose KV cache holds 2^{slots} slots" in out
