"""How one replay is run: whether the trace can be replayed at all, where the
shadow-KV check runs, which worker processes read the same file beside this
one, and the replayed trace ``-o`` writes. ``replay_file`` (replayer.py) asks
here, then feeds the events to a ``Replayer``.

Processes: with one worker (``worker=1``), the content check runs in it when
it is on (kv_content/worker.py), and the record checks when it is off
(workers/record_worker.py); with two, the record checks as well beside the
content check. None decides by the file's size and the machine's cores
(workers/policy.py). The result is the same either way.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterable

from kvtrace import baseline, bridge
from kvtrace._text import count, path_text
from kvtrace.writing import WrittenFile
from kvtrace.reference.profiles import PROFILES, Profile
from kvtrace.trace import TraceError, TraceReader, TraceWriter
from kvtrace.trace import events as ev
from kvtrace.workers import wanted

from .kv_content.device import pick_backend

# ShadowKV's tensors per KV slot (fingerprint, writer, step, position, loaded,
# first write), in bytes; kept here so that the main process need not import torch.
SHADOW_BYTES_PER_SLOT = 8 + 4 + 4 + 4 + 1 + 8


def check_fits(header: ev.Header, path, block_size: int) -> None:
    """The shadow-KV check holds a few tensors the size of the KV cache
    (``block_size`` slots a block): a header whose cache cannot fit in this
    machine's memory is refused at once, not after filling it."""
    cfg = header.config
    need = SHADOW_BYTES_PER_SLOT * (cfg.num_blocks + 1) * block_size
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > have // 2:
        raise TraceError(path, 1, "the shadow-KV check of this KV cache "
                                  f"({count(cfg.num_blocks, 'block')} of {count(block_size, 'slot')}) "
                                  f"needs {need / 2**30:.1f} GiB, more than half of this machine's "
                                  f"{have / 2**30:.1f} GiB: replay it with --no-kv-check")


def choose_profile(header: ev.Header, name: str | None) -> tuple[Profile, str | None]:
    """The version profile a replay follows: ``name`` (``--profile``), or the
    trace's own release's, with why when that release has none."""
    return bridge.header_profile(header) if name is None else (PROFILES[name], None)


def check_supported(header: ev.Header, path, profile: Profile) -> None:
    why = baseline.refusal(header.features, header.config.block_size,
                           "the reference models the baseline profile only (full-attention, "
                           "sliding-window and state KV-cache groups, no pipeline parallelism)",
                           header.config.enable_prefix_caching)
    if why is None:
        why = _profile_refusal(header, profile)
    if why is not None:
        raise TraceError(path, 1, why)


def _profile_refusal(header: ev.Header, profile: Profile) -> str | None:
    """Why the trace cannot be replayed under ``profile``, or None: what the
    reference refuses under it (``baseline.REFUSED``), and block hashes that
    cannot be reproduced. vLLM 0.33 hashes each EAGLE block with the token
    after it, by default, where prefix caching is on and no connector is
    (config/vllm.py:678-692); a 0.33 trace must say whether it did
    (``num_hash_lookahead_tokens``, written by this kvtrace's recorder)."""
    f = header.features
    why = baseline.profile_refusal(f, header.config.block_size, profile)
    if why is not None:
        return why
    if (f.num_hash_lookahead_tokens is None and profile.name == "0.33" and f.use_eagle
            and header.config.enable_prefix_caching and header.config.connector is None):
        return ("this vLLM 0.33 trace of EAGLE with prefix caching does not say whether its "
                "block hashes cover the token after each block (num_hash_lookahead_tokens): "
                "record it again with this kvtrace")
    return None


@dataclass(frozen=True)
class Plan:
    """Where a replay's work runs."""

    device: str | None        # the content check's backend; None: it does not run
    unchecked: str | None     # why a content check asked for does not run here
    workers: int              # worker processes that read the same file

    @property
    def content_worker(self) -> bool:
        """The content check runs in a worker."""
        return bool(self.device) and self.workers >= 1

    @property
    def record_worker(self) -> bool:
        """A worker checks every record (and this process need not)."""
        return self.workers >= (2 if self.device else 1)

    @property
    def gate(self) -> bool:
        """The content check's worker takes the checks across records over once
        it has caught up with this process (no record worker does them)."""
        return self.content_worker and self.workers < 2

    def events(self, reader: TraceReader, rp) -> tuple[Iterable[ev.Event], object | None]:
        """The events this process feeds ``rp`` (a Replayer), and the record
        worker that checks them elsewhere, if any."""
        if self.record_worker:
            from kvtrace.workers.record_worker import RecordWorker   # a module the worker runs as __main__

            worker = RecordWorker(reader.path, reader.share())
            return reader.checked_elsewhere(worker), worker
        if self.content_worker:
            return reader.checked_elsewhere(rp.content), None
        return reader, None

    def no_autograd(self):
        """The content check in this process on torch runs many small ops per
        step; inference mode skips autograd's bookkeeping on each of them
        (about a fifth of the check's time on CPU)."""
        if not self.device or self.content_worker or self.device == "numpy":
            return contextlib.nullcontext()
        import torch
        if self.device == "cpu":   # torch on the CPU: many small ops, threads only add overhead
            torch.set_num_threads(1)
        return torch.inference_mode()


def plan(reader: TraceReader, path: str | os.PathLike, device: str | None,
         worker: bool | int | None) -> Plan:
    """Where the replay of ``reader``'s trace (the file ``path``) runs: the content check on
    ``device`` ("auto", "cpu", "cuda", a backend's name; None: off) unless the
    model is one it does not cover, in ``worker`` processes (None: decided by
    the file's size and the machine's cores)."""
    from .kv_content.check import shadow_block_size, unchecked as content_unchecked

    header = reader.header
    unchecked = content_unchecked(header) if device else None
    if unchecked is not None:
        device = None
    if device:
        slots = shadow_block_size(header.config, header.features.kv_cache_groups)
        check_fits(header, path, slots)
        device = pick_backend(device, path, header.config.num_blocks, slots)
    if not reader.shareable:
        workers = 0
    else:
        workers = wanted(path, content=bool(device)) if worker is None else int(worker)
    return Plan(device, unchecked, workers)


class ReplayedTrace:
    """The trace ``replay -o`` writes: the recorded header under the reference's
    name, put in place when replay ends, whole or cut; a trace found unusable
    leaves the file that was there as it was."""

    def __init__(self, out: str | os.PathLike, header: ev.Header, path: str | os.PathLike):
        from kvtrace import __version__

        replayed = ev.Header(engine="kvtrace-reference", engine_version=__version__,
                             config=header.config, counters=header.counters,
                             features=header.features,
                             meta={"replayed_from": path_text(path), "recorded_engine": header.engine,
                                   "recorded_engine_version": header.engine_version})
        self.dest = WrittenFile(out, trace=True)
        try:
            self.writer = TraceWriter(out, replayed, fd=self.dest.take_fd())
        except BaseException:
            self.dest.discard()
            raise

    def close(self, failed: BaseException | None, rp, truncation: str | None) -> None:
        """End the file: ``failed``, the exception replay stopped on (None: it
        went to the end); ``rp`` the Replayer (None: it never started)."""
        why = None
        if failed is not None:
            why = f"replay stopped: {failed}" if str(failed) else f"replay stopped: {type(failed).__name__}"
        stop = rp.stop.words(rp.steps, rp.steps_in_trace) if rp is not None and rp.stop else None
        error = why or stop or truncation
        try:
            self.writer.close(status="interrupted" if error else "complete", error=error)
        except BaseException as e:   # the output could not be finished: never put in place
            self.dest.discard()
            raise (self.dest.named(e) if isinstance(e, OSError) else e) from e
        if isinstance(failed, TraceError):   # the file that was there stays as it was
            self.dest.discard()
        else:   # whole, or a replay that stopped and says where in its end record
            self.dest.commit()
