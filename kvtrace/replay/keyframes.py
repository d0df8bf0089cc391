"""Keyframes: a replay's whole state at a step, written into a trace, and a
replay that starts from one.

A keyframe is what replaying the records before it left: the reference
scheduler (requests, queues, the block pool as columns) and the checks' own
bookkeeping (steps in flight, the connector's answers, preemption counts,
the liveness watch). It is taken before a ``step`` record, and a replay that
restores it and reads on from there finds exactly what a replay from the
start finds from that step on (tests/unit/replay/test_keyframes.py holds
every stored trace to it; ``python -m bench.keyframes`` random ones).

What a keyframe leaves out: the divergences found before it (a replay from it
reports from its step on), and the shadow-KV content check, whose state is the
cache's contents: a replay from a keyframe does not check KV contents, and
says so.

``Keyframer`` makes them as records are written: it replays each record it is
shown (no content check) and gives a keyframe before every ``every``-th step.
Its replay is the reference's, so a keyframe holds what the engine should
have had; a segment replayed from it reports what a replay of the whole run
would.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from typing import Iterator

import msgspec

import kvtrace
from kvtrace import bridge, snapshot
from kvtrace.reference.block_pool import BlockPool
from kvtrace.reference.profiles import Profile
from kvtrace.results import ReplayResult
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace import events as ev
from kvtrace.trace.validate import Validator

from .plan import ReplayedTrace, check_supported, choose_profile
from .replayer import PROGRESS_EVERY, Replayer

NO_CONTENT = "a replay from a keyframe does not check KV contents"

FORMAT = 2   # the keyframe format this kvtrace writes and reads (2: the connector cache stats)

# Fields of a Replayer a keyframe leaves out; ``restore`` gives them back.
_LEFT_OUT = {Replayer: frozenset({"divergences", "content", "out", "path", "_kv_placed"})}


class KeyframeError(ValueError):
    """A keyframe this kvtrace cannot start from (message names why)."""


def take(rp: Replayer) -> dict:
    """``rp``'s state as a keyframe's ``state``, with the version profile it
    follows (a replay from it follows the same)."""
    state = snapshot.encode(rp, _externals(rp.header, rp.sched.config), _LEFT_OUT,
                            {"pool": (rp.sched.kv.pool, _pack_pool)})
    state["profile"] = rp.sched.config.profile.name
    return state


def restore(kf: ev.Keyframe, header: ev.Header, path: str, profile: Profile | None,
            out=None) -> Replayer:
    """A Replayer in the state ``kf`` holds, for the trace ``path`` with
    ``header``, that writes to ``out`` (a TraceWriter or None). No content check."""
    if kf.format != FORMAT:
        raise KeyframeError(f"a keyframe of format {kf.format} (kvtrace {kf.version}); this "
                            f"kvtrace reads format {FORMAT}")
    if "root" not in kf.state and "stopped" in kf.state:
        raise KeyframeError(f"the keyframe at step {kf.step} holds no replay state: the "
                            f"replay that made it had stopped ({kf.state['stopped']})")
    made_by = kf.state.get("profile")
    if profile is not None and made_by != profile.name:
        raise KeyframeError(f"the keyframe at step {kf.step} was made under the {made_by} "
                            f"profile, not {profile.name}: replay it under {made_by}, or "
                            "from the start")
    config = bridge.config_from_header(header, profile)

    def unpack(columns: dict) -> tuple[BlockPool, list]:
        if columns.get("num_blocks") != config.num_blocks:   # before a pool is built
            raise snapshot.SnapshotError(f"its pool has {str(columns.get('num_blocks'))[:20]} "
                                         f"blocks, the header's {config.num_blocks}")
        return _unpack_pool(columns)

    try:
        rp = snapshot.decode(kf.state, _externals(header, config), {"pool": unpack})
        _check(rp, kf)
    except snapshot.SnapshotError as e:
        raise KeyframeError(f"the keyframe at step {kf.step} (kvtrace {kf.version}) "
                            f"cannot be read: {e}") from None
    rp.divergences, rp.content, rp.out, rp.path, rp._kv_placed = [], None, out, path, 0
    rp.data_path.checked = Counter()   # what this replay checks, from the keyframe on
    return rp


def _check(rp: object, kf: ev.Keyframe) -> None:
    """What a replay from ``rp`` relies on: a replay that had not stopped, at
    the keyframe's step, over a pool whose free queue holds exactly its free
    blocks. Raises SnapshotError (a keyframe edited or damaged)."""
    if type(rp) is not Replayer:
        raise snapshot.SnapshotError("it holds no replay")
    if rp.stopped is not None or rp.stop is not None:
        raise snapshot.SnapshotError("it holds a replay that had stopped")
    if not (type(rp.steps) is int and type(rp.steps_in_trace) is int
            and 0 <= rp.steps <= kf.step and rp.steps_in_trace <= kf.step):
        raise snapshot.SnapshotError(f"it holds a replay at step {str(rp.steps)[:20]}, not "
                                     f"before step {kf.step}")
    pool = getattr(getattr(rp.sched, "kv", None), "pool", None)
    if not isinstance(pool, BlockPool):
        raise snapshot.SnapshotError("it holds no block pool")
    null = pool.null_block   # its count is never read (it is never free)
    if any(type(b.ref_cnt) is not int or (b.ref_cnt < 0 and b is not null) for b in pool.blocks):
        raise snapshot.SnapshotError("a block's reference count is not a count")
    free = pool.free_queue.ids()
    expected = {b.block_id for b in pool.blocks if b.ref_cnt == 0} - {null.block_id}
    if len(free) != len(set(free)) or set(free) != expected:
        raise snapshot.SnapshotError("its free queue does not hold exactly the free blocks")


class Keyframer:
    """Replays records as they are written, and gives a keyframe before every
    ``every``-th step. Once the replay has stopped at an engine error it gives
    none, but where one is forced (a segment's start): then one that a
    reader can start at and no replay can (its state says why)."""

    def __init__(self, header: ev.Header, every: int, profile: Profile | None = None):
        if every < 1:
            raise ValueError("keyframes every 0 steps")
        self.every = every
        chosen = profile if profile is not None else bridge.header_profile(header)[0]
        self.replayer = Replayer(header, "<keyframes>", None, None, profile=chosen)
        self.records = Validator(header)   # what a reader starting at a keyframe needs
        self.made = 0
        self.found: list = []   # the divergences the last record showed

    def feed(self, e, line: int | None = None, force: bool = False) -> ev.Keyframe | None:
        """Show the record ``e``, whose line in the trace written is ``line``
        (the keyframe returned not counted); returns the keyframe to write
        before it, if any (``force``: before any step record, whatever its
        number)."""
        kf = None
        due = type(e) is ev.Step and (force or (e.step and not e.step % self.every))
        if due and not self.replayer.stopped:
            kf = ev.Keyframe(e.seq, e.step, FORMAT, kvtrace.__version__, take(self.replayer),
                             **self.records.for_keyframe())
            self.made += 1
        elif due and force:   # a segment's start: readable, though no replay starts there
            kf = ev.Keyframe(e.seq, e.step, FORMAT, kvtrace.__version__,
                             {"stopped": self.replayer.stopped}, **self.records.for_keyframe())
        if type(e) is not ev.Keyframe:
            self.records.check(e)
            # The line it has after the keyframe: what a replay of the trace
            # written says of it (a preemption-loop report the keyframes carry).
            self.replayer.feed(e, line + 1 if kf is not None and line is not None else line)
        # What this record showed wrong (a trigger for a flight recorder); a
        # keyframe keeps no divergence, so the list never grows.
        self.found = self.replayer.divergences
        self.replayer.divergences = []
        return kf


def _externals(header: ev.Header, config) -> dict[str, object]:
    return {"header": header, "cfg": header.config, "config": config}


def _pack_pool(pool: BlockPool) -> tuple[dict, list]:
    return pool.columns(), pool.blocks


def _unpack_pool(columns: dict) -> tuple[BlockPool, list]:
    pool = BlockPool.from_columns(columns)
    return pool, pool.blocks


def find(reader: TraceReader, step: int) -> tuple[ev.Keyframe | None, list[tuple[object, int]],
                                                    Iterator]:
    """The last keyframe of ``reader``'s trace at or before ``step`` (or the
    one the trace starts with: nothing comes before it), the records read
    after it (with their lines), and the reader's iterator, which goes on
    after them. Reads no further than the first record past ``step``."""
    found, after = None, []
    events = iter(reader)
    for i, e in enumerate(events):
        if type(e) is ev.Keyframe:
            if e.step > step and i:
                after.append((e, reader.last_line))
                break
            found, after = e, []
            continue
        after.append((e, reader.last_line))
        if type(e) is ev.Step and e.step >= step:
            break
    return found, after, events


def replay_from(path: str | os.PathLike, step: int, out: str | os.PathLike | None = None,
                progress=None, profile: str | None = None) -> ReplayResult:
    """Replay ``path`` from its last keyframe at or before ``step``. Raises
    TraceError when it has none, or one this kvtrace cannot read."""
    reader = TraceReader(path)
    header = reader.header
    chosen, note = choose_profile(header, profile)
    out_file = rp = None
    failed = None
    try:
        check_supported(header, path, chosen)
        kf, after, rest = find(reader, step)
        if kf is None:
            raise TraceError(path, reader.last_line or 1,
                             f"no keyframe at or before step {step}: replay it whole, or add "
                             "keyframes with 'kvtrace keyframes'")
        out_file = ReplayedTrace(out, header, path) if out is not None else None
        try:
            rp = restore(kf, header, str(path), chosen, out_file and out_file.writer)
        except KeyframeError as e:
            raise TraceError(path, None, str(e)) from None
        if out_file is not None:
            out_file.writer.write(msgspec.structs.replace(kf, seq=out_file.writer.next_seq()))
        result = ReplayResult(path=str(path), header=header, profile=chosen.name,
                              content_unchecked=NO_CONTENT, profile_note=note,
                              from_keyframe=kf.step)
        for e, line in after:
            feed_counted(rp, result, e, line, progress)
        for e in rest:
            feed_counted(rp, result, e, reader.last_line, progress)
        rp.finish()
    except BaseException as e:
        failed = e
        raise
    finally:
        reader.close()
        if out_file is not None:
            out_file.close(failed, rp, reader.truncation)
    rp.put_into(result, reader.truncation)
    return result


def feed_counted(rp: Replayer, result: ReplayResult, e, line, progress) -> None:
    """Feed ``e`` to ``rp``, counted in ``result``, as ``replay_file``'s loop
    does (which keeps it inline: it runs for every event of every replay)."""
    result.events += 1
    rp.feed(e, line)
    if type(e) is ev.End:
        result.end = e
    elif progress is not None and not result.events % PROGRESS_EVERY:
        progress(rp.steps)


def add_keyframes(src: str | os.PathLike, dst: str | os.PathLike, every: int,
                  profile: str | None = None) -> tuple[int, int]:
    """Copy the trace ``src`` to ``dst`` with a keyframe before every
    ``every``-th step (those ``src`` had are made again). Returns (keyframes
    written, steps). A cut-off ``src`` gives a cut-off ``dst``; a replay that
    stops at an engine error makes no keyframe past it."""
    from kvtrace.writing import WrittenFile
    from kvtrace.trace import TraceWriter

    reader = TraceReader(src)
    header = reader.header
    chosen = choose_profile(header, profile)[0]
    dest = None
    try:
        check_supported(header, src, chosen)
        keyframer = Keyframer(header, every, chosen)
        dest = WrittenFile(dst, trace=True)
        writer = TraceWriter(dst, header, fd=dest.take_fd())
        steps = 0
        end = None
        line = 1   # the last line written: the header's
        for e in reader:
            if type(e) is ev.End:
                end = e
                break
            if type(e) is ev.Keyframe:
                continue
            kf = keyframer.feed(e, line + 1)
            if kf is not None:
                writer.write(kf)
                line += 1
            if type(e) is ev.Step:
                steps = e.step + 1
            writer.write(e)
            line += 1
        writer.finish(end)
    except BaseException:
        if dest is not None:
            dest.discard()
        raise
    finally:
        reader.close()
    dest.commit()
    return keyframer.made, steps


def first_keyframe(path: str | os.PathLike) -> int | None:
    """The step of the keyframe ``path`` starts with (a segment, or what
    ``replay -o`` wrote from a keyframe); None when it starts otherwise, or
    is not a regular file (standard input, a pipe: read once)."""
    try:
        if str(path) == "-" or not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:   # the replay's own reader says what is wrong
        return None
    with TraceReader(path, validate=False) as reader:
        first = next(iter(reader), None)
    return first.step if type(first) is ev.Keyframe else None
