"""The ``--metrics`` file: held by one run at a time, and continued, not repeated, on a resume.

Two runs appending to one file lose each other's lines (the second truncates it while the first
writes on at its old offset, leaving a run of NUL bytes that no JSON parser reads), and a run
killed after its last checkpoint has written lines of steps that the resumed run writes again.
So a run holds its ``--metrics`` file like its ``--out`` folder (:mod:`flowtrain.ckpt.out_lock`:
an exclusive ``flock``, dropped by the kernel however the process dies), from before its
checkpoints are cleaned up until it ends, and::

    check_metrics_free(path)              # ConfigError "--metrics ... is in use by another flowtrain run"
    with MetricsFile(path, resumed_at=4) as f:   # steps 1-4 kept; later steps, a line cut short, dropped
        f.write(line + "\\n"); f.flush()

- A new run (``resumed_at`` None) empties the file, as it always did.
- A resumed run (from ``checkpoint-N``) keeps the lines of steps up to N, a held-out loss of
  step N included, and drops every other line: those of later steps, which a killed run wrote
  past its last checkpoint and this run writes again, and one a kill cut short. The kept lines are
  written to a temporary file beside it, flushed to disk and renamed over it, so a crash leaves
  the old file or the new one, never a mix. The lock moves with it: the new file is locked
  before the rename, and a run that locked the old file finds that the path names another file
  now (the same check as ``--out``'s lock) and tries again, meeting the lock.
- Every write is one whole line, appended (``O_APPEND``).

The rename goes to the path resolved (symbolic links followed), so it replaces the file, not a
link. A device or a pipe (``/dev/null``) is written to as it is: not locked, emptied nor rewritten.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TextIO

from ..ckpt.hf import fsync_dir
from ..ckpt.out_lock import lock_file
from ..errors import ConfigError

__all__ = ["MetricsFile", "check_metrics_free", "kept_lines"]


def _refusal(path: Path):
    def refusal(fd: int) -> ConfigError:
        return ConfigError(f"{{metrics}} {path} is in use by another flowtrain run; wait for it to end, or give this "
                           "run another {metrics}", named=True)
    return refusal


def check_metrics_free(path: str | os.PathLike[str] | None) -> None:
    """Refuse (ConfigError) when a running run holds the ``--metrics`` file. Creates nothing."""
    if path is None:
        return
    real = Path(os.path.realpath(path))
    if real.is_file():
        fd = lock_file(real, None, _refusal(Path(path)))
        if fd is not None:
            os.close(fd)


def kept_lines(text: bytes, steps: int) -> bytes:
    """The lines of ``text`` a run resumed after ``steps`` steps keeps: whole lines holding a
    JSON object whose ``step`` is at most ``steps``."""
    kept = []
    for line in text.split(b"\n")[:-1]:  # the last piece: "" after a final newline, else a line cut short
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool) and step <= steps:
            kept.append(line + b"\n")
    return b"".join(kept)


class MetricsFile:
    """The ``--metrics`` file, locked from construction until :meth:`close` (or the ``with``
    block's end); ``file`` is the text file to write whole lines to."""

    def __init__(self, path: str | os.PathLike[str], resumed_at: int | None = None) -> None:
        self.path = Path(os.path.realpath(path))
        if os.path.exists(path) and not os.path.isfile(path):  # a device or pipe (/dev/null): written as it is
            self.file: TextIO = open(path, "a", encoding="utf-8")
            return
        fd = lock_file(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, _refusal(Path(path)))
        assert fd is not None  # (a file is created where there is none)
        try:
            self._remove_stale_temp()
            if resumed_at is None:
                os.ftruncate(fd, 0)
            else:
                fd = self._keep(fd, resumed_at)
        except BaseException:
            os.close(fd)
            raise
        self.file = os.fdopen(fd, "a", encoding="utf-8")

    def __enter__(self) -> "MetricsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file, which lets go of its lock. Safe to call twice."""
        self.file.close()

    def _temp_prefix(self) -> str:
        return f".{self.path.name}.tmp-"

    def _remove_stale_temp(self) -> None:
        """A run killed while rewriting the file left its temporary file: nobody else rewrites
        it while we hold the lock."""
        for p in self.path.parent.iterdir():
            if p.name.startswith(self._temp_prefix()):
                try:
                    p.unlink()
                except OSError:
                    pass

    def _keep(self, fd: int, steps: int) -> int:
        """Drop the lines a resume after ``steps`` steps does not keep (:func:`kept_lines`), by
        an atomic rename of a locked copy; returns the descriptor to write to (``fd`` when
        nothing changed)."""
        text = _read_all(fd)
        kept = kept_lines(text, steps)
        if kept == text:
            return fd
        new, tmp = tempfile.mkstemp(prefix=self._temp_prefix(), dir=self.path.parent)
        try:
            fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows the file yet
            os.fchmod(new, stat.S_IMODE(os.fstat(fd).st_mode))
            _write_all(new, kept)
            os.fsync(new)
            fcntl.fcntl(new, fcntl.F_SETFL, fcntl.fcntl(new, fcntl.F_GETFL) | os.O_APPEND)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(new)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.path.parent)
        os.close(fd)  # the old file, and its lock: whoever takes it now finds the path moved on
        return new


def _read_all(fd: int) -> bytes:
    pieces, offset = [], 0
    while piece := os.pread(fd, 1 << 24, offset):
        pieces.append(piece)
        offset += len(piece)
    return b"".join(pieces)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
