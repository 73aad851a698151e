"""One run per ``--out`` folder: an exclusive ``flock`` on ``OUT/.flowtrain.lock``.

Two runs writing into one folder destroy each other's work: every run starts by deleting the
temporary folders a killed run left behind, and to a second run the first one's checkpoint in
progress looks exactly like such a leftover. So a run holds this lock from before that
clean-up until its final model is in place, and a second run is refused at once, in one line
naming the holder::

    check_free(out)           # ConfigError "... in use by another flowtrain run (pid 4242) ..."
    with OutLock(out):        # creates out if needed; the same refusal if someone took it since
        ...                   # clean up, train, save

Why it is built this way:

- ``flock``, not a pid file: the kernel drops the lock when its process dies, however it dies
  (``kill -9`` included), so a crash never leaves a folder locked. The file holds the holder's
  pid and host only so that the refusal can name them.
- ``flock`` rather than POSIX record locks (``lockf``): a record lock belongs to the process
  and disappears when *any* descriptor of the file in it is closed; a flock belongs to the
  one open file description this module holds, and is not inherited by ``exec``.
- The file is deleted on release, so a finished run leaves nothing behind. That is safe only
  because every acquisition checks, after ``flock`` succeeds, that the path still names the
  file it locked: a run that opened the file just before the holder deleted it finds it has
  locked a dead file, and starts over on the new one.
- :func:`check_free` creates nothing, so it can run before the checks that refuse a non-empty
  ``--out``: the second run hears "in use by pid N", not "not empty". It also deletes a lock
  file that nobody holds (a killed run's), which would otherwise make an empty folder non-empty.
- Folders that :class:`OutLock` had to create are removed on release if still empty, so a run
  that fails before writing anything leaves no trace.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError

__all__ = ["LOCK_NAME", "OutLock", "check_free", "lock_file"]

#: The lock file's name inside ``--out``.
LOCK_NAME = ".flowtrain.lock"


def _holder(fd: int) -> str:
    """``pid N`` (``on HOST`` when not this machine) from the holder's lock file."""
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        text = []
    if not text or not text[0].isdigit():
        return "pid unknown: it has only just started"  # the holder writes its pid right after locking
    host = f" on {text[1]}" if len(text) > 1 and text[1] != socket.gethostname() else ""
    return f"pid {text[0]}{host}"


def _lock(path: Path, create: bool, out: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive lock; None when there is no such file and
    ``create`` is false. Raises ConfigError when another open file holds the lock."""
    def refusal(fd: int) -> ConfigError:
        return ConfigError(f"{{out}} {out} is in use by another flowtrain run ({_holder(fd)}); wait for it to end, "
                           f"or give this run another {{out}}", named=True)

    return lock_file(path, os.O_RDWR | os.O_CREAT if create else None, refusal)


def lock_file(path: str | os.PathLike[str], flags: int | None, refusal: Callable[[int], Exception]) -> int | None:
    """A descriptor of ``path`` opened with ``flags`` (None: read-only, a probe that creates
    nothing) holding its exclusive ``flock``; None when a probe finds no file. Raises
    ``refusal(fd)`` when another open file holds the lock. Retries where the path stopped
    naming the file it locked (its holder deleted or replaced it meanwhile)."""
    while True:
        try:
            # flock needs no write access: a probe opens read-only, so another user's lock file
            # still tells whose it is
            fd = os.open(path, (os.O_RDONLY if flags is None else flags) | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            if flags is not None:
                raise
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = refusal(fd)
            os.close(fd)
            raise error from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder deleted it while we waited for the lock: try the file there now


def check_free(out: str | os.PathLike[str]) -> None:
    """Refuse (ConfigError naming the holder's pid) when a running run holds ``out``. Creates
    nothing; deletes a lock file left by a run that died."""
    out = Path(out)
    fd = _lock(out / LOCK_NAME, create=False, out=out) if out.is_dir() else None
    if fd is not None:
        try:
            os.unlink(out / LOCK_NAME)  # while still holding it: see the module docstring
        except OSError:
            pass
        finally:
            os.close(fd)


class OutLock:
    """Holds ``out``'s lock from construction until :meth:`release` (or the ``with`` block's
    end). ``out`` should be the real folder (symlinks resolved), so that two runs naming it by
    different paths meet at the same lock file."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
        self._created: list[Path] = []
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self._created = [p for p in missing if p.is_dir()]  # deepest first
            self._fd: int | None = _lock(self.path, create=True, out=self.out)
        except BaseException:
            self._fd = None
            self._remove_created()
            raise
        os.ftruncate(self._fd, 0)  # type: ignore[arg-type]
        os.pwrite(self._fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)  # type: ignore[arg-type]

    def __enter__(self) -> "OutLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<OutLock {self.path} {'held' if self._fd is not None else 'released'}>"

    def release(self) -> None:
        """Delete the lock file, let go of the lock, remove folders it created that are still
        empty. Safe to call twice."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # before closing: nobody can lock this file and keep it
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for p in self._created:
            try:
                os.rmdir(p)  # only an empty folder goes; one holding anything stays
            except OSError:
                break
        self._created = []
