"""Prefill/decode disaggregation and the scheduler calls the recorder writes.

traces/disagg/ holds the two sides of a disaggregated deployment, vLLM 0.32's
engines with NixlConnector, run with no model (traces/README.md): the prefill
side's connector keeps each finished request's blocks until the decode side
has read them (``request_finished`` answered delay_free), and the decode side
pulls them. traces/dp-throttle and traces/finish-stopped are real engines fed
``schedule(throttle_prefills=True)`` and ``finish_requests(ids,
FINISHED_STOPPED)``. Each of these replays clean; the copies without the
recorded input (what a recorder that left it out wrote) do not, which is what
the input is for. None of this needs vLLM: test_vllm_handoff.py records the
same live and runs vLLM's own scheduler on them.
"""

from __future__ import annotations

import copy
import gzip
from pathlib import Path

import orjson
import pytest

from kvtrace.baseline import outside
from kvtrace.diff import diff_files
from kvtrace.redact import redact_file
from kvtrace.replay import replay_file

from tests._paths import REPO

TRACES = REPO / "traces"
PREFILL = TRACES / "disagg" / "prefill.jsonl.gz"
DECODE = TRACES / "disagg" / "decode.jsonl.gz"
FREE_BEFORE_SEND = TRACES / "faults" / "free-before-send.jsonl.gz"


def records(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in gzip.decompress(path.read_bytes()).splitlines()]


def write(objs: list[dict], dst: Path) -> Path:
    dst.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    return dst


def changed(src: Path, dst: Path, change) -> Path:
    objs = records(src)
    change(objs)
    return write(objs, dst)


def first(path: Path):
    divs = replay_file(path, device="cpu", worker=0).divergences
    return divs[0] if divs else None


# --------------------------------------------------------------------------- delayed frees


@pytest.mark.parametrize("path", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_both_sides_replay_clean_with_the_shadow_kv_check(path):
    res = replay_file(path, device="cpu", worker=0)
    assert res.divergences == []
    assert res.steps > 10


def test_the_prefill_side_records_each_delayed_free_and_replay_needs_it(tmp_path):
    objs = records(PREFILL)
    answers = [o for o in objs if o.get("kind") == "request_finished"]
    finished = {r for o in objs if o.get("kind") == "output" for r, why in o["finished"].items()
                if why == "length"}
    # Every request that ran to its length handed its blocks over; the two
    # aborted ones did not (NixlConnector keeps nothing for them).
    assert {a["req"] for a in answers} == finished and len(finished) == 8
    assert all(a["delay_free"] and a["kv_transfer_params"]["do_remote_prefill"] for a in answers)
    sent = {r for o in objs if o.get("kind") == "output" for r in o["connector"]["finished_sending"]}
    assert sent == finished   # the engine stepped on until every send finished

    # Without the answers, replay frees the blocks at the first finish.
    bare = write([o for o in objs if o.get("kind") != "request_finished"], tmp_path / "bare.jsonl")
    d = first(bare)
    first_finish = next(o for o in objs if o.get("kind") == "output" and o["finished"])
    assert (d.step, d.field) == (first_finish["step"], "state.block_ids")
    assert d.req == next(iter(first_finish["finished"])) and d.expected == []


def test_freeing_a_prefill_before_the_send_finishes_is_flagged_at_its_step_and_request():
    objs = records(FREE_BEFORE_SEND)
    answer = next(o for o in objs if o.get("kind") == "request_finished")
    finish = next(o for o in objs if o.get("kind") == "output" and answer["req"] in o["finished"])
    d = first(FREE_BEFORE_SEND)
    assert (d.step, d.req, d.field) == (finish["step"], answer["req"], "state.block_ids")
    assert d.recorded == [] and d.expected == answer["kv_transfer_params"]["remote_block_ids"][0]
    assert "delay_free" in d.rule and "finished_sending" in d.rule


# --------------------------------------------------------------------------- the handoff diff


def test_the_two_sides_line_up_request_by_request_in_either_order():
    for a, b, side in ((PREFILL, DECODE, "a"), (DECODE, PREFILL, "b")):
        res = diff_files(a, b)
        assert res.matched_by == "handoff" and res.prefill_side == side
        assert res.divergences == [] and res.only_a == [] and res.only_b == []
        assert res.requests_compared == 8


def _decode_arrival(objs: list[dict], k: int = 0) -> dict:
    return [o for o in objs if o.get("kind") == "arrival"][k]


def test_a_decode_request_sent_another_prompt_is_named(tmp_path):
    def change(objs):
        a = _decode_arrival(objs, 3)
        a["prompt_token_ids"][40] += 1

    bad = changed(DECODE, tmp_path / "d.jsonl", change)
    res = diff_files(PREFILL, bad)
    assert [(d.req, d.field) for d in res.divergences] == [
        (_decode_arrival(records(DECODE), 3)["req"], "prompt_token_ids")]
    assert "positions 0-63" in res.divergences[0].recorded


def test_a_decode_request_reading_other_blocks_is_named(tmp_path):
    def change(objs):
        _decode_arrival(objs, 1)["kv_transfer_params"]["remote_block_ids"] = [[7, 8, 9]]

    res = diff_files(PREFILL, changed(DECODE, tmp_path / "d.jsonl", change))
    (d,) = res.divergences
    assert (d.req, d.field, d.recorded) == (_decode_arrival(records(DECODE), 1)["req"],
                                             "remote_block_ids", [[7, 8, 9]])


def test_a_prefill_that_hands_over_blocks_it_does_not_hold_is_named(tmp_path):
    def change(objs):
        rf = next(o for o in objs if o.get("kind") == "request_finished")
        rf["kv_transfer_params"]["remote_block_ids"] = [[14, 15]]
    dec = records(DECODE)

    def change_decode(objs):
        _decode_arrival(objs, 0)["kv_transfer_params"]["remote_block_ids"] = [[14, 15]]

    res = diff_files(changed(PREFILL, tmp_path / "p.jsonl", change),
                     changed(DECODE, tmp_path / "d.jsonl", change_decode))
    (d,) = res.divergences
    assert (d.req, d.field) == (_decode_arrival(dec, 0)["req"], "remote_block_ids")
    assert "block table" in d.rule


def test_a_decode_that_loads_more_than_was_computed_is_named(tmp_path):
    target = _decode_arrival(records(DECODE), 2)["req"]

    def change(objs):
        step = next(o for o in objs if o.get("kind") == "step"
                    and any(lk["req"] == target and lk["ext"] for lk in o["lookups"]))
        for lk in step["lookups"]:
            if lk["req"] == target:
                lk["ext"] += 64

    (d,) = diff_files(PREFILL, changed(DECODE, tmp_path / "d.jsonl", change)).divergences
    assert (d.req, d.field) == (target, "num_loaded_tokens") and d.step is not None


def test_a_send_the_prefill_side_never_reports_is_named(tmp_path):
    objs = records(PREFILL)
    last_sent = [r for o in objs if o.get("kind") == "output"
                 for r in o["connector"]["finished_sending"]][-1]

    def change(objs):
        for o in objs:
            if o.get("kind") == "output":
                o["connector"]["finished_sending"] = [r for r in o["connector"]["finished_sending"]
                                                      if r != last_sent]

    res = diff_files(changed(PREFILL, tmp_path / "p.jsonl", change), DECODE)
    (d,) = res.divergences
    reader = next(a for a in records(DECODE) if a.get("kind") == "arrival"
                  and a["kv_transfer_params"]["remote_request_id"] == last_sent)
    assert (d.req, d.field) == (reader["req"], "finished_sending")
    assert d.recorded.startswith("not by the prefill side's last step")


def test_requests_on_one_side_only_are_listed(tmp_path):
    def change(objs):
        _decode_arrival(objs, 0)["kv_transfer_params"]["remote_request_id"] = "nobody"

    res = diff_files(PREFILL, changed(DECODE, tmp_path / "d.jsonl", change))
    dec0 = _decode_arrival(records(DECODE), 0)
    assert res.only_b == [dec0["req"]]
    assert res.only_a == [dec0["kv_transfer_params"]["remote_request_id"]]
    assert res.requests_compared == 7


def test_two_runs_of_one_side_are_still_diffed_request_by_request():
    res = diff_files(PREFILL, PREFILL)
    assert res.matched_by == "id" and res.divergences == [] and res.requests_compared == 10


def test_redacted_sides_still_line_up_and_lose_hosts_and_ports(tmp_path):
    key = b"k" * 32
    p, d = tmp_path / "p.jsonl.gz", tmp_path / "d.jsonl.gz"
    redact_file(PREFILL, p, key=key)
    redact_file(DECODE, d, key=key)
    res = diff_files(p, d)
    assert res.requests_compared == 8 and res.divergences == []
    params = [o.get("kv_transfer_params") for o in records(p) + records(d)]
    kept = [x for x in params if x]
    assert kept and not any({"remote_host", "remote_port", "remote_engine_id"} & set(x) for x in kept)
    assert replay_file(p, device="cpu", worker=0).divergences == []


# --------------------------------------------------------------------------- the other inputs


def test_prefill_throttling_is_recorded_and_replay_needs_it(tmp_path):
    path = TRACES / "dp-throttle.jsonl.gz"
    objs = records(path)
    throttled = [o["step"] for o in objs if o.get("kind") == "step" and o.get("throttle_prefills")]
    assert len(throttled) >= 10 and objs[0]["features"]["throttle_prefills_recorded"] is True
    assert first(path) is None

    bare = changed(path, tmp_path / "bare.jsonl",
                   lambda objs: [o.pop("throttle_prefills", None) for o in objs])
    d = first(bare)
    assert d.step in throttled and d.field == "scheduled" and d.recorded is None


def test_a_finish_with_a_status_of_its_own_is_recorded_and_replay_needs_it(tmp_path):
    path = TRACES / "finish-stopped.jsonl.gz"
    objs = records(path)
    (stop,) = [o for o in objs if o.get("kind") == "abort"]
    assert stop["status"] == "FINISHED_STOPPED" and len(stop["reqs"]) == 3
    assert first(path) is None

    bare = write([o for o in objs if o is not stop], tmp_path / "bare.jsonl")
    divs = replay_file(bare, device="cpu", worker=0).divergences
    next_step = objs[objs.index(stop) + 1]["step"]
    assert divs[0].step == next_step
    # The stopped requests that were running run on in the reference; the one
    # that was waiting is not freed, and the engine's finished_req_ids name it.
    running = {s["req"] for s in objs[objs.index(stop) - 1]["states"] if s["status"] == "RUNNING"}
    ran_on = {d.req for d in divs if d.step == next_step and d.field == "scheduled"
              and d.recorded is None}
    assert ran_on == set(stop["reqs"]) & running and len(ran_on) == 2
    assert {d.req for d in divs if d.field == "finished_req_ids"
            and d.step == next_step} == set(stop["reqs"])


def test_a_trace_that_does_not_record_throttling_is_refused_under_data_parallelism():
    on = {"prefill_schedule_interval": 3, "data_parallel_size": 2}
    assert "does not record which steps throttled" in outside(on, 32)
    assert outside(dict(on, throttle_prefills_recorded=True), 32) is None


def test_a_diffusion_model_is_refused_as_one_not_as_speculative_decoding():
    why = outside({"diffusion": True, "num_speculative_tokens": 16}, 32)
    assert "diffusion" in why and "specul" not in why


def test_a_request_finished_answer_without_params_is_valid(tmp_path):
    # A request_finished record with no transfer parameters is valid.
    objs = records(PREFILL)
    rf = next(o for o in objs if o.get("kind") == "request_finished")
    rf2 = copy.deepcopy(rf)
    del rf2["kv_transfer_params"]
    objs[objs.index(rf)] = rf2
    assert first(write(objs, tmp_path / "p.jsonl")) is None


# --------------------------------------------------------------------------- a handoff diff of nothing


def _diff(capsys, *argv) -> tuple[int, str, str]:
    from kvtrace import cli

    code = cli.run(["diff", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


CONNECTOR = TRACES / "connector.jsonl.gz"           # a KV consumer's, with no handoff
PLAIN = TRACES / "preemption.jsonl.gz"               # no KV connector
BOTH = TRACES / "data-path" / "example-connector.jsonl.gz"   # kv_both


@pytest.mark.parametrize("a,b,why", [
    (PREFILL, PREFILL, "are the same trace"),
    (PREFILL, PLAIN, f"{PREFILL} is a KV producer's and {PLAIN} has no KV connector"),
    (DECODE, CONNECTOR, f"{DECODE} is a KV consumer's and {CONNECTOR} is a KV consumer's"),
    (PLAIN, PLAIN, "are the same trace"),
], ids=["itself", "no-connector", "two-consumers", "plain-itself"])
def test_a_handoff_diff_of_traces_that_cannot_pair_is_refused(capsys, a, b, why):
    """These printed "0 handoffs compared" and exited 0."""
    code, out, err = _diff(capsys, "--match", "handoff", a, b)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert why in err and "--match handoff pairs a" in err, err


def test_a_handoff_diff_that_compares_nothing_is_not_a_pass(tmp_path, capsys):
    """A producer's and a consumer's trace whose requests name none of the
    other's: nothing compared, exit 4, as replay of a trace with no step; so
    is a kv_both trace diffed with a copy of itself."""
    code, out, err = _diff(capsys, "--match", "handoff", PREFILL, CONNECTOR)
    assert code == 4 and "0 handoffs compared" in " ".join(out.split()), out
    assert err.startswith("kvtrace: nothing compared: no handoffs of ") and len(err.splitlines()) == 1
    copy_ = tmp_path / "copy.jsonl.gz"
    copy_.write_bytes(BOTH.read_bytes())
    code, out, err = _diff(capsys, "--match", "handoff", BOTH, copy_)
    assert code == 4 and "nothing compared" in err, (code, err)
    code, out, err = _diff(capsys, "--match", "handoff", "--json", PREFILL, CONNECTOR)
    assert code == 4 and orjson.loads(out)["summary"]["requests_compared"] == 0
    code, _, err = _diff(capsys, PREFILL, DECODE)   # the pair itself still passes
    assert code == 0 and err == "", err
