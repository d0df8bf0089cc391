"""Files the commands write (reports, exports, redacted or replayed traces).

A command that fails must not cost the user the file that was there before,
and must never replace or remove something that is not a file. So an output
that is a regular file, or does not exist yet, is written under a temporary
name beside it and renamed over it when the command is done; a failure removes
the temporary file and leaves the old one as it was. The new file takes the
old one's mode (a trace's is always 0600); another hard link to the old file
keeps the old content. An output that exists and is not a regular file (a
device, a named pipe) is written in place, as a shell redirection would, and
never renamed, removed or chmod-ed; ``/dev/stdout`` and ``/dev/fd/N`` are
written through this process's own descriptor, as the shell opened it (so
``-o /dev/stdout >> log`` appends).

Errors that the output causes (a full disk, a missing directory) name the
output as the user gave it, never the temporary name.

    with writing(path) as out, out.open("w", encoding="utf-8") as f:
        f.write(page)
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from typing import Iterator

# Errors only writing can cause: when one comes without a file name, it is the output's.
WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _umask() -> int:
    """The process's umask, read without setting it (which another thread could
    meet half done) where Linux shows it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _descriptor(path: str) -> int | None:
    """The descriptor of this process that ``path`` names through its links
    (``/dev/stdout`` -> ``/proc/self/fd/1``, ``/dev/fd/3``), if it names one."""
    own = ("/proc/self/fd/", f"/proc/{os.getpid()}/fd/", "/dev/fd/")
    p = os.path.abspath(path)
    for _ in range(40):   # the kernel's own limit on links followed
        folder, name = os.path.split(p)
        if folder + "/" in own and name.isdigit():
            return int(name)
        if not os.path.islink(p):
            return None
        p = os.path.normpath(os.path.join(folder, os.readlink(p)))
    return None


class WrittenFile:
    """One output file being written: ``fd`` is open for writing."""

    def __init__(self, path: str | os.PathLike, trace: bool = False):
        self.path = os.fspath(path)
        self.tmp: str | None = None
        self.taken = False   # fd belongs to a file object now
        self.target = os.path.realpath(self.path)   # through a symbolic link, not over it
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise self.named(e, opening=True) from e
        try:
            held = _descriptor(self.path)
            if held is not None:   # /dev/stdout, /dev/fd/N: this process's own descriptor
                self.fd = os.dup(held)   # its offset and O_APPEND, as the shell opened it
            elif st is not None and not stat.S_ISREG(st.st_mode):
                self.fd = os.open(self.path, os.O_WRONLY)
            else:
                folder, name = os.path.split(self.target)
                self.fd, self.tmp = tempfile.mkstemp(prefix=f".{name[:64]}.", suffix=".part",
                                                     dir=folder or ".")
                # A trace holds users' prompts: readable by its owner only (as
                # TraceWriter makes it). Anything else keeps the mode of the file
                # it replaces, or gets the usual mode.
                mode = (0o600 if trace else stat.S_IMODE(st.st_mode) if st is not None
                        else 0o666 & ~_umask())
                os.fchmod(self.fd, mode)
        except OSError as e:
            raise self.named(e, opening=True) from e

    def named(self, e: OSError, opening: bool = False) -> OSError:
        """``e`` naming the output, if it is about the output (as any error in
        opening it is)."""
        if opening or (e.filename in (None, self.tmp, self.target) and (
                e.filename is not None or e.errno in WRITE_ERRORS)):
            named = type(e)(e.errno, e.strerror, self.path)
            named.__cause__ = e
            return named
        return e

    def commit(self) -> None:
        """The output is whole: put it in place."""
        if self.tmp is not None:
            try:
                os.replace(self.tmp, self.target)
            except OSError as e:
                named = self.named(e)   # before discard forgets the temporary name
                self.discard()
                raise named from e
            self.tmp = None

    def discard(self) -> None:
        """Forget what was written (a regular file's old content stays)."""
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            self.tmp = None

    def take_fd(self) -> int:
        """The descriptor, for a writer that closes it (``TraceWriter``)."""
        self.taken = True
        return self.fd

    def open(self, mode: str = "wb", **kw):
        """The output as a file object, which closes the descriptor."""
        f = open(self.fd, mode, **kw)
        self.taken = True
        return f

    def close_unused(self) -> None:
        if not self.taken:
            self.taken = True
            with contextlib.suppress(OSError):
                os.close(self.fd)


def check_writable(path: str | os.PathLike) -> None:
    """Raise the error that writing ``path`` would meet, naming it as given,
    when its folder is missing or cannot be written to: before a command
    spends its time on its input. An output that exists and is neither a
    regular file nor a folder (a device, a named pipe, ``/dev/stdout``) is
    written as it is, and is not tried here. Nothing is left behind."""
    p = os.fspath(path)
    if _descriptor(p) is not None:
        return
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise type(e)(e.errno, e.strerror, p) from e
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return
    # A new file or folder is made beside the output's real place, then renamed.
    folder = os.path.dirname(os.path.realpath(p)) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)[:64]}.", suffix=".part",
                                   dir=folder)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, p) from e
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


@contextlib.contextmanager
def writing(path: str | os.PathLike, trace: bool = False) -> Iterator[WrittenFile]:
    """Write ``path`` through an ``WrittenFile``: put in place when the block ends,
    thrown away when it raises. The file object of ``open`` or the writer
    given ``take_fd`` must be closed inside the block."""
    out = WrittenFile(path, trace=trace)
    try:
        yield out
    except BaseException as e:
        out.close_unused()
        out.discard()
        if isinstance(e, OSError):
            named = out.named(e)
            if named is not e:
                raise named from e
        raise
    else:
        out.close_unused()
        out.commit()


@contextlib.contextmanager
def blamed_on(path: str | os.PathLike) -> Iterator[None]:
    """For an output written in place (a trace being recorded, which must be
    readable up to a crash; standard output): an error that only writing
    causes, raised without a file name inside the block, names ``path``."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno in WRITE_ERRORS:
            raise type(e)(e.errno, e.strerror, os.fspath(path)) from e
        raise


def silence(stream) -> None:
    """The reader of ``stream`` (standard output, say) went away (``| head``):
    send what is still written to it nowhere, so that Python does not complain
    again when it flushes it."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
