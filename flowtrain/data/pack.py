"""From pieces to rows: token streams cut into windows, examples padded or packed.

Each function draws :class:`~flowtrain.data.files.Piece` s from a reader and appends
``(r, seq_len)`` int64 blocks to a :class:`~flowtrain.data.cache.RowWriter`, so only a
block of rows is in memory at a time. The target of position ``t`` is the label of ``t + 1``
within the same example (see :mod:`flowtrain.data.source`).

**Packing** (:func:`packed_rows`). Short fine-tuning examples share a row::

    examples   a=[1 5 9]  b=[1 7 3 2]  c=[1 4]            (seq_len 8)
    input_ids  [ 1  5  9  1  7  3  2 pad ]  [ 1  4 pad pad pad pad pad pad ]
    positions  [ 0  1  2  0  1  2  3  0  ]  [ 0  1  0   1   2   3   4   5  ]
    targets    [ 5  9 -100 7 3  2 -100 -100 ] ...           (a's last token predicts nothing)

An example is never split: one longer than seq_len is cut at seq_len (as without packing) and
fills a row alone. Rows are filled *best fit decreasing*: examples are taken longest first
(equal lengths in file order), each goes into the row with the least free space that still
holds it (equal space: the row that reached it first), else into a new row; within a row the
examples keep file order. Deterministic: the same file gives the same rows. Positions restart
at 0 at every example start and at the start of the padding, so ``positions == 0`` marks every
boundary; the model masks attention between the runs.
"""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from flowtrain.data.cache import RowWriter
from flowtrain.data.files import IGNORE_INDEX, Piece
from flowtrain.errors import DataError

__all__ = ["best_fit_decreasing", "packed_rows", "plain_rows", "restarting_positions", "stream_rows"]

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


def _examples(pieces: Iterable[Piece], seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each row cut at seq_len, with its own targets (``labels[t + 1]``, the last -100); rows
    without a single target (under 2 tokens, or no loss after the first) are dropped."""
    for piece in pieces:
        ids = piece.ids[:seq_len]
        labels = (piece.labels if piece.labels is not None else piece.ids)[:seq_len]
        targets = np.full_like(ids, IGNORE_INDEX)
        targets[:-1] = labels[1:]
        if (targets != IGNORE_INDEX).any():
            yield ids, targets


def _no_rows(path: Path, seq_len: int) -> DataError:
    return DataError(
        f"{path} has no usable sequences: every one has fewer than 2 tokens or no token "
        f"with a loss within the first --seq-len {seq_len}, and predicting a next token "
        "needs at least 2"
    )


def plain_rows(path: Path, pieces: Iterable[Piece], seq_len: int, pad_id: int, out: RowWriter) -> None:
    """One row per example, right-padded (``--no-packing``), assembled a block at a time."""
    block = max(1, _BLOCK_TOKENS // seq_len)
    ids = np.full((block, seq_len), pad_id, dtype=np.int64)
    targets = np.full((block, seq_len), IGNORE_INDEX, dtype=np.int64)
    filled = 0
    for example, example_targets in _examples(pieces, seq_len):
        ids[filled, : len(example)], targets[filled, : len(example)] = example, example_targets
        filled += 1
        if filled == block:
            out.add(ids, targets)
            ids = np.full((block, seq_len), pad_id, dtype=np.int64)
            targets = np.full((block, seq_len), IGNORE_INDEX, dtype=np.int64)
            filled = 0
    if filled:
        out.add(ids[:filled], targets[:filled])
    if out.num_rows == 0:
        raise _no_rows(path, seq_len)


def packed_rows(path: Path, pieces: Iterable[Piece], seq_len: int, pad_id: int, out: RowWriter,
                scratch: Path) -> np.ndarray:
    """Examples packed into rows (see the module); returns the layout, ``(n, 3)`` int64 of
    (example, row, column) in row order, ``example`` counting the examples that have a target."""
    files = [scratch / "examples.ids", scratch / "examples.targets"]
    lengths: list[int] = []
    with files[0].open("wb") as f_ids, files[1].open("wb") as f_targets:
        for ids, targets in _examples(pieces, seq_len):  # pass 1: examples to scratch files
            f_ids.write(ids.tobytes())
            f_targets.write(targets.tobytes())
            lengths.append(len(ids))
    if not lengths:
        raise _no_rows(path, seq_len)
    sizes = np.array(lengths, dtype=np.int64)
    row_of = best_fit_decreasing(sizes, seq_len)  # pass 2: the layout
    order = np.lexsort((np.arange(len(sizes)), row_of))  # by row, then file order
    starts = np.cumsum(sizes) - sizes
    column = np.zeros(len(sizes), dtype=np.int64)
    in_row = np.cumsum(sizes[order]) - sizes[order]
    first = np.searchsorted(row_of[order], row_of[order])  # each row's first entry in order
    column[order] = in_row - in_row[first]
    try:
        _write_packed(files, order, row_of, sizes, starts, column, seq_len, pad_id, out)
    finally:
        for file in files:
            file.unlink()
    return np.stack([order, row_of[order], column[order]], axis=1)


def _write_packed(files, order, row_of, sizes, starts, column, seq_len, pad_id, out) -> None:
    """Pass 3: rows assembled a block at a time from the scratch files (one read per example)."""
    fds = [os.open(f, os.O_RDONLY) for f in files]
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
                    ids[r - r0, c : c + n] = _pread(fds[0], starts[e], n)
                    targets[r - r0, c : c + n] = _pread(fds[1], starts[e], n)
                    runs.append(n)
                run_lengths.append(runs)
            out.add(ids, targets, np.stack([restarting_positions(runs, seq_len) for runs in run_lengths]))
    finally:
        for fd in fds:
            os.close(fd)


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
