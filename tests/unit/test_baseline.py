"""What the reference does not model is one list (kvtrace.baseline.REFUSED):
each entry refuses a header that turns its feature on, in one line naming it,
with exit 2, and no other entry claims that header. A new entry needs a case
here; an entry taken out (the reference learned to model it) takes its case
with it, and its names out of the docs (tests/house/test_docs.py)."""

from __future__ import annotations

import gzip

import orjson
import pytest

from kvtrace import cli
from kvtrace.baseline import REFUSED, Setting, outside, profile_refusal
from kvtrace.reference.profiles import PROFILES

from tests._paths import REPO

TRACE = REPO / "traces" / "preemption.jsonl.gz"
BLOCK = 32   # the trace's block size
EAGLE = {"num_speculative_tokens": 2, "num_draft_slots": 0, "use_eagle": True,
         "eagle_block_drop": True, "num_prefill_lookahead_tokens": 1}

# name of an entry -> (features that turn it on, the profile replay follows)
STATE = {"kind": "MambaSpec", "block_size": BLOCK, "mamba_type": "gdn_attn",
         "mamba_cache_mode": "align", "num_speculative_blocks": 0,
         "num_prefill_checkpoint_blocks": 0}
FULL = {"kind": "FullAttentionSpec", "block_size": BLOCK}

CASES = {
    "diffusion language models": ({"diffusion": True}, "0.32"),
    "multimodal models": ({"multimodal": True}, "0.32"),
    "prefix replay windows": ({"prefix_replay_tokens": 64}, "0.32"),
    "multi-module MTP": ({**EAGLE, "num_prefill_lookahead_tokens": 2}, "0.32"),
    "pipeline parallelism": ({"pipeline_parallel_size": 2}, "0.32"),
    "decode context parallelism": ({"decode_context_parallel_size": 4}, "0.32"),
    "other kinds of KV-cache group (chunked local or cross-attention)":
        ({"kv_cache_group_kinds": ["FullAttentionSpec", "ChunkedLocalAttentionSpec"]}, "0.32"),
    "KV-cache groups of another block size under prefix caching":
        ({"kv_cache_groups": [{"kind": "FullAttentionSpec", "block_size": 16}]}, "0.32"),
    "EAGLE with a sliding-window or state group under prefix caching":
        ({**EAGLE, "kv_cache_groups": [{"kind": "SlidingWindowSpec", "block_size": BLOCK,
                                        "sliding_window": 64}]}, "0.32"),
    "a hash block size other than the block size (partial prefix hits)":
        ({"hash_block_size": 16}, "0.32"),
    "state groups of mixed cache modes or one state per request under prefix caching":
        ({"kv_cache_groups": [dict(STATE, mamba_cache_mode="none"), FULL]}, "0.32"),
    "lookahead block hashes with a state group":
        ({"num_hash_lookahead_tokens": 1, "kv_cache_groups": [STATE, FULL]}, "0.32"),
    "sliding-window or state groups or async scheduling under the legacy and 0.19 profiles":
        ({"async_scheduling": True}, "legacy"),
    "prompt embeddings with lookahead block hashes":
        ({"prompt_embeds": True, "num_hash_lookahead_tokens": 1}, "0.33"),
}


def test_every_entry_has_a_case():
    assert list(CASES) == [r.name for r in REFUSED]


def _claims(features: dict, profile: str) -> list[str]:
    """The entries that refuse ``features`` under ``profile``."""
    from kvtrace.trace.events import features_from

    f = features_from(features)
    return [r.name for r in REFUSED
            if r.on(f, Setting(BLOCK), PROFILES[profile] if r.by_profile else None)]


@pytest.mark.parametrize("name", list(CASES))
def test_each_entry_refuses_its_feature_in_one_line(name, tmp_path, capsys):
    features, profile = CASES[name]
    assert _claims(features, profile) == [name]
    objs = [orjson.loads(x) for x in gzip.decompress(TRACE.read_bytes()).splitlines()]
    objs[0]["features"] = features
    bad = tmp_path / "t.jsonl"
    bad.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    code = cli.run(["replay", "--device", "cpu", "--profile", profile, str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    from kvtrace.trace.events import features_from

    f = features_from(features)
    why = outside(f, BLOCK) or profile_refusal(f, BLOCK, PROFILES[profile])
    assert why and f"{bad}:1: {why}" in err


def test_an_entry_taken_out_refuses_no_more(monkeypatch):
    """Shrinking the list is taking an entry out: its feature is then refused
    by no other entry."""
    from kvtrace import baseline

    assert baseline.outside({"multimodal": True}, BLOCK) is not None
    monkeypatch.setattr(baseline, "REFUSED", tuple(
        r for r in REFUSED if r.name != "multimodal models"))
    assert baseline.outside({"multimodal": True}, BLOCK) is None


def test_state_groups_are_modelled_where_the_header_lists_them():
    """Mamba layers replay once the header lists their groups with each state
    group's cache mode and blocks; a header that does not say them is refused
    for what it does not say."""
    assert outside({"kv_cache_groups": [STATE, STATE, FULL], "has_mamba_layers": True},
                   BLOCK) is None
    assert "does not list their KV-cache groups" in outside({"has_mamba_layers": True}, BLOCK)
    assert "does not list its spec" in outside({"kv_cache_group_kinds": ["MambaSpec"]}, BLOCK)
    no_mode = {k: v for k, v in STATE.items() if k != "mamba_cache_mode"}
    assert "does not say its mamba_cache_mode" in outside({"kv_cache_groups": [no_mode, FULL]},
                                                          BLOCK)
