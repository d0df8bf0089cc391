"""Every row of docs/reference/bad-input.md, through the command line: `kvtrace replay` and
`kvtrace diff` answer a malformed trace with exit code 2 and one line on stderr
naming the file and the line, and never with a traceback. Cut-off traces are not
errors: they replay up to the cut and say where it is."""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

import orjson
import pytest
import zstandard

from kvtrace import cli
from kvtrace.trace import TraceReader

from tests._paths import REPO

# Base trace: embedded engine, workload shared-prefix, seed 0. Its first lines:
#   1 header   2 arrival chat-0   3 step 0   4 output 0   5 prompt_stats chat-0
#   6 step 1   7 output 1   8 step 2 ...


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from kvtrace.engine import record_embedded

    path = tmp_path_factory.mktemp("base") / "base.jsonl"
    record_embedded(path, workload="shared-prefix", seed=0)
    return path


def _objs(base) -> list[dict]:
    return [orjson.loads(x) for x in base.read_bytes().splitlines()]


def _dump(objs) -> bytes:
    return b"".join(o if isinstance(o, bytes) else orjson.dumps(o) + b"\n" for o in objs)


def _run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_rejected(capsys, bad, good, line, *needles):
    """exit 2, one stderr line naming FILE:LINE and the problem, for replay and diff."""
    where = f"{bad}:{line}:" if line is not None else f"{bad}:"
    for argv in (["replay", "--device", "cpu", bad], ["diff", bad, good]):
        code, _, err = _run(capsys, *argv)
        assert "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert code == 2, (argv[0], code, err)
        assert len(lines) == 1, err
        assert lines[0].startswith(f"kvtrace: {where}"), lines[0]
        for n in needles:
            assert n in lines[0], (n, lines[0])


def _edit(base, tmp_path, fn, name="bad.jsonl"):
    objs = _objs(base)
    fn(objs)
    path = tmp_path / name
    path.write_bytes(_dump(objs))
    return path


def _digests_for(objs) -> list[str]:
    """As many (made-up) digests as the first arrival's prompt has blocks."""
    n, bs = len(objs[1]["prompt_token_ids"]), objs[0]["config"]["block_size"]
    return ["ab" * 32] * -(-n // bs)


def test_a_prompt_of_embeddings_with_its_digests_replays(base, tmp_path, capsys):
    """The same trace with a first prompt of embeddings (its digests and a run
    of token ids) reads and replays: the checks above refuse only what is wrong."""
    good = _edit(base, tmp_path, lambda o: o[1].update(prompt_embeds=_digests_for(o),
                                                       prompt_is_token_ids=[[0, 1]]))
    with TraceReader(good) as r:
        assert sum(1 for _ in r) == len(_objs(base)) - 1 and r.truncation is None
    code, out, err = _run(capsys, "replay", "--device", "cpu", "--no-kv-check", good)
    assert code in (0, 1) and err.strip() == "", err   # divergences, maybe; no refusal


# --------------------------------------------------------------------------- file level


def test_not_json(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.__setitem__(5, b'{"seq": 4, "kind": "step", oops}\n'))
    _assert_rejected(capsys, bad, base, 6, "not JSON")


def test_a_json_document_over_several_lines(base, tmp_path, capsys):
    bad = tmp_path / "pretty.json"
    bad.write_text(json.dumps(_objs(base)[0], indent=2))
    _assert_rejected(capsys, bad, base, 1, "a JSON document spread over several lines")


def test_a_perfetto_file(base, tmp_path, capsys):
    bad = tmp_path / "x.json"
    assert _run(capsys, "export", "--no-divergences", "-o", bad, base)[0] == 0
    _assert_rejected(capsys, bad, base, None, "a Perfetto (Chrome trace-event) file, not a "
                                              "kvtrace trace")


def test_wrong_schema_version(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[0].__setitem__("schema", 2))
    _assert_rejected(capsys, bad, base, 1, "unsupported schema version 2 (this kvtrace reads 1)")
    bad = _edit(base, tmp_path, lambda o: o[0].__setitem__("schema", True))
    _assert_rejected(capsys, bad, base, 1, "field 'schema': expected an integer, got a boolean "
                                           "True (this kvtrace reads schema 1)")


def test_a_schema_version_written_as_a_string_is_named_so(base, tmp_path, capsys):
    """"1" once read "unsupported schema version '1' (this kvtrace reads 1)"."""
    bad = _edit(base, tmp_path, lambda o: o[0].__setitem__("schema", "1"))
    _assert_rejected(capsys, bad, base, 1, "field 'schema': expected an integer, got a string "
                                           "'1' (this kvtrace reads schema 1)")


def test_missing_header(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.pop(0))
    _assert_rejected(capsys, bad, base, 1, "missing header: the first record must have kind 'header'")


def test_header_missing_field(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[0]["config"].pop("num_blocks"))
    _assert_rejected(capsys, bad, base, 1, "missing field 'config.num_blocks'")


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file(base, tmp_path, capsys, content):
    bad = tmp_path / "empty.jsonl"
    bad.write_bytes(content)
    _assert_rejected(capsys, bad, base, 1, "empty file: no header record")


def test_binary_garbage_file(base, tmp_path, capsys):
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(random.Random(0).randbytes(8192))
    _assert_rejected(capsys, bad, base, 1, "binary data, not a JSON record")


def test_binary_garbage_after_header(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.insert(3, b"\x00\x01\xfe\xff garbage \x07\n"))
    _assert_rejected(capsys, bad, base, 4, "binary data, not a JSON record")


def test_a_string_that_is_not_utf8(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.insert(3, b'{"kind":"abort","seq":2,"reqs":["\xff\xfe"]}\n'))
    _assert_rejected(capsys, bad, base, 4, "not JSON (str is not valid UTF-8")


def test_second_header(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.insert(2, o[0]))
    _assert_rejected(capsys, bad, base, 3, "a second header record")


def test_record_after_end(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.append({"seq": 10 ** 6, "kind": "abort", "reqs": []}))
    n = len(base.read_bytes().splitlines()) + 1
    _assert_rejected(capsys, bad, base, n, "record after the 'end' record")


def test_sequence_not_increasing(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[3].__setitem__("seq", 1))
    _assert_rejected(capsys, bad, base, 4, "sequence number 1 does not follow 1")


def test_a_null_line_is_a_bad_record_not_the_end_of_the_trace(base, tmp_path, capsys):
    """JSON ``null`` is a value: the trace goes on after it, and must not be
    read as cut off there (every record after it would be lost)."""
    bad = _edit(base, tmp_path, lambda o: o.insert(5, b"null\n"))
    _assert_rejected(capsys, bad, base, 6, "a record must be a JSON object, got null")
    for argv in (["show", bad], ["redact", bad, tmp_path / "copy.jsonl"]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and err.strip() == f"kvtrace: {bad}:6: a record must be a JSON object, got null"


def test_a_null_header(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o.__setitem__(0, b"null\n"))
    _assert_rejected(capsys, bad, base, 1, "missing header: the first record must have kind 'header'")


def test_a_trace_of_only_a_header_is_cut_after_line_1(base, tmp_path, capsys):
    path = tmp_path / "header-only.jsonl"
    path.write_bytes(base.read_bytes().splitlines(keepends=True)[0])
    code, out, _ = _run(capsys, "replay", "--no-kv-check", path)
    assert code == 4 and "no 'end' record after line 1" in out   # and nothing to check


# --------------------------------------------------------------------------- records


@pytest.mark.parametrize("how", ["arrives-twice", "never-arrived"])
def test_a_request_id_of_megabytes_is_not_echoed_whole(base, tmp_path, capsys, how):
    """A 10 MB request id was echoed whole to stderr. (An arrival is held to
    1 MiB and its prompt under this header: its id is 500 KB.)"""
    huge = "r" * (500_000 if how == "arrives-twice" else 10_000_000)
    if how == "arrives-twice":
        def edit(o):
            o[1]["req"] = huge
            o.insert(2, {**o[1], "seq": o[1]["seq"] + 0.5})
        bad = _edit(base, tmp_path, lambda o: (edit(o), _renumber(o)))
        line, needle = 3, "arrives twice"
    else:
        bad = _edit(base, tmp_path, lambda o: o[2]["new"][0].__setitem__("req", huge))
        line, needle = 3, "which never arrived"
    _assert_rejected(capsys, bad, base, line, needle, f"({len(huge) + 2:,} characters)")
    for argv in (["replay", bad], ["show", bad]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and len(err) < 400, err[:400]


def _renumber(objs) -> None:
    for i, o in enumerate(objs[1:]):
        o["seq"] = i


def test_a_live_request_arriving_again(base, tmp_path, capsys):
    """Refused by every command alike (replay used to be the only one)."""
    def edit(o):
        again = dict(o[1], seq=o[2]["seq"])
        for rec in o[2:]:
            rec["seq"] += 1
        o.insert(2, again)   # line 3, right after the first arrival
    bad = _edit(base, tmp_path, edit)
    _assert_rejected(capsys, bad, base, 3, f"request '{_objs(base)[1]['req']}' arrives twice")
    for argv in (["show", bad], ["redact", bad, tmp_path / "copy.jsonl"]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and err.strip().endswith("arrives twice"), (argv[0], err)


@pytest.mark.parametrize("extra", [0, 1, 500])
def test_a_prompt_with_no_room_within_max_model_len(base, tmp_path, capsys, extra):
    """vLLM refuses a prompt of max_model_len tokens or more (it leaves no room
    for an output token) before its scheduler sees it."""
    mml = _objs(base)[0]["config"]["max_model_len"]

    def edit(o):
        o[1]["prompt_token_ids"] = (o[1]["prompt_token_ids"] * (mml + extra))[:mml + extra]
    bad = _edit(base, tmp_path, edit)
    _assert_rejected(capsys, bad, base, 2, f"a prompt of {mml + extra} tokens leaves no room for an "
                                           f"output token within the header's max_model_len {mml}")


@pytest.mark.parametrize("features,message", [
    ({"max_num_active_seqs": "4"}, "field 'features.max_num_active_seqs': expected an integer or null, got a string"),
    ({"lora": True, "max_loras": 0}, "field 'features.max_loras': expected an integer >= 1"),
    ({"scheduler_reserve_full_isl": "no"}, "field 'features.scheduler_reserve_full_isl': expected true or false or null, got a string"),
    ({"async_scheduling": "true"}, "field 'features.async_scheduling': expected true or false or null, got a string"),
    ({"pipeline_parallel_size": 2.0}, "field 'features.pipeline_parallel_size': expected an integer or null, got a number"),
    ({"lora": "false"}, "field 'features.lora': expected true or false or null, got a string"),
])
def test_a_feature_of_the_wrong_type_is_refused_by_replay(base, tmp_path, capsys, features, message):
    bad = _edit(base, tmp_path, lambda o: o[0]["features"].update(features))
    code, _, err = _run(capsys, "replay", "--device", "cpu", bad)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{bad}:1: {message}" in err


def test_unknown_event_kind(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[2].__setitem__("kind", "teleport"))
    _assert_rejected(capsys, bad, base, 3, "unknown event kind 'teleport'")


def test_missing_kind(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[2].pop("kind"))
    _assert_rejected(capsys, bad, base, 3, "missing field 'kind'")


@pytest.mark.parametrize("line,edit,message", [
    (3, lambda o: o[2].__setitem__("step", "0"), "field 'step': expected an integer, got a string"),
    (3, lambda o: o[2].__setitem__("step", 0.0), "field 'step': expected an integer, got a number"),
    (2, lambda o: o[1].__setitem__("prompt_token_ids", [1, None]),
     "field 'prompt_token_ids[1]': expected an integer, got null"),
    (2, lambda o: o[1].__setitem__("ignore_eos", "yes"), "field 'ignore_eos': expected true or false, got a string"),
    (3, lambda o: o[2].__setitem__("new", {"req": "chat-0"}), "field 'new': expected a list, got an object"),
    (4, lambda o: o[3]["states"][0].__setitem__("status", "SLEEPING"), "field 'states[0].status': not an allowed value: 'SLEEPING'"),
    (3, lambda o: o[2]["new"][0].pop("block_ids"), "missing field 'new[0].block_ids'"),
    (3, lambda o: o.__setitem__(2, b"[1, 2, 3]\n"), "a record must be a JSON object, got a list"),
    (3, lambda o: o.insert(2, {"kind": "pause_state", "seq": o[1]["seq"], "state": "SLEEPING"}),
     "field 'state': not an allowed value: 'SLEEPING'"),
    (3, lambda o: o.insert(2, {"kind": "pause_state", "seq": o[1]["seq"]}), "missing field 'state'"),
    (2, lambda o: o[1].__setitem__("structured_output", 1), "field 'structured_output': expected true or false, got an integer"),
    (3, lambda o: o[2].__setitem__("grammar", {"chat-0": "maybe"}),
     "field 'grammar[...]': not an allowed value: 'maybe'"),
    (3, lambda o: o[2].__setitem__("grammar", ["chat-0"]), "field 'grammar': expected an object or null, got a list"),
    (4, lambda o: o[3].__setitem__("grammar_rejected", "chat-0"),
     "field 'grammar_rejected': expected a list or null, got a string"),
    (2, lambda o: o[1].__setitem__("pooling", "yes"), "field 'pooling': expected true or false, got a string"),
    (2, lambda o: o[1].__setitem__("repetition_detection", {"max_pattern_size": 2}),
     "missing field 'repetition_detection.min_pattern_size'"),
    (2, lambda o: o[1].__setitem__("repetition_detection", {"max_pattern_size": 2, "min_pattern_size": -1,
                                                            "min_count": 2}),
     "field 'repetition_detection[...]': expected an integer >= 0"),
    (4, lambda o: o[3].__setitem__("pooled", [1]), "field 'pooled[0]': expected a string, got an integer"),
    (2, lambda o: o[1].__setitem__("prompt_embeds", "ab" * 32),
     "field 'prompt_embeds': expected a list or null, got a string"),
    (2, lambda o: o[1].__setitem__("prompt_embeds", ["AB" * 32]),
     "field 'prompt_embeds[0]': expected a sha256 digest (64 lowercase hex digits)"),
    (2, lambda o: o[1].__setitem__("prompt_embeds", ["ab" * 32] * 40),
     "field 'prompt_embeds' holds 40 digests for a prompt of"),
    (2, lambda o: o[1].__setitem__("lora", {"id": 0, "name": "a", "path": "/a"}),
     "field 'lora.id': expected an integer >= 1"),
    (2, lambda o: o[1].__setitem__("lora", {"id": 1, "path": "/a"}), "missing field 'lora.name'"),
    (2, lambda o: o[1].__setitem__("lora", "a"), "field 'lora': expected an object or null, got a string"),
    (2, lambda o: o[1].__setitem__("lora", {"id": 1, "name": "a", "path": ""}), "field 'lora.path': expected a string of length >= 1"),
    (2, lambda o: o[1].__setitem__("lora", {"id": 1, "name": "a", "path": "/a"}),
     "names a LoRA adapter, but the header's features say LoRA is off"),
    (2, lambda o: o[1].__setitem__("prompt_is_token_ids", [[0, 1]]),
     "field 'prompt_is_token_ids' is set on a prompt without 'prompt_embeds'"),
    (2, lambda o: o[1].update(prompt_embeds=_digests_for(o), prompt_is_token_ids=[[2, 4], [4, 6]]),
     "field 'prompt_is_token_ids' must hold runs [start, end] of prompt positions, in order, none "
     "empty and none touching the next"),
    (2, lambda o: o[1].update(prompt_embeds=_digests_for(o), prompt_is_token_ids=[[0, 10 ** 6]]),
     "within the prompt's"),
])
def test_wrong_types(base, tmp_path, capsys, line, edit, message):
    bad = _edit(base, tmp_path, edit)
    _assert_rejected(capsys, bad, base, line, message)


def test_negative_count(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[2]["new"][0].__setitem__("num_scheduled_tokens", -5))
    _assert_rejected(capsys, bad, base, 3, "field 'new[0].num_scheduled_tokens': expected an integer >= 0")


def test_count_beyond_format_bound(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[2]["states"][0].__setitem__("num_tokens", 2 ** 41))
    _assert_rejected(capsys, bad, base, 3, f"field 'states[0].num_tokens': expected an integer <= {2 ** 40}")


def test_count_absurd_for_header(base, tmp_path, capsys):
    # 512 (max_model_len) + 96 blocks * 8 = 1280 tokens at most anywhere in this trace.
    bad = _edit(base, tmp_path, lambda o: o[2]["new"][0].__setitem__("num_scheduled_tokens", 10 ** 9))
    _assert_rejected(capsys, bad, base, 3, "field 'new.num_scheduled_tokens' is absurd: 1000000000 tokens",
                     "(1280)")


def test_absurd_header(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[0]["config"].update(num_blocks=2 ** 20, block_size=2 ** 12))
    _assert_rejected(capsys, bad, base, 1, "absurd KV cache")


def test_absurd_number_of_blocks(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[0]["config"].update(num_blocks=2 ** 25, block_size=1))
    _assert_rejected(capsys, bad, base, 1, "field 'config.num_blocks': expected an integer <= 16777216")


def test_a_kv_cache_whose_shadow_does_not_fit_is_refused_at_once(base, tmp_path, capsys):
    """2^31 slots pass the format's bound, but their shadow needs 58 GiB: replay
    says so before allocating anything, and names the way out."""
    import os

    bad = _edit(base, tmp_path, lambda o: o[0]["config"].update(num_blocks=2 ** 24, block_size=128))
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 29 * (2 ** 24 + 1) * 128 > have // 2, "this machine could hold it: the test needs a bigger cache"
    code, _, err = _run(capsys, "replay", "--device", "cpu", bad)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{bad}:1: the shadow-KV check of this KV cache" in err and "--no-kv-check" in err


def test_free_blocks_beyond_pool(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[2].__setitem__("num_free_blocks", 97))
    _assert_rejected(capsys, bad, base, 3, "'num_free_blocks' is 97, more than the 96 blocks")


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("line,edit,field", [
    (3, lambda o: o[2]["new"][0].__setitem__("req", "ghost"), "new.req"),
    (3, lambda o: o[2]["states"][0].__setitem__("req", "ghost"), "states.req"),
    (3, lambda o: o[2].__setitem__("preempted", ["ghost"]), "preempted"),
    (3, lambda o: o[2].__setitem__("lookups", [{"req": "ghost", "local": 0, "ext": 0}]), "lookups.req"),
    (4, lambda o: o[3]["sampled"].__setitem__("ghost", [5]), "sampled"),
    (4, lambda o: o[3].__setitem__("finished", {"ghost": "stop"}), "finished"),
    (4, lambda o: o[3].__setitem__("connector", {"failed_recving": ["ghost"]}), "connector.failed_recving"),
    (3, lambda o: o[2].__setitem__("grammar", {"ghost": "ready"}), "grammar"),
    (4, lambda o: o[3].__setitem__("grammar_rejected", ["ghost"]), "grammar_rejected"),
    (4, lambda o: o[3].__setitem__("pooled", ["ghost"]), "pooled"),
    (5, lambda o: o[4].__setitem__("req", "ghost"), "req"),
])
def test_unknown_request(base, tmp_path, capsys, line, edit, field):
    bad = _edit(base, tmp_path, edit)
    _assert_rejected(capsys, bad, base, line, f"field '{field}' names request 'ghost', which never arrived")


def test_abort_of_unknown_request_is_accepted(base, tmp_path, capsys):
    """vLLM's finish_requests ignores ids it does not know; so does replay."""
    def edit(o):
        o.insert(3, {"seq": 0, "kind": "abort", "reqs": ["ghost"]})
        for i, obj in enumerate(o[1:]):   # renumber: seq only has to increase
            obj["seq"] = i

    bad = _edit(base, tmp_path, edit)
    code, out, err = _run(capsys, "replay", "--device", "cpu", bad)
    assert code == 0, (out, err)
    code, out, err = _run(capsys, "diff", bad, base)
    assert code in (0, 1) and "Traceback" not in err


def test_steps_not_increasing(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[5].__setitem__("step", 0))
    _assert_rejected(capsys, bad, base, 6, "step 0 does not follow step 0: step numbers must increase")


def test_output_for_unscheduled_step(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[3].__setitem__("step", 7))
    _assert_rejected(capsys, bad, base, 4, "output for step 7, which has not been scheduled (the last step is 0)")


def test_output_for_a_step_with_no_record_is_refused_by_every_command(tmp_path, capsys):
    """Under async scheduling step N+1 is recorded before output N, so an
    output whose step record is gone still names a step before the last one.
    Every command refuses it at its line, as replay always did (diff, show,
    report, redact and export once read on)."""
    from pathlib import Path

    data = gzip.decompress((REPO / "traces" / "async-preemption.jsonl.gz")
                           .read_bytes())
    objs = [orjson.loads(x) for x in data.splitlines()]
    kinds = [(o.get("kind"), o.get("step")) for o in objs]
    # A step whose output comes after the next step's record.
    n = next(s for k, s in kinds if k == "step" and s is not None
             and kinds.index(("output", s)) > kinds.index(("step", s + 1)))
    gone = kinds.index(("step", n))
    line = kinds.index(("output", n))   # the output's line once the step's is gone (1-based)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_dump(objs[:gone] + objs[gone + 1:]))
    want = f"kvtrace: {bad}:{line}: output for step {n}, which has no step record before it"
    for argv in (["replay", "--device", "cpu", bad], ["replay", "--no-kv-check", bad],
                 ["diff", bad, bad], ["show", bad], ["report", "-o", tmp_path / "r.html", bad],
                 ["redact", bad, tmp_path / "red.jsonl"], ["export", "-o", tmp_path / "e.json", bad]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and err.strip().splitlines() == [err.strip()], (argv[0], code, err)
        assert err.startswith(want), (argv[0], err)


def test_drafts_before_the_output_of_their_step(base, tmp_path, capsys):
    """update_draft_token_ids comes after the output it drafts from: a drafts
    record for a step whose output is not in yet is refused at its line."""
    def edit(o):
        assert (o[3]["kind"], o[3]["step"], o[4]["kind"]) == ("output", 0, "prompt_stats")
        o[4] = {"kind": "drafts", "seq": o[4]["seq"], "step": 1, "drafts": {"chat-0": [5, 6]}}

    bad = _edit(base, tmp_path, edit)
    _assert_rejected(capsys, bad, base, 5,
                     "drafts for step 1, whose output has not come (the last output is for step 0)")


def test_output_repeated(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[6].__setitem__("step", 0))
    _assert_rejected(capsys, bad, base, 7, "output for step 0 after the output for step 0")


def test_prompt_stats_for_future_step(base, tmp_path, capsys):
    bad = _edit(base, tmp_path, lambda o: o[4].__setitem__("step", 3))
    _assert_rejected(capsys, bad, base, 5, "prompt_stats for step 3, which has not been scheduled")


@pytest.mark.parametrize("line,edit,field", [
    (3, lambda o: o[2]["new"][0]["block_ids"].__setitem__(0, 96), "new.block_ids"),
    (3, lambda o: o[2]["states"][0]["block_ids"].__setitem__(0, 500), "states.block_ids"),
    (8, lambda o: o[7]["running"][0]["new_block_ids"].__setitem__(0, 96), "running.new_block_ids"),
    (4, lambda o: o[3].__setitem__("connector", {"invalid_block_ids": [1000]}),
     "connector.invalid_block_ids"),
    # Another KV-cache group's ids: once never checked, so that replay reported a
    # divergence and export --format parquet died with ArrowInvalid (exit 3).
    (3, lambda o: o[2]["new"][0].__setitem__("more_groups", [[2 ** 40]]), "new.more_groups"),
    (3, lambda o: o[2]["states"][0].__setitem__("more_groups", [[1], [2 ** 40]]),
     "states.more_groups"),
    (8, lambda o: o[7]["running"][0].__setitem__("more_groups", [[96]]), "running.more_groups"),
])
def test_block_id_out_of_range(base, tmp_path, capsys, line, edit, field):
    bad = _edit(base, tmp_path, edit)
    _assert_rejected(capsys, bad, base, line, f"in '{field}' is out of range: the header's pool has "
                                              "ids 0..95 (num_blocks = 96)")
    if field.endswith("more_groups"):
        code, _, err = _run(capsys, "export", "--format", "parquet", bad, "-o", tmp_path / "tables")
        assert code == 2 and len(err.splitlines()) == 1 and f"{bad}:{line}: " in err, err


# --------------------------------------------------------------------------- size bounds


def test_line_without_end_is_refused(base, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTRACE_MAX_LINE_BYTES", str(1 << 20))
    bad = tmp_path / "long.jsonl"
    bad.write_bytes(base.read_bytes().splitlines(keepends=True)[0] + b"[" + b"1," * (1 << 20))
    _assert_rejected(capsys, bad, base, 2, "record longer than 1048576 bytes without a line break")


def test_total_size_bound(base, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTRACE_MAX_BYTES", "4096")
    bad = tmp_path / "big.jsonl.gz"
    bad.write_bytes(gzip.compress(base.read_bytes()))
    code, _, err = _run(capsys, "diff", bad, bad)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.match(rf"kvtrace: {re.escape(str(bad))}:\d+: more than 4096 bytes of trace data", err)


# --------------------------------------------------------------------------- compressed input


def _compress(kind: str, data: bytes) -> bytes:
    if kind == "gz":
        return gzip.compress(data)
    # Several frames, as a recorder that flushes writes them.
    c = zstandard.ZstdCompressor(level=3)
    return b"".join(c.compress(data[i:i + 2048]) for i in range(0, len(data), 2048))


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_truncated_compressed_replays_up_to_cut(base, tmp_path, capsys, kind):
    """Not an error: replay stops at the cut, says where, and exits 0 or 1."""
    raw = _compress(kind, base.read_bytes())
    cut = tmp_path / f"cut.jsonl.{kind}"
    cut.write_bytes(raw[: len(raw) * 2 // 3])
    for argv in (["replay", "--device", "cpu", cut], ["diff", cut, cut]):
        code, out, err = _run(capsys, *argv)
        assert code in (0, 1), err
        assert "Traceback" not in err
        assert re.search(r"(replayed|read) up to line \d+", out), out


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_compressed_cut_inside_header(base, tmp_path, capsys, kind):
    raw = _compress(kind, base.read_bytes())
    cut = tmp_path / f"head.jsonl.{kind}"
    cut.write_bytes(raw[:12])
    _assert_rejected(capsys, cut, base, 1)


def test_garbage_inside_gzip(base, tmp_path, capsys):
    lines = base.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "g.jsonl.gz"
    bad.write_bytes(gzip.compress(b"".join(lines[:3]) + bytes(range(256)) + b"\n" + b"".join(lines[3:])))
    _assert_rejected(capsys, bad, base, 4, "binary data")


@pytest.mark.parametrize("features,message", [
    ({"num_speculative_tokens": 2}, "speculative decoding (num_speculative_tokens=2) is on, and "
                                    "the trace does not say how many input slots drafting takes"),
    ({"num_speculative_tokens": 2, "num_draft_slots": 0, "dynamic_spec_decode": True},
     "dynamic speculative decoding (num_speculative_tokens=2) is on"),
    ({"num_kv_cache_groups": 2},
     "2 KV-cache groups, and the trace does not list their specs (kv_cache_groups)"),
    ({"pipeline_parallel_size": 2}, "pipeline parallelism is on"),
    ({"use_eagle": True}, "EAGLE or lookahead slots without speculative decoding (use_eagle=True"),
    ({"num_speculative_tokens": 2, "num_draft_slots": 0, "use_eagle": True},
     "speculative decoding (num_speculative_tokens=2) by EAGLE is on, and the trace does not say "
     "whether a prefix hit drops its last block (eagle_block_drop)"),
    ({"num_speculative_tokens": 2, "num_draft_slots": 0, "use_eagle": True, "eagle_block_drop": True},
     "speculative decoding (num_speculative_tokens=2) by EAGLE is on, and the trace does not say "
     "how far past a prefill chunk the drafter reads (num_prefill_lookahead_tokens)"),
    ({"num_speculative_tokens": 2, "num_draft_slots": 0, "use_eagle": True, "eagle_block_drop": True,
      "num_prefill_lookahead_tokens": 2},
     "speculative decoding (num_speculative_tokens=2) by multi-module MTP is on "
     "(num_prefill_lookahead_tokens=2)"),
    ({"multimodal": True}, "a multimodal model is on"),
    ({"kv_cache_group_kinds": ["SlidingWindowSpec"]},
     "a sliding-window KV-cache group, and the trace does not list its spec (kv_cache_groups)"),
    ({"kv_cache_group_kinds": ["MambaSpec", "FullAttentionSpec"]},
     "a state (MambaSpec) KV-cache group, and the trace does not list its spec (kv_cache_groups)"),
    ({"kv_cache_groups": [{"kind": "SlidingWindowSpec", "block_size": 16, "sliding_window": 64},
                          {"kind": "FullAttentionSpec", "block_size": 8}]},
     "KV-cache group 0 has block_size 16, not the trace's 8"),
    ({"kv_cache_groups": [{"kind": "SlidingWindowSpec", "block_size": 8}]},
     "KV-cache group 0 (SlidingWindowSpec) gives sliding_window=None"),
    ({"num_kv_cache_groups": 3, "kv_cache_groups": [{"kind": "FullAttentionSpec", "block_size": 8}]},
     "num_kv_cache_groups is 3 but kv_cache_groups lists 1"),
    ({"kv_cache_groups": [{"kind": "SlidingWindowSpec", "block_size": 8, "sliding_window": 64}],
      "num_speculative_tokens": 2, "num_draft_slots": 0, "use_eagle": True, "eagle_block_drop": True,
      "num_prefill_lookahead_tokens": 1},
     "EAGLE with a sliding-window KV-cache group"),
    ({"hash_block_size": 7}, "hash_block_size 7 differs from block_size"),
    ({"lora": True}, "LoRA is on (lora=True), and the trace does not say how many adapters a step "
                     "may run (max_loras)"),
    ({"prefill_schedule_interval": 4, "data_parallel_size": 2},
     "data-parallel prefill throttling is on (prefill_schedule_interval=4)"),
])
def test_unsupported_feature_is_refused_by_replay(base, tmp_path, capsys, features, message):
    bad = _edit(base, tmp_path, lambda o: o[0].__setitem__("features", features))
    code, _, err = _run(capsys, "replay", "--device", "cpu", bad)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{bad}:1: {message}" in err


# --------------------------------------------------------------------------- cut-off traces


def _real_trace_bytes() -> bytes:
    from pathlib import Path

    return gzip.decompress((REPO / "traces" / "prefix-sharing.jsonl.gz").read_bytes())


@pytest.mark.parametrize("kind", ["plain", "gz", "zst"])
def test_engine_killed_mid_write(tmp_path, capsys, kind):
    """A real trace cut at many points: replay never crashes, exits 0 (4 when
    the cut leaves no step), and says where the trace stops (or refuses a cut
    inside the header with exit 2)."""
    from kvtrace.replay import replay_file

    data = _real_trace_bytes()
    header_end = data.index(b"\n") + 1
    raw = data if kind == "plain" else _compress(kind, data)
    rng = random.Random(kind)
    cuts = sorted({rng.randrange(1, len(raw)) for _ in range(7)} | {len(raw) - 1})
    for cut in cuts:
        path = tmp_path / (f"cut-{cut}.jsonl" + ("" if kind == "plain" else f".{kind}"))
        path.write_bytes(raw[:cut])
        if kind == "plain" and cut < header_end:
            code, _, err = _run(capsys, "replay", "--device", "cpu", path)
            assert code == 2 and "Traceback" not in err
            continue
        try:
            result = replay_file(path, device="cpu")
        except Exception as e:    # only a cut inside the header may refuse
            assert type(e).__name__ == "TraceError" and ":1:" in str(e), e
            continue
        # A cut in the last bytes may leave every record intact (zstd does not
        # notice a frame that lost its last bytes): then the trace is complete.
        assert result.truncation or (result.end and result.end.status == "complete"), cut
        assert result.divergences == [], (cut, result.divergences[:2])
        code, out, err = _run(capsys, "replay", "--device", "cpu", path)
        assert code == (0 if result.steps else 4) and "Traceback" not in err   # 4: no step left
        if result.truncation:
            assert re.search(r"replayed up to line \d+|cut off", out), out


# --------------------------------------------------------------------------- safety


def _bomb_rss(tmp_path, payload: bytes, kind: str) -> tuple[int, str, int]:
    """Peak RSS (KiB) of `kvtrace diff BOMB BOMB` in a fresh interpreter, its stderr, exit code."""
    import subprocess
    import sys

    path = tmp_path / f"bomb.{kind}"
    # One compressed 16 MiB member (gzip) or frame (zstd), repeated: both formats
    # read concatenated members as one stream.
    member = (gzip.compress(payload[0], compresslevel=1) if kind == "gz"
              else zstandard.ZstdCompressor(level=1).compress(payload[0]))
    path.write_bytes(member * (len(payload) // (16 << 20)))
    # VmHWM, not getrusage: ru_maxrss survives exec, so a child forked from a big
    # test process would report the parent's peak.
    code = ("import re, sys\nfrom kvtrace import cli\n"
            "rc = cli.run(['diff', sys.argv[1], sys.argv[1]])\n"
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "sys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    return int(p.stdout.strip().splitlines()[-1]), p.stderr, p.returncode


class _Payload:
    """1 GiB, described by one 16 MiB block written 64 times."""

    def __init__(self, block: bytes):
        self.block = block

    def __len__(self):
        return 1 << 30

    def __getitem__(self, s):
        return self.block


@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("what", ["zeros", "repeated-line"])
def test_decompression_bomb(tmp_path, kind, what):
    """1 GiB of zeros (one endless line) or of one repeated valid-looking line:
    refused with exit 2 naming file:line, peak memory far below the bomb's size."""
    if what == "zeros":
        block = bytes(16 << 20)
        needle = "record longer than"
    else:
        line = b'{"kind":"abort","seq":1,"reqs":["x"]}\n'
        block = line * ((16 << 20) // len(line))
        needle = "missing header"     # refused at once: the stream is not read on
    rss_kib, err, rc = _bomb_rss(tmp_path, _Payload(block), kind)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert re.match(rf"kvtrace: \S*bomb\.{kind}:\d+: ", lines[0]) and needle in lines[0], lines[0]
    assert rss_kib < 400 * 1024, rss_kib


def test_bomb_of_blank_lines_hits_the_total_bound(tmp_path, monkeypatch):
    """Blank lines are skipped; a gigabyte of them is read in bulk and stops at KVTRACE_MAX_BYTES."""
    from kvtrace.trace import TraceError, TraceReader

    header = _real_trace_bytes().split(b"\n", 1)[0] + b"\n"
    path = tmp_path / "blank.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(header)
        for _ in range(16):
            f.write(b"\n" * (16 << 20))
    monkeypatch.setenv("KVTRACE_MAX_BYTES", str(128 << 20))
    with pytest.raises(TraceError, match=r"blank\.gz:\d+: more than 134217728 bytes"):
        list(TraceReader(path))


def test_read_path_has_no_pickle_or_eval():
    from pathlib import Path

    root = REPO / "kvtrace"
    banned = re.compile(r"\bpickle\b|\beval\(|\bexec\(|\bmarshal\b|\bshelve\b|yaml\.load\(|torch\.load\(")
    for sub in ("trace", "replay", "diff"):
        for f in sorted((root / sub).rglob("*.py")):
            for i, text in enumerate(f.read_text().splitlines(), 1):
                code = text.split("#", 1)[0]
                assert not banned.search(code), f"{f}:{i}: {text.strip()}"


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.jsonl.zst"])
def test_written_files_are_owner_only(tmp_path, name):
    import os
    import stat

    from kvtrace.redact import redact_file
    from kvtrace.trace import TraceWriter

    from tests.mini_traces import mini_header

    old = os.umask(0)            # even with a permissive umask
    try:
        (tmp_path / name).write_bytes(b"")   # and over a file that was readable by all
        (tmp_path / name).chmod(0o644)
        with TraceWriter(tmp_path / name, mini_header()):
            pass
        redact_file(tmp_path / name, tmp_path / ("r-" + name))
    finally:
        os.umask(old)
    for p in (tmp_path / name, tmp_path / ("r-" + name)):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


# --------------------------------------------------------------------------- nesting


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("argv", [
    ["replay", "--device", "cpu", "{bad}"], ["replay", "-"], ["diff", "{bad}", "{base}"],
    ["diff", "--match", "id", "-", "{base}"], ["show", "{bad}"], ["show", "-"],
    ["report", "{bad}", "-o", "{tmp}/r.html"], ["export", "{bad}", "-o", "{tmp}/e.json"],
    ["redact", "{bad}", "{tmp}/r.jsonl"],
], ids=["replay", "replay-stdin", "diff", "diff-stdin", "show", "show-stdin", "report", "export",
        "redact"])
@pytest.mark.parametrize("where", ["kv_transfer_params", "unknown-field", "header"])
def test_a_value_nested_a_thousand_levels_deep_is_one_line(base, tmp_path, argv, where):
    """Once `internal error: RecursionError`, exit 3, in every command: the
    decoder's recursion error was not caught."""
    import subprocess
    import sys

    lines = base.read_bytes().splitlines(keepends=True)
    at = 0 if where == "header" else 1
    key = b"kv_transfer_params" if where == "kv_transfer_params" else b"zz"
    lines[at] = lines[at].rstrip()[:-1] + b',"' + key + b'":{"a":' + _nested(1000) + b"}}\n"
    bad = tmp_path / "deep.jsonl"
    bad.write_bytes(b"".join(lines))
    args = [a.format(bad=bad, base=base, tmp=tmp_path) for a in argv]
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True,
                       stdin=bad.open("rb"), timeout=300)
    err = p.stderr.decode()
    assert p.returncode == 2 and len(err.splitlines()) == 1, err
    shown = "standard input" if "-" in args else str(bad)
    assert err.startswith(f"kvtrace: {shown}:{at + 1}: ") and "nested more than 32 levels deep" in err, err


@pytest.mark.parametrize("field", ["arrival", "request_finished"])
def test_a_free_form_value_nested_past_the_limit_is_named(base, tmp_path, capsys, field):
    """kv_transfer_params 40 levels deep: within what the decoder takes, past
    what the encoders of replay -o, redact and --json take."""
    obj = {"a": orjson.loads(_nested(40))}
    if field == "arrival":
        bad = _edit(base, tmp_path, lambda o: o[1].__setitem__("kv_transfer_params", obj))
    else:
        bad = _edit(base, tmp_path, lambda o: o.insert(3, {"kind": "request_finished", "seq": 1,
                                                           "req": o[1]["req"],
                                                           "kv_transfer_params": obj}))
    _assert_rejected(capsys, bad, base, 2 if field == "arrival" else 4,
                     "field 'kv_transfer_params' holds a value nested more than 32 levels deep")
    ok = _edit(base, tmp_path, lambda o: o[1].__setitem__("kv_transfer_params",
                                                          {"a": orjson.loads(_nested(30))}),
               name="ok.jsonl")
    with TraceReader(ok) as r:
        assert sum(1 for _ in r) > 10


# --------------------------------------------------------------------------- accepted, with a note


def test_an_unknown_profile_in_an_embedded_trace_is_replayed_with_a_note(base, tmp_path, capsys):
    """It was replayed under 0.32 with no word."""
    odd = _edit(base, tmp_path, lambda o: o[0]["features"].__setitem__("profile", "9.9"))
    code, out, err = _run(capsys, "replay", "--no-kv-check", odd)
    assert code == 0, err
    want = ("the trace names profile '9.9', which this kvtrace does not know (it knows legacy, "
            "0.19, 0.32, 0.33); replaying under the 0.32 profile")
    assert want in " ".join(out.split()), out
    code, out, err = _run(capsys, "replay", "--no-kv-check", "--json", odd)
    doc = orjson.loads(out)
    assert code == 0 and doc["profile"] == "0.32" and doc["profile_note"] == want, doc


def _copy_open(base, path, records: int):
    """A writer of ``path`` that has written the base trace's first records and
    is still writing: a recording under way."""
    from kvtrace.trace import TraceWriter
    from kvtrace.trace.events import decode, decode_header

    objs = _objs(base)
    w = TraceWriter(path, decode_header(objs[0]))
    for o in objs[1:records + 1]:
        w.write(decode({**o, "seq": w.next_seq()}))
    w.flush()
    return w


@pytest.mark.parametrize("name", ["live.jsonl", "live.jsonl.gz", "live.jsonl.zst"])
def test_a_trace_still_being_recorded_is_said_to_be(base, tmp_path, capsys, name):
    """show said nothing of a growing trace: it was taken as cut off."""
    path = tmp_path / name
    w = _copy_open(base, path, 20)
    try:
        for argv in (["show", path], ["replay", "--no-kv-check", path]):
            code, out, err = _run(capsys, *argv)
            text = " ".join(out.split())
            assert code == 0 and "a recorder is still writing the file" in text, (argv, text, err)
    finally:
        w.close()
    code, out, _ = _run(capsys, "show", path)
    assert code == 0 and "still writing" not in out and "truncated" not in out, out


def test_a_second_recording_into_one_file_is_refused(base, tmp_path, capsys):
    """Two `kvtrace record -o c.jsonl` at once both said `wrote c.jsonl` and
    left a corrupt file: the second is refused, and the first's file is left
    to it."""
    path = tmp_path / "c.jsonl"
    first = _copy_open(base, path, 20)
    try:
        code, out, err = _run(capsys, "record", "-o", path, "--workload", "shared-prefix")
        assert code == 2 and out == "", out
        assert err == (f"kvtrace: {path}: another process is writing this trace now (a second "
                       "recording into one file?); wait for it to end, or name another file\n")
    finally:
        first.close()
    with TraceReader(path) as r:   # the first recording's, whole
        assert sum(1 for _ in r) == 21 and r.end is not None and r.truncation is None
    code, out, err = _run(capsys, "record", "-o", path, "--workload", "shared-prefix")
    assert code == 0 and out == f"wrote {path}\n", err   # once the first is done


# --------------------------------------------------------------------------- lines the header cannot hold


def _one_long_arrival(base, tmp_path, n_bytes: int) -> "Path":
    """The base trace's header, then one legal-looking arrival whose prompt is
    ``n_bytes`` of `1000,`, zstd-compressed (a file of a few kilobytes)."""
    header = base.read_bytes().split(b"\n", 1)[0] + b"\n"
    head = b'{"kind":"arrival","seq":0,"req":"r","max_tokens":1,"prompt_token_ids":['
    path = tmp_path / "long-arrival.jsonl.zst"
    with zstandard.ZstdCompressor(level=3).stream_writer(path.open("wb")) as z:
        z.write(header + head)
        block = b"1000," * (1 << 18)
        for _ in range(n_bytes // len(block)):
            z.write(block)
        z.write(b"1]}\n")
    return path


def test_an_arrival_longer_than_the_header_allows_is_refused_before_it_is_built(base, tmp_path):
    """A 24 KB zstd file whose one arrival held 255 MB of `1000,` peaked at
    2.5 GB: the list was built, then found longer than max_model_len. Now the
    line is refused, naming it, once it passes what the header allows, in
    about 100 MB (the interpreter and kvtrace's imports take most of it)."""
    import subprocess
    import sys

    path = _one_long_arrival(base, tmp_path, 64 << 20)
    assert path.stat().st_size < 64 << 10
    code = ("import re, sys\nfrom kvtrace import cli\n"
            "rc = cli.run(['replay', '--no-kv-check', sys.argv[1]])\n"
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "sys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    mml = _objs(base)[0]["config"]["max_model_len"]
    assert lines[0].startswith(f"kvtrace: {path}:2: an arrival longer than ")
    assert "more than a record of its kind can hold under this trace's header" in lines[0]
    assert f"max_model_len {mml}" in lines[0], lines[0]
    peak_kib = int(p.stdout.strip().splitlines()[-1])
    assert peak_kib < 250 * 1024, peak_kib   # 9 bytes per byte of `1000,` once built: 600 MB


def test_a_step_longer_than_any_record_of_the_header_is_refused_as_it_is_read(base, tmp_path,
                                                                               capsys):
    """A record of no kind held to less (a step) is read only up to what any
    record of the header can hold."""
    from kvtrace.trace.limits import LineLimits
    from kvtrace.trace.events import decode_header

    limits = LineLimits(decode_header(_objs(base)[0]), 256 << 20)
    assert limits.general < 64 << 20
    objs = _objs(base)
    step = objs[2]
    step["preempted"] = ["x" * 1000] * (limits.general // 1000 + 1)
    bad = _edit(base, tmp_path, lambda o: o.__setitem__(2, step))
    _assert_rejected(capsys, bad, base, 3, f"record longer than {limits.general} bytes without a "
                                           "line break, more than any record of this trace's "
                                           "header can hold (max_model_len")


@pytest.mark.parametrize("where", ["states", "new", "running"])
def test_a_record_with_a_table_too_few_for_its_kv_cache_groups(tmp_path, capsys, where):
    """A record's ``more_groups`` holds one table for each KV-cache group past
    the first: a list one short (a group's table dropped) once read, and
    replay indexed past its end (exit 3)."""
    good = REPO / "traces/faults/state-chunk-off-boundary.jsonl.gz"
    objs = [orjson.loads(x) for x in gzip.decompress(good.read_bytes()).splitlines()]
    groups = len(objs[0]["features"]["kv_cache_groups"])
    line, field = next((i + 1, f"{where}.more_groups") for i, o in enumerate(objs)
                       if any(x.get("more_groups") for x in o.get(where) or ()))
    x = next(x for x in objs[line - 1][where] if x.get("more_groups"))
    assert len(x["more_groups"]) == groups - 1
    x["more_groups"] = x["more_groups"][:-1]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_dump(objs))
    _assert_rejected(capsys, bad, good, line, f"'{field}' holds {groups - 2} block tables: the "
                                              f"header's {groups} KV-cache groups give {groups - 1}")
    code, _, err = _run(capsys, "export", "--format", "parquet", bad, "-o", tmp_path / "tables")
    assert code == 2 and f"{bad}:{line}: " in err, err
