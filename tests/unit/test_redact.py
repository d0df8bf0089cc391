"""Redaction of what a KV audit holds: the engine's block hashes and the
digests of the KV bytes are keyed, as prompt_embeds digests are, and the
data-path checks read the redacted trace as they read the original."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from kvtrace.redact import redact_file
from kvtrace.replay import replay_file

from tests._paths import REPO

DATA_PATH = REPO / "traces" / "data-path"
KEY = bytes(range(32))


def _audit_values(path: Path) -> tuple[set[str], set[int]]:
    """Every block hash and byte digest of the trace's kv_audit records."""
    opener = gzip.open if path.name.endswith(".gz") else open
    hashes, digests = set(), set()
    with opener(path, "rb") as f:
        for line in f:
            rec = orjson.loads(line)
            if rec.get("kind") != "kv_audit":
                continue
            for entry in rec.get("loaded", []):
                hashes.add(entry[2])
                digests.update(entry[3:5])
            for name in ("saved", "cached", "hits"):
                for entry in rec.get(name, []):
                    hashes.add(entry[2])
                    digests.add(entry[3])
    return hashes - {""}, digests


@pytest.mark.parametrize("name", ["stored-block-corrupted", "resumed-load-dropped",
                                  "example-connector"])
def test_redaction_keys_the_kv_audit_and_the_checks_read_it_alike(tmp_path, name):
    """The block hashes were kept: the engine's hashes of the original token
    blocks, which under a fixed hash seed confirm a guessed prompt."""
    src = DATA_PATH / f"{name}.jsonl.gz"
    dst = tmp_path / f"{name}.jsonl.gz"
    redact_file(src, dst, key=KEY)
    hashes, digests = _audit_values(src)
    red_hashes, red_digests = _audit_values(dst)
    assert hashes and digests
    assert not hashes & red_hashes and not digests & red_digests
    assert len(red_hashes) == len(hashes) and len(red_digests) == len(digests)   # equal stay equal
    assert {len(h) for h in red_hashes} == {len(h) for h in hashes}
    before, after = replay_file(src, device=None), replay_file(dst, device=None)
    assert after.audit == before.audit
    key = lambda d: (d.step, d.req, d.field, d.rule)   # noqa: E731
    assert [key(d) for d in after.divergences] == [key(d) for d in before.divergences]
    assert any(d.field.startswith("kv-") for d in before.divergences) or name == "example-connector"
    again = tmp_path / "again.jsonl.gz"
    redact_file(src, again, key=KEY)
    assert _audit_values(again) == (red_hashes, red_digests)   # the same key, the same pseudonyms
