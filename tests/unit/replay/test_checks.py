"""The comparisons replay makes (kvtrace/replay/checks.py): what a divergence
says is what the reference held when it was found, whatever the reference
does later."""

from __future__ import annotations

import orjson
import pytest

from kvtrace.replay.replayer import Replayer
from kvtrace.trace import TraceReader

from tests._paths import REPO


FAULTY = sorted(p.relative_to(REPO / "traces").as_posix()
                for folder in ("faults", "vllm-bugs", "hybrid-state/vllm-bugs")
                for p in (REPO / "traces" / folder).glob("*.jsonl*"))


@pytest.mark.parametrize("name", FAULTY)
def test_a_divergence_keeps_what_the_reference_held_when_it_was_found(name):
    """Each divergence as JSON when it was found and at the end of the replay:
    the same. (A block table reported as expected was the reference's own
    list, which later steps extended: the report showed a later table.)"""
    path = REPO / "traces" / name
    seen: list[bytes] = []
    with TraceReader(path) as reader:
        rp = Replayer(reader.header, str(path), None, None)
        for e in reader:
            rp.feed(e, reader.last_line)
            seen += [orjson.dumps(d.to_json()) for d in rp.divergences[len(seen):]]
    assert [orjson.dumps(d.to_json()) for d in rp.divergences] == seen
