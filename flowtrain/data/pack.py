"""From pieces to rows: token streams cut into windows, examples padded or packed.

Each function draws :class:`~flowtrain.data.files.Piece` s from a reader (a stream's, as they
come; examples, through the scratch files of :class:`Spooled`) and appends ``(r, seq_len)``
int64 blocks to a :class:`~flowtrain.data.cache.RowWriter`, so only a block of rows is in
memory at a time. The target of position ``t`` is the label of ``t + 1``
within the same example (see :mod:`flowtrain.data.source`).

**Packing** (:func:`packed_rows`). Short fine-tuning examples share a row::

    examples   a=[1 5 9]  b=[1 7 3 2]  c=[1 4]            (seq_len 8)
    input_ids  [ 1  5  9  1  7  3  2 pad ]  [ 1  4 pad pad pad pad pad pad ]
    positions  [ 0  1  2  0  1  2  3  0  ]  [ 0  1  0   1   2   3   4   5  ]
    targets    [ 5  9 -100 7 3  2 -100 -100 ] ...           (a's last token predicts nothing)

An example is never split across rows. Examples come from the file in two passes: the first
(:class:`Spooled`) writes each one whole to scratch files and notes its length, so that the
length of the rows can come from the data (the longest example); the second (:func:`fit`)
decides, at that length, what happens to an example longer than it: dropped, or cut at seq_len
keeping its start (the same cut with packing and without), when it then fills a row alone, and
counts both. Rows are filled *best fit decreasing*: examples are taken longest first
(equal lengths in file order), each goes into the row with the least free space that still
holds it (equal space: the row that reached it first), else into a new row; within a row the
examples keep file order. Deterministic: the same file gives the same rows. Positions restart
at 0 at every example start and at the start of the padding, so ``positions == 0`` marks every
boundary; the model masks attention between the runs.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowtrain.data.cache import RowWriter
from flowtrain.data.files import IGNORE_INDEX, Piece
from flowtrain.errors import DataError

__all__ = ["Fitted", "Spooled", "best_fit_decreasing", "fit", "packed_rows", "plain_rows", "restarting_positions",
           "stream_rows"]

_BLOCK_TOKENS = 1 << 22  # tokens of rows assembled at a time


def stream_rows(path: Path, pieces: Iterable[Piece], eos_id: int | None, seq_len: int, pad_id: int,
                out: RowWriter) -> None:
    """Documents joined (EOS between, unless one already ends in it) and cut into windows of
    exactly seq_len; the tail after the last full window is kept, padded, if it has 2 tokens."""
    held: list[np.ndarray] = []
    count, total, last = 0, 0, None
    for piece in pieces:
        if not piece.ids.size:
            continue
        if piece.starts and last is not None and eos_id is not None and last != eos_id:
            held.append(np.array([eos_id], dtype=np.int64))
            count += 1
        held.append(piece.ids)
        count, last = count + len(piece.ids), int(piece.ids[-1])
        if count >= max(seq_len, _BLOCK_TOKENS):
            rest = _write_windows(np.concatenate(held), seq_len, out)
            total += count - len(rest)
            held, count = [rest], len(rest)
    stream = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
    total += len(stream)
    rest = _write_windows(stream, seq_len, out)
    if len(rest) >= 2:
        ids = np.full((1, seq_len), pad_id, dtype=np.int64)
        ids[0, : len(rest)] = rest
        out.add(ids, _row_targets(ids, [len(rest)]))
    elif out.num_rows == 0:
        raise DataError(
            f"{path} has no usable sequences: it holds {total} token(s) after "
            "tokenizing, and predicting a next token needs at least 2; add more data"
        )


def _write_windows(stream: np.ndarray, seq_len: int, out: RowWriter) -> np.ndarray:
    """Write the full windows of ``stream``; the tokens left over."""
    full = len(stream) // seq_len
    if full:
        ids = stream[: full * seq_len].reshape(full, seq_len)
        out.add(ids, _row_targets(ids, [seq_len] * full))
    return stream[full * seq_len :]


def _row_targets(ids: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Targets of right-padded token rows: the next token where it is real, else -100."""
    targets = np.full_like(ids, IGNORE_INDEX)
    for row, n in enumerate(lengths):
        targets[row, : n - 1] = ids[row, 1:n]
    return targets


class Spooled:
    """Pass 1 of a ``rows`` file: every example that has a target, whole, in two scratch files
    of raw int64 (its ids, its targets ``labels[t + 1]`` with the last -100), and per example
    its length, its number of targets and its row in the file. Examples without a single target
    (under 2 tokens, or no loss after the first) teach nothing and are left out here, counted
    (``untrained``, and the row of the first in ``first_untrained``) so that a run can say so."""

    def __init__(self, pieces: Iterable[Piece], scratch: Path) -> None:
        self.files = [scratch / "examples.ids", scratch / "examples.targets"]
        lengths, targets, rows = (array("q") for _ in range(3))
        self.untrained = 0  # examples left out for having no target
        self.first_untrained: int | None = None  # the row of the first (Piece.row)
        with self.files[0].open("wb") as f_ids, self.files[1].open("wb") as f_targets:
            for piece in pieces:
                labels = piece.labels if piece.labels is not None else piece.ids
                shifted = np.full_like(piece.ids, IGNORE_INDEX)
                shifted[:-1] = labels[1:]
                count = int((shifted != IGNORE_INDEX).sum())
                if count == 0:
                    self.untrained += 1
                    if self.first_untrained is None:
                        self.first_untrained = piece.row
                    continue
                f_ids.write(piece.ids.tobytes())
                f_targets.write(shifted.tobytes())
                lengths.append(len(piece.ids))
                targets.append(count)
                rows.append(piece.row)
        self.lengths = np.frombuffer(lengths, dtype=np.int64) if lengths else np.zeros(0, dtype=np.int64)
        self.targets = np.frombuffer(targets, dtype=np.int64) if targets else np.zeros(0, dtype=np.int64)
        self.rows = np.frombuffer(rows, dtype=np.int64) if rows else np.zeros(0, dtype=np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths  # each example's first token in the files

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        """Tokens of the longest example (0 without any)."""
        return int(self.lengths.max()) if len(self) else 0

    def remove(self) -> None:
        for file in self.files:
            file.unlink(missing_ok=True)


@dataclass
class Fitted:
    """Pass 2: what becomes of each spooled example at ``seq_len`` (:func:`fit`)."""

    keep: np.ndarray  # (k,) int64: the spooled examples that go into rows, in file order
    sizes: np.ndarray  # (k,) int64: their tokens in a row (seq_len for one cut)
    cut: np.ndarray  # (k,) bool: cut at seq_len (its last position predicts nothing then)
    #: examples cut at seq_len and the targets they lost; those cut to nothing left to learn are
    #: left out but counted here
    cut_count: int = 0
    cut_lost: int = 0
    dropped_count: int = 0  # examples left out for being longer than seq_len (drop)
    dropped_lost: int = 0  # their targets
    first_dropped: tuple[int, int] | None = None  # (row in the file, tokens) of the first one


def fit(spooled: Spooled, seq_len: int, drop_long: bool) -> Fitted:
    """Decide each example's fate at ``seq_len``: one that fits is kept whole; one longer is
    dropped if ``drop_long``, else cut at ``seq_len`` keeping its start. Reads only the targets
    of the examples that are cut."""
    long = spooled.lengths > seq_len
    drop = long & drop_long
    cut = long & ~drop
    kept_targets = spooled.targets.copy()
    if cut.any():
        fd = os.open(spooled.files[1], os.O_RDONLY)
        try:
            for i in np.flatnonzero(cut).tolist():  # what is left of its targets: positions 0..seq_len-2
                kept_targets[i] = int((_pread(fd, spooled.starts[i], seq_len - 1) != IGNORE_INDEX).sum())
        finally:
            os.close(fd)
    keep = ~drop & (kept_targets > 0)
    dropped = np.flatnonzero(drop)
    first = (int(spooled.rows[dropped[0]]), int(spooled.lengths[dropped[0]])) if dropped.size else None
    return Fitted(
        keep=np.flatnonzero(keep), sizes=np.minimum(spooled.lengths[keep], seq_len), cut=cut[keep],
        cut_count=int(cut.sum()), cut_lost=int((spooled.targets - kept_targets)[cut].sum()),
        dropped_count=int(drop.sum()), dropped_lost=int(spooled.targets[drop].sum()), first_dropped=first,
    )


class _Reader:
    """Reads one kept example (ids, targets) from the scratch files, its last target cleared
    when it was cut (the token it predicted is not in the row)."""

    def __init__(self, spooled: Spooled, fitted: Fitted) -> None:
        self.spooled, self.fitted = spooled, fitted
        self.fds = [os.open(f, os.O_RDONLY) for f in spooled.files]

    def __call__(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        start, n = self.spooled.starts[self.fitted.keep[k]], int(self.fitted.sizes[k])
        ids, targets = _pread(self.fds[0], start, n), _pread(self.fds[1], start, n)
        if self.fitted.cut[k]:
            targets = targets.copy()
            targets[-1] = IGNORE_INDEX
        return ids, targets

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def plain_rows(spooled: Spooled, fitted: Fitted, seq_len: int, pad_id: int, out: RowWriter) -> None:
    """One row per kept example, right-padded (``--no-packing``), assembled a block at a time."""
    block = max(1, _BLOCK_TOKENS // seq_len)
    read = _Reader(spooled, fitted)
    try:
        for k0 in range(0, len(fitted.keep), block):
            k1 = min(len(fitted.keep), k0 + block)
            ids = np.full((k1 - k0, seq_len), pad_id, dtype=np.int64)
            targets = np.full((k1 - k0, seq_len), IGNORE_INDEX, dtype=np.int64)
            for k in range(k0, k1):
                example, example_targets = read(k)
                ids[k - k0, : len(example)], targets[k - k0, : len(example)] = example, example_targets
            out.add(ids, targets)
    finally:
        read.close()


def packed_rows(spooled: Spooled, fitted: Fitted, seq_len: int, pad_id: int, out: RowWriter) -> np.ndarray:
    """The kept examples packed into rows (see the module); returns the layout, ``(n, 3)`` int64
    of (example, row, column) in row order, ``example`` counting the kept examples."""
    sizes = fitted.sizes
    row_of = best_fit_decreasing(sizes, seq_len)
    order = np.lexsort((np.arange(len(sizes)), row_of))  # by row, then file order
    column = np.zeros(len(sizes), dtype=np.int64)
    in_row = np.cumsum(sizes[order]) - sizes[order]
    first = np.searchsorted(row_of[order], row_of[order])  # each row's first entry in order
    column[order] = in_row - in_row[first]
    _write_packed(_Reader(spooled, fitted), order, row_of, sizes, column, seq_len, pad_id, out)
    return np.stack([order, row_of[order], column[order]], axis=1)


def _write_packed(read: _Reader, order, row_of, sizes, column, seq_len, pad_id, out) -> None:
    """Pass 3: rows assembled a block at a time from the scratch files (one read per example)."""
    try:
        num_rows = int(row_of.max()) + 1
        bounds = np.searchsorted(row_of[order], np.arange(num_rows + 1))
        block = max(1, _BLOCK_TOKENS // seq_len)
        for r0 in range(0, num_rows, block):
            r1 = min(num_rows, r0 + block)
            ids = np.full((r1 - r0, seq_len), pad_id, dtype=np.int64)
            targets = np.full((r1 - r0, seq_len), IGNORE_INDEX, dtype=np.int64)
            run_lengths: list[list[int]] = []
            for r in range(r0, r1):
                runs = []
                for e in order[bounds[r] : bounds[r + 1]].tolist():
                    n, c = int(sizes[e]), int(column[e])
                    ids[r - r0, c : c + n], targets[r - r0, c : c + n] = read(e)
                    runs.append(n)
                run_lengths.append(runs)
            out.add(ids, targets, np.stack([restarting_positions(runs, seq_len) for runs in run_lengths]))
    finally:
        read.close()


def _pread(fd: int, start: int, n: int) -> np.ndarray:
    return np.frombuffer(os.pread(fd, 8 * n, 8 * int(start)), dtype=np.int64)


def restarting_positions(lengths: list[int], seq_len: int) -> np.ndarray:
    """``(seq_len,)`` int64: 0, 1, ... within each example of ``lengths`` (in order), then a run
    of its own over the padding: ``[3, 2], 7 -> [0 1 2 0 1 0 1]``."""
    runs = list(lengths) + ([seq_len - sum(lengths)] if sum(lengths) < seq_len else [])
    run_starts = np.repeat(np.cumsum(runs) - runs, runs)
    return np.arange(seq_len, dtype=np.int64) - run_starts


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each example (rows numbered as they are opened), for lengths <= capacity.

    Longest first (equal lengths in file order), each into the row with the least free space
    that holds it (equal space: the row that reached that space first), else a new row. The
    free spaces in use are kept sorted (at most ``capacity`` distinct values), so a placement
    costs a binary search.
    """
    row_of = np.empty(len(lengths), dtype=np.int64)
    spaces: list[int] = []  # sorted: the free spaces some open row has
    rows_with: dict[int, deque[int]] = {}  # free space -> rows with it, oldest first
    opened = 0
    for i in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[i])
        k = bisect_left(spaces, need)
        if k < len(spaces):
            free = spaces[k]
            row = rows_with[free].popleft()
            if not rows_with[free]:
                del rows_with[free]
                spaces.pop(k)
        else:
            free, row, opened = capacity, opened, opened + 1
        row_of[i] = row
        left = free - need
        if left > 0:
            if left not in rows_with:
                rows_with[left] = deque()
                insort(spaces, left)
            rows_with[left].append(row)
    return row_of
