"""The data cache: a ``--data`` file is tokenised once into token files that later runs map.

::

    folder = cached(path, settings, tokenizer_dir, build=write_rows)   # builds on a miss
    rows = open_rows(folder)               # (N, seq_len) int64 tensors backed by np.memmap
    rows.input_ids[torch.tensor([3, 7])]   # a batch: two rows read, the rest stays on disk

**Where.** ``$FLOWTRAIN_CACHE/data`` when ``FLOWTRAIN_CACHE`` is set, else
``$XDG_CACHE_HOME/flowtrain/data`` (``~/.cache/flowtrain/data``). Never next to the data file:
its folder may be read-only, and one file may serve models with different tokenizers.
Training never deletes a finished cache folder; ``flowtrain cache`` lists the folders with their
sizes and ``flowtrain cache --clean [--max-gb G]`` removes them, least recently used first
(:mod:`~flowtrain.data.cache_entries`; every load marks its folder used).

**Key.** A folder is named by a sha256 over the data file's bytes (a ``datasets`` folder's:
every file in it, by name), the bytes of every tokenizer
file of the model (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ...),
every setting that changes the rows (``seq_len`` or how the data chooses it, the column map, ``packing``,
``long_examples`` as built: ``"error"`` builds what ``"drop"`` does, ``vocab_size``, pad and
EOS ids, ``byte_tokenizer``, the text piece size), the versions of ``tokenizers`` and
``jinja2`` and :data:`FORMAT`. Same key, same rows; change anything and a new folder is built.

**What a folder holds.** ``input_ids.bin``, ``targets.bin`` and, for packed rows,
``positions.bin``: raw native-endian int64, ``(rows, seq_len)`` in C order. ``layout.npy``
(packed rows only): one ``(example, row, column)`` line per example, ``example`` being its row
number without packing. ``index.json``: the shape, the target count, the fingerprint and a
checksum of every ``.bin`` file, and the build's ``report`` (examples cut or dropped, the
longest, the assistant-mask rule: what the run's start-up block says).

**Checked at every load.** A cache folder is trusted only as far as it is checked: a file
changed in place (a bad disk block, a stray write; same size, other tokens) would otherwise be
trained on, and resumed from, under the fingerprint stored when it was built. So every load
reads the ``.bin`` files once and compares each one's CRC-32 (``zlib.crc32``, about 2 GB/s on
one core: a second or so per billion tokens, and the pages are then warm for the mapping) with
the index; on a mismatch it says so on stderr and rebuilds the folder from the ``--data`` file
(which must exist: the key is a hash of it, so without it there is no cache to use). The
fingerprint a resume compares is therefore one of bytes just verified. A CRC is no defence
against someone forging a file; it catches accidents, which is what a cache meets.

**Atomic.** A folder is built as ``<key>.tmp-<pid>-<random>`` and renamed to ``<key>`` once
complete, so a folder named by its key is always whole: a killed build leaves only a ``.tmp``
folder, which the next build of the same key removes once its process is gone. A folder whose
files do not match its index (sizes or checksums) is rebuilt. Two runs building one key at
once both build; the first rename wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from flowtrain.data.cache_entries import CACHE_ENV, alive, cache_root, touch
from flowtrain.data.tables import files_of
from flowtrain.data.text import tokenizer_files
from flowtrain.errors import DataError

__all__ = ["CACHE_ENV", "FORMAT", "RowWriter", "Rows", "cache_root", "cached", "fingerprint", "open_rows"]

#: The version of the folder layout; a new one never reads an old folder. 2: checksums.
#: 3: a report of what the build did to the examples (and examples spooled whole first).
#: 4: long text rows tokenised in pieces, a piece at most 2 * CHUNK_CHARS characters; rows
#: without a target counted in the report.
FORMAT = 4
#: Tokens buffered by a :class:`RowWriter` before they go to disk, and read at a time to hash.
_BLOCK_TOKENS = 1 << 22
_FILES = ("input_ids", "targets", "positions")


def cache_key(path: Path, settings: dict, tokenizer_dir: str | Path | None) -> str:
    """The name of the folder for ``path`` read with ``settings`` and ``tokenizer_dir``'s files."""
    h = hashlib.sha256()
    meta = {"format": FORMAT, "byteorder": sys.byteorder, "settings": settings,
            "versions": {name: _version(name) for name in ("tokenizers", "jinja2")}}
    h.update(json.dumps(meta, sort_keys=True).encode())
    data = [("data", path)] if not path.is_dir() else [(f"data/{f.relative_to(path)}", f) for f in files_of(path)]
    for name, file in data + [(f.name, f) for f in tokenizer_files(tokenizer_dir)]:
        with file.open("rb") as f:
            h.update(f"{name}:{hashlib.file_digest(f, 'sha256').hexdigest()};".encode())
    return h.hexdigest()[:32]


def cached(path: Path, settings: dict, tokenizer_dir: str | Path | None,
           build: Callable[[Path], dict], root: str | Path | None = None) -> Path:
    """The complete cache folder of ``path``; on a miss, ``build(folder)`` writes the rows into
    a fresh temporary folder (returning what goes into index.json) and it is renamed into place.
    Raises DataError when the cache cannot be written."""
    root = cache_root(root)
    final = root / cache_key(path, settings, tokenizer_dir)
    if _complete(final):
        bad = _corrupt(final)
        if bad is None:
            touch(final)
            return final
        print(f"flowtrain: the data cache {final} is corrupt ({bad} does not match its checksum); "
              f"rebuilding it from {path}", file=sys.stderr)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(root, final.name)
        tmp = root / f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as exc:
        raise DataError(f"cannot write the data cache in {root} ({exc.strerror or exc}); set "
                        f"{CACHE_ENV} to a writable folder") from None
    try:
        index = build(tmp)
        _finish(tmp, index)
        if final.exists():  # broken (incomplete or corrupt) or built meanwhile by another run
            if _complete(final) and _corrupt(final) is None:
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            shutil.rmtree(final)
        os.rename(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"could not build the data cache of {path} in {tmp} ({exc.strerror or exc}); "
                        f"free some disk space or set {CACHE_ENV} to another folder") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a bad row, ^C: nothing half-built is kept
        raise
    return final


@dataclass
class Rows:
    """A cache folder opened: memory-mapped tensors and its index."""

    input_ids: torch.Tensor  # (N, seq_len) int64, backed by input_ids.bin
    targets: torch.Tensor  # (N, seq_len) int64
    positions: torch.Tensor | None  # (N, seq_len) int64 for packed rows, else None
    index: dict


def open_rows(folder: Path) -> Rows:
    """Map a folder that :func:`cached` returned. The mapping is copy-on-write, so the tensors
    are writable (torch wants that) while the files never change."""
    index = json.loads((folder / "index.json").read_text())
    shape = (index["rows"], index["seq_len"])
    mapped = {name: torch.from_numpy(np.memmap(folder / f"{name}.bin", dtype=np.int64, mode="c",
                                               shape=shape))
              for name in index["files"]}
    return Rows(mapped["input_ids"], mapped["targets"], mapped.get("positions"), index)


class RowWriter:
    """Appends blocks of rows to a folder's ``.bin`` files, counting rows and targets; a context
    manager, so a failed build lets go of its files."""

    def __init__(self, folder: Path, seq_len: int, positions: bool) -> None:
        self.folder, self.seq_len, self.rows, self.num_targets = folder, seq_len, 0, 0
        self.names = _FILES if positions else _FILES[:2]
        self._files = {name: (folder / f"{name}.bin").open("wb") for name in self.names}
        self._held: list[tuple[np.ndarray, ...]] = []
        self._held_rows = 0

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._files.values():  # after close(), a no-op; after an error, files let go
            f.close()

    @property
    def num_rows(self) -> int:
        """Rows added so far (written or held)."""
        return self.rows + self._held_rows

    def add(self, *arrays: np.ndarray) -> None:
        """Rows of input ids, targets (and positions): each ``(r, seq_len)`` int64."""
        assert len(arrays) == len(self.names) and all(a.shape == arrays[0].shape for a in arrays)
        self._held.append(arrays)
        self._held_rows += arrays[0].shape[0]
        if self._held_rows * self.seq_len >= _BLOCK_TOKENS:
            self.flush()

    def flush(self) -> None:
        for k, name in enumerate(self.names):
            for arrays in self._held:
                self._files[name].write(np.ascontiguousarray(arrays[k], dtype=np.int64).tobytes())
        self.rows += self._held_rows
        self.num_targets += sum(int((a[1] != -100).sum()) for a in self._held)
        self._held, self._held_rows = [], 0

    def close(self) -> dict:
        """Flush, sync and close; the index entries of the files written."""
        self.flush()
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return {"rows": self.rows, "seq_len": self.seq_len, "num_targets": self.num_targets,
                "files": list(self.names)}


def fingerprint(tensors: list[torch.Tensor]) -> str:
    """A short hash of the rows as the run sees them: sha256 over each tensor's shape and
    bytes (the hash checkpoints have always recorded for ``[input_ids, targets]``), computed a
    block of rows at a time."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        step = max(1, _BLOCK_TOKENS // max(1, t.shape[1]))
        for i in range(0, t.shape[0], step):
            h.update(t[i : i + step].contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def _file_digests(folder: Path, index: dict, fingerprint: bool = True) -> tuple[str | None, dict[str, str]]:
    """:func:`fingerprint` of a folder's rows (unless ``fingerprint`` is false) and each file's
    checksum, in one pass of plain reads (no mapping to count as the process's memory)."""
    h = hashlib.sha256() if fingerprint else None
    shape = str((index["rows"], index["seq_len"])).encode()
    sums = {}
    for name in index["files"]:
        crc = 0
        if h is not None:
            h.update(shape)
        with (folder / f"{name}.bin").open("rb") as f:
            while block := f.read(_BLOCK_TOKENS * 8):
                crc = zlib.crc32(block, crc)
                if h is not None:
                    h.update(block)
        sums[name] = f"crc32:{crc:08x}"
    return (h.hexdigest()[:32] if h is not None else None), sums


def _corrupt(folder: Path) -> str | None:
    """The first ``.bin`` file of a complete folder whose checksum differs from its index, or
    None when all match. Reads every byte of them."""
    index = json.loads((folder / "index.json").read_text())
    try:
        _, sums = _file_digests(folder, index, fingerprint=False)
    except OSError as exc:
        return f"{exc.filename or folder} ({exc.strerror or exc})"
    return next((f"{name}.bin" for name in index["files"] if sums[name] != index["checksums"].get(name)), None)


def _finish(folder: Path, index: dict) -> None:
    """Write index.json last (with the fingerprint and checksums), synced, so its presence
    means complete."""
    index = {"format": FORMAT, **index}
    index["fingerprint"], index["checksums"] = _file_digests(folder, index)
    with (folder / "index.json").open("w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole cache: an index of this FORMAT and files of its sizes."""
    try:
        index = json.loads((folder / "index.json").read_text())
        size = index["rows"] * index["seq_len"] * 8
        return index["format"] == FORMAT and index["rows"] > 0 and isinstance(index["checksums"], dict) and all(
            (folder / f"{name}.bin").stat().st_size == size for name in index["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _remove_abandoned(root: Path, key: str) -> None:
    """Delete temporary folders of ``key`` whose building process has died."""
    for tmp in root.glob(f"{key}.tmp-*"):
        try:
            pid = int(tmp.name.split(".tmp-")[1].split("-")[0])
        except ValueError:
            continue
        if not alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
