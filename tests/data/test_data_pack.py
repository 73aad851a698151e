"""Packing fine-tuning examples into rows (flowtrain.data.pack), seen through load_sequences.

Every packed set is compared with the same file read with ``packing=False``: a packed row is a
run of whole unpacked examples (``positions == 0`` where each starts), with the same ids and
the same targets, so the loss and its denominator are unchanged.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowtrain.data.pack import best_fit_decreasing, restarting_positions
from flowtrain.data.source import load_sequences, step_batches


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def random_rows(seed: int, n: int = 40, longest: int = 14, vocab: int = 50) -> list[dict]:
    """input_ids rows of 1..longest tokens, a third of them with labels masking a prefix."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = rng.integers(0, vocab, int(rng.integers(1, longest + 1))).tolist()
        row = {"input_ids": ids}
        if i % 3 == 0:
            row["labels"] = [-100] * (len(ids) // 2) + ids[len(ids) // 2 :]
        rows.append(row)
    return rows


def runs(row_positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of restarting positions in one row."""
    starts = torch.nonzero(row_positions == 0).flatten().tolist() + [len(row_positions)]
    return [(a, b - a) for a, b in itertools.pairwise(starts)]


def test_best_fit_decreasing_places_longest_first_into_the_tightest_row():
    #            0  1  2  3  4  5
    lengths = np.array([3, 6, 2, 5, 4, 2])
    # 6 -> row 0 (free 2); 5 -> row 1 (free 3); 4 -> row 2 (free 4); 3 -> row 1 (tightest, free 0);
    # 2 (#2) -> row 0 (free 0); 2 (#5) -> row 2 (free 2)
    assert best_fit_decreasing(lengths, 8).tolist() == [1, 0, 0, 1, 2, 2]
    assert best_fit_decreasing(np.array([8, 8]), 8).tolist() == [0, 1]


def test_positions_restart_at_every_example_and_at_the_padding():
    assert restarting_positions([3, 2], 7).tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert restarting_positions([4], 4).tolist() == [0, 1, 2, 3]


def kept_lengths(rows: list[dict], seq_len: int) -> list[int]:
    """The length (cut at seq_len) of each row that has a target, in file order."""
    out = []
    for row in rows:
        labels = row.get("labels", row["input_ids"])[:seq_len]
        if any(label != -100 for label in labels[1:]):
            out.append(min(len(row["input_ids"]), seq_len))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_rows_are_whole_unpacked_examples_and_padding(tmp_path, seed):
    """layout.npy in the cache folder names (example, row, column); each packed row is exactly
    its examples, as they are unpacked (ids and targets), then one padding run."""
    rows = random_rows(seed)
    path = write_rows(tmp_path / "d.jsonl", rows)
    packed = load_sequences(path, seq_len=16, vocab_size=50)
    plain = load_sequences(path, seq_len=16, vocab_size=50, packing=False)
    assert plain.positions is None and packed.positions is not None
    assert packed.positions.dtype == torch.int64 and packed.positions.shape == packed.input_ids.shape
    assert len(packed) < len(plain)  # several examples share rows
    assert packed.num_targets() == plain.num_targets()  # the loss's denominator is unchanged

    (layout_file,) = (tmp_path / "cache").rglob("layout.npy")
    layout = np.load(layout_file)
    lengths = kept_lengths(rows, 16)
    assert sorted(layout[:, 0].tolist()) == list(range(len(plain)))  # each example once
    for r in range(len(packed)):
        mine = sorted((c, e) for e, row, c in layout.tolist() if row == r)
        expected_runs = [(c, lengths[e]) for c, e in mine]
        used = sum(n for _, n in expected_runs)
        if used < 16:
            expected_runs.append((used, 16 - used))  # the padding's own run
            assert (packed.targets[r, used:] == -100).all() and (packed.input_ids[r, used:] == 0).all()
        assert runs(packed.positions[r]) == expected_runs  # restarts exactly at example starts
        for c, e in mine:
            n = lengths[e]
            assert packed.input_ids[r, c : c + n].tolist() == plain.input_ids[e, :n].tolist()
            assert packed.targets[r, c : c + n].tolist() == plain.targets[e, :n].tolist()
            assert packed.targets[r, c + n - 1] == -100  # the last token predicts nothing


def test_a_small_hand_checked_packing(tmp_path):
    rows = [{"input_ids": [1, 5, 9]}, {"input_ids": [1, 7, 3, 2]}, {"input_ids": [1, 4]}]
    seqs = load_sequences(write_rows(tmp_path / "d.jsonl", rows), seq_len=8, vocab_size=10, pad_id=0)
    # longest first: [1 7 3 2] opens row 0, [1 5 9] joins it (free 1 left), [1 4] opens row 1;
    # within a row the examples keep file order
    assert seqs.input_ids.tolist() == [[1, 5, 9, 1, 7, 3, 2, 0], [1, 4, 0, 0, 0, 0, 0, 0]]
    assert seqs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert seqs.targets.tolist() == [[5, 9, -100, 7, 3, 2, -100, -100], [4, -100, -100, -100, -100, -100, -100, -100]]
    assert seqs.num_targets() == 2 + 3 + 1


def test_an_example_longer_than_seq_len_is_cut_and_gets_a_row_alone(tmp_path):
    rows = [{"input_ids": list(range(1, 21))}, {"input_ids": [3, 4]}, {"input_ids": [5, 6, 7]}]
    seqs = load_sequences(write_rows(tmp_path / "d.jsonl", rows), seq_len=8, vocab_size=30)
    assert seqs.input_ids[0].tolist() == list(range(1, 9))
    assert seqs.positions[0].tolist() == list(range(8))
    assert seqs.targets[0].tolist() == list(range(2, 9)) + [-100]
    assert seqs.input_ids[1].tolist() == [3, 4, 5, 6, 7, 0, 0, 0]


def test_packing_is_deterministic(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", random_rows(3))
    a = load_sequences(path, seq_len=16, vocab_size=50, cache_dir=tmp_path / "a")
    b = load_sequences(path, seq_len=16, vocab_size=50, cache_dir=tmp_path / "b")
    for x, y in [(a.input_ids, b.input_ids), (a.targets, b.targets), (a.positions, b.positions)]:
        assert torch.equal(x, y)
    assert a.fingerprint() == b.fingerprint()


def test_no_packing_keeps_one_example_per_row_as_before(tmp_path):
    rows = [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [4, 5, 6]}, {"input_ids": [7]}]
    seqs = load_sequences(write_rows(tmp_path / "d.jsonl", rows), seq_len=4, vocab_size=10, packing=False)
    assert seqs.positions is None
    assert seqs.input_ids.tolist() == [[1, 2, 3, 4], [4, 5, 6, 0]]
    assert seqs.targets.tolist() == [[2, 3, 4, -100], [5, 6, -100, -100]]


def test_token_streams_are_never_packed(tmp_path):
    (tmp_path / "d.txt").write_text("hello there, a stream of text")
    stream = load_sequences(tmp_path / "d.txt", seq_len=8, vocab_size=256)
    assert stream.positions is None
    np.save(tmp_path / "d.npy", np.arange(40, dtype=np.int32))
    assert load_sequences(tmp_path / "d.npy", seq_len=8, vocab_size=64).positions is None


def test_batches_and_micro_batches_carry_the_positions_of_their_rows(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", random_rows(5, n=60))
    seqs = load_sequences(path, seq_len=16, vocab_size=50)
    batch = next(step_batches(seqs, 4, shuffle=True, seed=1))
    rows = [next(i for i in range(len(seqs)) if torch.equal(seqs.input_ids[i], r)) for r in batch.input_ids]
    assert torch.equal(batch.positions, seqs.positions[rows])
    micro = batch.micro_batches(2)
    assert torch.equal(torch.cat([m.positions for m in micro]), batch.positions)
    assert sum(m.num_targets() for m in micro) == batch.num_targets()
    plain = next(step_batches(load_sequences(path, seq_len=16, vocab_size=50, packing=False), 4,
                              shuffle=False, seed=0))
    assert plain.positions is None and all(m.positions is None for m in plain.micro_batches(2))
