"""The recorder changes nothing that the engine or a caller of the scheduler
observes: the connector the scheduler holds is the very object it would hold
unrecorded (identity, attributes, its class's methods, a mock's call counts,
the values it returns and the exceptions it raises), wherever it was put in:
built from ``kv_transfer_config``, assigned after the scheduler was built,
replaced between steps. The recorder sees the connector's answers at the
scheduler's own call sites: tests/unit/record/vllm/test_call_sites.py."""

from __future__ import annotations

from unittest import mock

import pytest

from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

# --------------------------------------------------------------------------- vLLM 0.32


def _vllm():
    from tests._require import require

    return require("vllm", "vLLM is not installed: these tests build vLLM 0.32's own Scheduler")


BLOCK = 16


class Harness:
    """vLLM's own Scheduler, built without an engine, recorded or not, and
    driven step by step: each step samples one token for each request that
    computed its last token."""

    def __init__(self, tmp_path, recorded: bool, rules: list | None = None):
        from vllm.config import KVTransferConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtrace.record.vllm.hooks import make_recording_scheduler
        from kvtrace.lab.random_workloads import SCRIPTED
        from kvtrace.rerun.build import build_kv_cache_config, build_vllm_config

        header = ev.Header(engine="vllm", engine_version="0.32.0", config=ev.SchedulerConfig(
            block_size=BLOCK, num_blocks=64, max_num_batched_tokens=256, max_num_seqs=8,
            max_model_len=256,
            connector=None if rules is None else ev.ConnectorConfig("ScriptedConnector")))
        vc = build_vllm_config(header)
        if rules is not None:
            vc.kv_transfer_config = KVTransferConfig(
                kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED,
                kv_role="kv_consumer", kv_connector_extra_config={"rules": rules})
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.path = tmp_path / f"{'recorded' if recorded else 'plain'}.jsonl"
        cls = make_recording_scheduler(Scheduler) if recorded else Scheduler
        with pytest.MonkeyPatch.context() as mp:
            if recorded:
                mp.setenv("KVTRACE_OUT", str(self.path))
            else:
                mp.delenv("KVTRACE_OUT", raising=False)
            self.sched = cls(vllm_config=vc, kv_cache_config=build_kv_cache_config(64, BLOCK),
                             structured_output_manager=StructuredOutputManager(vc),
                             block_size=BLOCK, hash_block_size=BLOCK, log_stats=True)
        assert (getattr(self.sched, "_kvtrace", None) is not None) == recorded

    def arrive(self, rid: str, prompt: list[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=3), None,
                                       block_hasher=self.hasher))

    def step(self) -> dict:
        from vllm.v1.outputs import ModelRunnerOutput

        s = self.sched
        so = s.schedule()
        rids = list(so.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
                   for r in rids]
        s.update_from_output(so, ModelRunnerOutput(
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        return dict(so.num_scheduled_tokens)

    def lookups(self) -> list[tuple]:
        """(step, req, local, ext) of each lookup the trace recorded."""
        self.sched.shutdown()
        return [(e.step, lk.req, lk.local, lk.ext) for e in TraceReader(self.path)
                if isinstance(e, (ev.Step, ev.StepFailed)) for lk in e.lookups]


def _mock_connector(hit: int):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata)

    m = mock.MagicMock(spec=KVConnectorBase_V1)
    m.supports_divergent_local_hybrid_hits = False
    m.get_num_new_matched_tokens.return_value = (hit, False)
    m.request_finished.return_value = (False, None)
    m.build_connector_meta.return_value = KVConnectorMetadata()
    m.has_pending_block_frees.return_value = False
    m.get_external_cache_hit_sources.return_value = None
    return m


def _prompt(i: int, n: int = 50) -> list[int]:
    return [(31 * i + 7 * j) % 400 + 16 for j in range(n)]


def _calls(m) -> list[tuple]:
    return [(c.args[0].request_id, c.args[1]) for c in m.get_num_new_matched_tokens.call_args_list]


@pytest.mark.vllm
def test_a_mock_connector_assigned_after_construction_sees_what_it_sees_unrecorded(tmp_path):
    _vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    runs = {}
    for recorded in (False, True):
        h = Harness(tmp_path, recorded, rules=[])
        m = _mock_connector(16)
        child = m.get_num_new_matched_tokens
        h.sched.connector = m
        h.arrive("a", _prompt(0))
        h.arrive("b", _prompt(1))
        steps = [h.step() for _ in range(5)]
        c = h.sched.connector
        assert c is m and isinstance(c, KVConnectorBase_V1) and type(c) is type(m)
        assert c.get_num_new_matched_tokens is child
        m.get_num_new_matched_tokens.assert_called_with(mock.ANY, 0)
        assert m.update_state_after_alloc.call_count == 2
        runs[recorded] = (steps, _calls(m), m.get_num_new_matched_tokens.call_count,
                          sorted(vars(m)), h)
    assert runs[True][:4] == runs[False][:4]
    assert runs[True][2] == 2 and runs[True][1] == [("a", 0), ("b", 0)]
    assert runs[True][4].lookups() == [(0, "a", 0, 16), (0, "b", 0, 16)]


@pytest.mark.vllm
def test_the_connector_built_from_kv_transfer_config_is_left_as_vllm_built_it(tmp_path):
    _vllm()
    from kvtrace.lab.scripted_connector import ScriptedConnector

    seen = {}
    for recorded in (False, True):
        h = Harness(tmp_path, recorded, rules=[{"req": "a", "hit": 32}])
        conn = h.sched.connector
        h.arrive("a", _prompt(0))
        steps = [h.step() for _ in range(4)]
        assert h.sched.connector is conn and type(conn) is ScriptedConnector
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc"):
            assert name not in vars(conn)
            assert getattr(conn, name).__func__ is getattr(ScriptedConnector, name)
        assert "accept_tokens" not in vars(h.sched.structured_output_manager)
        seen[recorded] = (steps, sorted(vars(conn)), h)
    assert seen[True][:2] == seen[False][:2]
    assert seen[True][2].lookups() == [(0, "a", 0, 32)]


@pytest.mark.vllm
def test_a_connector_replaced_between_steps_is_recorded_from_its_first_answer(tmp_path):
    _vllm()
    h = Harness(tmp_path, True, rules=[{"req": "a", "hit": 32}, {"req": "b", "hit": 32}])
    first = h.sched.connector
    h.arrive("a", _prompt(0))
    h.step()
    m = _mock_connector(16)
    h.sched.connector = m
    h.arrive("b", _prompt(1))
    h.step()
    h.sched.connector = first   # and back
    h.arrive("c", _prompt(2))
    h.step()
    assert _calls(m) == [("b", 0)]
    assert h.lookups() == [(0, "a", 0, 32), (1, "b", 0, 16), (2, "c", 0, 0)]


@pytest.mark.vllm
def test_a_connector_on_a_scheduler_built_without_one_is_recorded(tmp_path):
    _vllm()
    h = Harness(tmp_path, True)
    assert h.sched.connector is None
    m = _mock_connector(16)
    h.sched.connector = m
    h.arrive("a", _prompt(0))
    h.step()
    assert h.sched.connector is m and _calls(m) == [("a", 0)]
    assert h.lookups() == [(0, "a", 0, 16)]


@pytest.mark.vllm
def test_a_connector_that_raises_raises_the_same_exception_recorded_or_not(tmp_path):
    _vllm()
    for recorded in (False, True):
        h = Harness(tmp_path, recorded, rules=[])
        m = _mock_connector(16)
        down = ConnectionError("the KV store is down")
        m.get_num_new_matched_tokens.side_effect = [(16, False), down]
        h.sched.connector = m
        h.arrive("a", _prompt(0))
        h.arrive("b", _prompt(1))
        with pytest.raises(ConnectionError) as raised:
            h.step()
        assert raised.value is down and m.get_num_new_matched_tokens.call_count == 2
        assert h.sched.connector is m
    h.sched.shutdown()
    [f] = [e for e in TraceReader(h.path) if isinstance(e, ev.StepFailed)]
    assert f.error == "ConnectionError: the KV store is down" and "mock" in f.where
    assert [(lk.req, lk.ext) for lk in f.lookups] == [("a", 16)]
