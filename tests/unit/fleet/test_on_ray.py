"""Items replayed as Ray tasks: the answers of the pool's, in the order given;
a task whose worker is killed is retried, and one that fails past its retries
or raises is named as an internal error, the other items still answered."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import orjson
import pytest

from kvtrace.fleet.items import Item, replay_item
from kvtrace.fleet.on_ray import ClusterUnavailable, is_address, replay_on_ray, run_task
from kvtrace.replay.many import InternalError, replay_many
from kvtrace.report.terminal import replay_many_json

from tests._paths import REPO
from tests._ray import local_cluster

TRACES = REPO / "traces"
SOME = [TRACES / "faults" / "async-load-overshoot.jsonl.gz", TRACES / "pooling.jsonl.gz",
        TRACES / "vllm-bugs" / "spec-session-overshoot.jsonl.gz",
        TRACES / "disagg" / "prefill.jsonl.gz"]


@pytest.fixture(scope="module")
def cluster():
    yield from local_cluster()


def _links(folder: Path) -> list[str]:
    """The traces of SOME linked into ``folder``: a task leaves its marks beside them."""
    paths = []
    for i, trace in enumerate(SOME):
        link = folder / f"{i}-{trace.name}"
        link.symlink_to(trace)
        paths.append(str(link))
    return paths


def dies_once(item: Item):
    """Kill this worker the first time an item comes, then replay it."""
    mark = Path(item[0] + ".died")
    if not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return replay_item(item)


def dies_on_doomed(item: Item):
    """Kill this worker each time the item named ``doomed`` comes."""
    if "doomed" in item[0]:
        Path(item[0] + f".died-{os.getpid()}").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return replay_item(item)


def raises(item: Item):
    raise RuntimeError("the task\nbroke")


class Stopped(BaseException):
    """As the command's SIGTERM raises (kvtrace.cli.Stopped)."""


def sleeps(item: Item):
    time.sleep(30)
    return replay_item(item)


@pytest.mark.ray
def test_a_killed_worker_is_retried_and_the_answers_are_the_pools(cluster, tmp_path):
    paths = _links(tmp_path)
    here = replay_many(paths, None, None, jobs=1)
    done = []
    there = replay_on_ray([Item(p) for p in paths], progress=done.append, task=dies_once)
    assert all(Path(p + ".died").exists() for p in paths)   # each task's first worker died
    assert [err for _, _, err in there] == [None] * len(paths)
    assert replay_many_json(there) == replay_many_json(here)
    assert orjson.loads(replay_many_json(there))["traces"][0]["divergences"]   # a real report
    assert done[-1] == len(paths)


@pytest.mark.ray
def test_a_task_that_fails_past_its_retries_is_named_and_the_others_answer(cluster, tmp_path):
    paths = _links(tmp_path)
    doomed = tmp_path / "doomed.jsonl.gz"
    doomed.symlink_to(SOME[0])
    items = [Item(p) for p in paths[:2]] + [Item(str(doomed))] + [Item(p) for p in paths[2:]]
    answers = replay_on_ray(items, task=dies_on_doomed, retries=1)
    assert [p for p, _, _ in answers] == [i.path for i in items]   # in the order given
    assert len(list(tmp_path.glob("doomed.jsonl.gz.died-*"))) == 2   # tried, and retried once
    _, result, err = answers[2]
    assert result is None and isinstance(err, InternalError)
    assert err.startswith(f"{doomed}: internal error: its Ray task failed after 1 retry: ")
    assert "\n" not in err
    assert all(r is not None and e is None for i, (_, r, e) in enumerate(answers) if i != 2)


@pytest.mark.ray
def test_a_task_that_raises_is_an_internal_error_on_one_line(cluster, tmp_path):
    (path, _, err), = replay_on_ray([Item(str(SOME[1]))], task=raises)
    assert isinstance(err, InternalError)
    assert err == f"{SOME[1]}: internal error in its Ray task: RuntimeError: the task"


@pytest.mark.ray
def test_sigterm_while_tasks_run_comes_out_as_itself(cluster):
    """A signal whose handler raises (the command's SIGTERM) while the wait for
    the tasks runs in Ray's compiled code, which turns the exception into a
    SystemError: the command must unwind as from the signal (its tasks
    cancelled, the cluster shut down, exit 143), not as an internal error."""
    def interrupt(signum, frame):
        raise Stopped
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2.5)
    try:
        with pytest.raises(Stopped):
            replay_on_ray([Item(str(p)) for p in SOME], task=sleeps)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.ray
def test_an_address_that_nothing_answers_at_is_said_at_once(cluster):
    with socket.socket() as s:   # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ClusterUnavailable) as e:
        replay_on_ray([Item(str(SOME[1]))], f"127.0.0.1:{port}")
    assert str(e.value) == f"--ray: no Ray cluster answers at 127.0.0.1:{port}: Connection refused"


def test_a_task_reads_a_relative_path_from_the_commands_folder(tmp_path, monkeypatch):
    (tmp_path / "t.jsonl.gz").symlink_to(SOME[1])
    monkeypatch.chdir(REPO)   # a worker elsewhere
    path, result, err = run_task(replay_item, Item("t.jsonl.gz"), str(tmp_path))
    assert err is None and path == "t.jsonl.gz" and result.steps == 7
    monkeypatch.chdir(REPO)
    path, result, err = run_task(replay_item, Item("t.jsonl.gz"), str(tmp_path / "gone"))
    assert result is None and err.startswith("t.jsonl.gz: a relative path, and Ray's worker on ")
    assert f"cannot enter {tmp_path / 'gone'}, where the command runs" in err


@pytest.mark.parametrize("text, address", [
    ("auto", True), ("local", True), ("10.0.0.5:6379", True), ("head:6379", True),
    ("ray://head:10001", True), ("[::1]:6379", True),
    ("t.jsonl.gz", False), ("traces/a.jsonl.gz", False), ("ring", False), ("", False),
    ("./x:1", False)])
def test_an_address_is_told_from_a_trace(text, address):
    assert is_address(text) is address
