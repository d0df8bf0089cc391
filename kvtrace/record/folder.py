"""A flight recorder's segment directory, as the processes around it see it.

``kvtrace record --ring`` (the embedded engine) and a vLLM engine recorded
with ``KVTRACE_RING`` write a directory of segments (``kvtrace.flight.segments``).
Here is what the others need to know of it: the names of its files, the
settings a vLLM engine takes from its environment, how the engine's process
claims the directory before its writer process writes there, and how anyone
asks the recorder to pin the segments at hand (``kvtrace dump DIR``, or a
metrics error in vLLM's front end): a reason file, then SIGUSR2 to the process
``recorder.pid`` names.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import signal
import time
from pathlib import Path

NAME = re.compile(r"segment-(\d{6,})\.jsonl(\.gz|\.zst)?$")
PINS = "pins.json"
PID = "recorder.pid"   # the process that writes the segments, for 'kvtrace dump DIR'
DUMP_SIGNAL = signal.SIGUSR2
ASKED = ".pin-"        # a reason file: '.pin-<pid>-<ns>', one line, why to pin
DUMPED = f"{DUMP_SIGNAL.name} (kvtrace dump)"   # the reason when no file says one

ENV_RING = "KVTRACE_RING"        # a vLLM engine's ring: KVTRACE_OUT is a directory
ENV_SEGMENT = "KVTRACE_SEGMENT"  # its segments' size (default: an eighth of the ring)

CLAIM_WAIT_S = 0.5   # how long a claim waits for the lock of a recorder finishing

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def segment_files(folder: str | os.PathLike) -> list[Path]:
    """The segments of ``folder``, oldest first."""
    found = []
    for p in Path(folder).iterdir():
        m = NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def parse_size(text: str) -> int | None:
    """A size in bytes from ``64MB``, ``2GB``, ``512KiB`` or a plain number;
    None for anything else, or less than a byte."""
    text = str(text).strip().lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(digits):].strip()
    try:
        n = float(digits)
    except ValueError:
        return None
    size = n * _UNITS.get(unit, 0)
    if not (n > 0 and math.isfinite(size) and 1 <= size <= 2 ** 62):
        return None
    return int(size)


def ring_settings(env=os.environ) -> tuple[int, int] | None:
    """``KVTRACE_RING`` and ``KVTRACE_SEGMENT`` as (ring, segment) bytes; None
    when no ring is asked for. Raises ValueError, saying why, for settings
    that are no sizes or a ring that holds less than two segments."""
    ring_text = env.get(ENV_RING, "").strip()
    seg_text = env.get(ENV_SEGMENT, "").strip()
    if not ring_text:
        if seg_text:
            raise ValueError(f"{ENV_SEGMENT} needs {ENV_RING}")
        return None
    ring = parse_size(ring_text)
    if ring is None:
        raise ValueError(f"{ENV_RING}={ring_text!r} is not a size (64MB, 2GB, 512KiB)")
    segment = parse_size(seg_text) if seg_text else ring // 8
    if segment is None or segment < 1:
        raise ValueError(f"{ENV_SEGMENT}={seg_text!r} is not a size (64MB, 2GB, 512KiB)")
    if ring < 2 * segment:
        raise ValueError(f"{ENV_RING}: a ring of {ring:,} bytes holds less than two segments "
                         f"of {segment:,}")
    return ring, segment


def open_folder(path: str | os.PathLike) -> int:
    """Claim the directory ``path`` for a recording of segments: made if it
    is missing, refused (ValueError) when it holds segments already or
    another recorder holds it. Returns a descriptor of it, locked
    (``flock``) as a trace file is while its writer writes it: whoever
    started the engine waits on that lock (``detached.wait_for_writers``)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file: a ring writes a directory of segments there")
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + CLAIM_WAIT_S   # a writer process finishing lets go
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ValueError(f"{folder}: another recorder writes segments there "
                                     "now") from None
                time.sleep(0.01)
            except OSError:
                break   # a file system without locks
        if segment_files(folder):
            raise ValueError(f"{folder} holds segments already: record into a new folder")
    except BaseException:
        os.close(fd)
        raise
    return fd


class NoRecorder(ValueError):
    """No live recorder writes the directory: the message says why."""


def pid_line(pid: int) -> str:
    """What ``recorder.pid`` holds for the recorder ``pid``: its pid and the
    moment it started (``process_start``), which a pid used again does not
    share."""
    start = process_start(pid)
    return f"{pid}\n" if start is None else f"{pid} {start}\n"


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of
    /proc/PID/stat); None when it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def recorder_of(folder: str | os.PathLike) -> int:
    """The pid of the recorder writing ``folder``; NoRecorder when none does:
    no pid file, not a pid, nobody holds the directory's lock
    (``open_folder``), or the pid is no longer the recorder's (a recorder
    killed leaves its pid file behind, and the pid may be another's now:
    its start differs from the one the file says)."""
    folder = Path(folder)
    try:
        text = (folder / PID).read_bytes()[:64].decode("ascii", "replace").strip()
    except OSError:
        raise NoRecorder(f"{folder}: no recorder is writing here (no {PID})") from None
    fields = text.split()
    if not (1 <= len(fields) <= 2 and all(f.isascii() and f.isdigit() for f in fields)
            and 0 < int(fields[0]) < 2 ** 22):
        raise NoRecorder(f"{folder / PID}: not a process id: {text[:40]!r}")
    pid = int(fields[0])
    stale = (f"{folder}: process {pid} is not a kvtrace recorder (a recorder killed leaves "
             f"{PID} behind)")
    if not holds_lock(folder):
        raise NoRecorder(f"{folder}: no recorder holds it: {PID} (pid {pid}) is left from a "
                         "recorder that ended")
    if len(fields) == 2 and process_start(pid) not in (int(fields[1]), None):
        raise NoRecorder(stale)
    if not runs_kvtrace(pid):
        raise NoRecorder(stale)
    return pid


def runs_kvtrace(pid: int) -> bool:
    """Whether process ``pid`` runs kvtrace (its command line names it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kvtrace" in f.read()
    except FileNotFoundError:
        return False
    except OSError:   # no /proc here: the pid file is all there is
        return True


def holds_lock(folder: str | os.PathLike) -> bool:
    """Whether a recorder holds the directory ``folder`` (its lock,
    ``open_folder``); True where it cannot be told (no locks there)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True   # a file system without locks
    finally:
        os.close(fd)   # lets go of a lock taken here
    return False


def ask_pin(folder: str | os.PathLike, why: str | None = None) -> int:
    """Ask the recorder writing ``folder`` to pin the segments at hand, for
    ``why`` (one line; None: a dump). Returns its pid. Raises NoRecorder
    when no live recorder writes there, PermissionError when it is another
    user's."""
    folder = Path(folder)
    pid = recorder_of(folder)
    reason = None
    if why is not None:
        reason = folder / f"{ASKED}{os.getpid()}-{time.monotonic_ns()}"
        tmp = reason.with_name(reason.name + ".tmp")
        tmp.write_text(" ".join(why.split())[:500] + "\n")
        os.replace(tmp, reason)
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        if reason is not None:
            reason.unlink(missing_ok=True)
        raise NoRecorder(f"{folder}: its recorder (pid {pid}) has ended") from None
    except BaseException:
        if reason is not None:
            reason.unlink(missing_ok=True)
        raise
    return pid


def take_reasons(folder: str | os.PathLike) -> list[str]:
    """The reasons asked in ``folder`` since the last call (oldest first),
    their files removed."""
    found = []
    try:
        names = [p for p in Path(folder).iterdir()
                 if p.name.startswith(ASKED) and not p.name.endswith(".tmp")]
    except OSError:
        return []
    for p in sorted(names, key=lambda p: p.name.rsplit("-", 1)[-1].zfill(24)):
        try:
            text = p.read_bytes()[:600].decode("utf-8", "replace").strip()
            p.unlink()
        except OSError:   # taken by another reader, or unreadable
            continue
        if text:
            found.append(text)
    return found
