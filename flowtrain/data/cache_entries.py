"""The data cache as a user manages it: where it lives, what each entry holds and takes on disk,
and removing entries, least recently used first (``flowtrain cache``)::

    for entry in entries():                  # least recently used first
        print(entry.path.name, entry.size, entry.source)
    trim(max_bytes=20 * 10**9)               # remove the oldest until the rest take 20 GB

Every load of a cached file marks its entry used (:func:`touch`, the mtime of its
``index.json``), so "least recently used" means the data no run has read for longest. Nothing
here deletes anything on its own: a cache entry can hold hours of tokenising, so only
``flowtrain cache --clean`` (or a user) removes one. Removing an entry that a running training
maps is safe on Linux and macOS (the mapped files live on until the run lets go of them); a
later run of the same data builds it again.

This module imports only the standard library, so ``flowtrain cache`` starts without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_ENV", "Entry", "alive", "cache_root", "entries", "remove", "touch", "trim"]

#: The environment variable naming flowtrain's cache folder (data caches go in its ``data``).
CACHE_ENV = "FLOWTRAIN_CACHE"
_TMP = ".tmp-"  # a folder being built is named <key>.tmp-<pid>-<random>


def cache_root(root: str | Path | None = None) -> Path:
    """The folder data caches live in: ``root``, else from ``$FLOWTRAIN_CACHE``, else the user's."""
    if root is not None:
        return Path(root)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "data"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flowtrain" / "data"


@dataclass(frozen=True)
class Entry:
    """One folder of the data cache."""

    path: Path
    size: int  # bytes of every file in it
    used: float  # last use, seconds since the epoch
    source: str | None  # the --data file it was built from (None: not readable)
    rows: int | None  # sequences of seq_len tokens, from its index
    seq_len: int | None
    #: "ready", "building" (a build whose process still runs) or "abandoned" (a build that died,
    #: or a folder without a readable index)
    state: str


def entries(root: str | Path | None = None) -> list[Entry]:
    """Every folder of the cache, least recently used first (an empty list without a cache)."""
    folder = cache_root(root)
    if not folder.is_dir():
        return []
    found = [_entry(p) for p in folder.iterdir() if p.is_dir()]
    return sorted(found, key=lambda e: (e.used, e.path.name))


def touch(folder: Path) -> None:
    """Mark a cache folder used now (its ``index.json``'s mtime); a read-only cache stays as it is."""
    try:
        os.utime(folder / "index.json")
    except OSError:
        pass


def remove(entry: Entry) -> bool:
    """Delete ``entry``'s folder; False (and nothing deleted) for a build still running."""
    if entry.state == "building":
        return False
    shutil.rmtree(entry.path, ignore_errors=True)
    return True


def trim(max_bytes: int, root: str | Path | None = None) -> list[Entry]:
    """Remove abandoned builds, then entries least recently used first until the rest take at
    most ``max_bytes`` (0: all of them); the entries removed. Running builds are left alone."""
    found = entries(root)
    total = sum(e.size for e in found)
    removed = []
    for entry in sorted(found, key=lambda e: e.state != "abandoned"):  # abandoned first, then by use
        if entry.state != "abandoned" and total <= max_bytes:
            break
        if remove(entry):
            removed.append(entry)
            total -= entry.size
    return removed


def _entry(path: Path) -> Entry:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    state = "ready"
    if _TMP in path.name:
        state = "building" if alive(_pid(path.name)) else "abandoned"
    index: dict = {}
    try:
        index = json.loads((path / "index.json").read_text())
        used = (path / "index.json").stat().st_mtime
    except (OSError, ValueError):
        used = path.stat().st_mtime if path.exists() else time.time()
        state = "abandoned" if state == "ready" else state
    if not isinstance(index, dict):
        index, state = {}, "abandoned"
    return Entry(path, size, used, index.get("source"), index.get("rows"), index.get("seq_len"), state)


def _pid(name: str) -> int:
    try:
        return int(name.split(_TMP)[1].split("-")[0])
    except (IndexError, ValueError):
        return -1


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal exists too)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
