"""A data cache changed on disk (same size, other tokens) is caught by its checksums and rebuilt
from the ``--data`` file, never trained on; a resume then continues on the true data.

Before checksums, a cache folder was trusted if its files had the right sizes, and a resume
compared the fingerprint stored in its index, not the rows: a corrupted cache was trained on
and resumed from without a word.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowtrain.data.source import load_sequences
from flowtrain.errors import DataError


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(root))
    return root / "data"


def rows_file(cache: Path, name: str) -> np.memmap:
    (folder,) = cache.iterdir()
    index = json.loads((folder / "index.json").read_text())
    return np.memmap(folder / f"{name}.bin", dtype=np.int64, mode="r+", shape=(index["rows"], index["seq_len"]))


def corrupt(cache: Path, name: str) -> None:
    """Change tokens in place, keeping the file's size: every token moves on by one place."""
    arr = rows_file(cache, name)
    before = arr.copy()
    arr[:] = np.roll(before.reshape(-1), 1).reshape(before.shape)
    arr.flush()
    assert not np.array_equal(before, np.asarray(arr))


@pytest.mark.parametrize("name", ["input_ids", "targets", "positions"])
def test_a_file_changed_in_place_is_detected_and_rebuilt(tmp_path, cache, capsys, name):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, n))}) + "\n" for n in range(3, 12)))
    first = load_sequences(path, seq_len=6, vocab_size=20)
    want = [t.clone() for t in (first.input_ids, first.targets, first.positions)]
    fp = first.fingerprint()
    del first  # let go of the mapping before the file changes under it
    (folder,) = cache.iterdir()
    size = (folder / f"{name}.bin").stat().st_size
    corrupt(cache, name)
    assert (folder / f"{name}.bin").stat().st_size == size
    capsys.readouterr()
    again = load_sequences(path, seq_len=6, vocab_size=20)
    err = capsys.readouterr().err
    assert f"({name}.bin does not match its checksum); rebuilding it from {path}" in err
    assert len(err.strip().splitlines()) == 1
    for a, b in zip(want, (again.input_ids, again.targets, again.positions)):
        assert torch.equal(a, b)
    assert again.fingerprint() == fp
    capsys.readouterr()
    load_sequences(path, seq_len=6, vocab_size=20)  # rebuilt: trusted again, silently
    assert capsys.readouterr().err == ""


def test_without_its_source_a_cache_is_not_used(tmp_path, cache):
    """The cache is keyed by the data file's bytes: with the file gone there is nothing to
    check it against or rebuild it from, so the run is refused in one line."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    load_sequences(path, seq_len=4, vocab_size=10)
    corrupt(cache, "input_ids")
    path.unlink()
    with pytest.raises(DataError, match="data file .*d.jsonl does not exist"):
        load_sequences(path, seq_len=4, vocab_size=10)


@pytest.mark.slow  # a whole run in a subprocess: the slow tier
def test_a_resume_on_a_corrupted_cache_continues_on_the_true_data(tmp_path):
    """Through the command line: 4 steps straight, against 2 steps, the cache corrupted, and a
    resume for 2 more. The resume must notice, rebuild, and end with the same weights."""
    data = tmp_path / "d.txt"
    data.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}\n" for i in range(300)))
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWTRAIN_DEBUG", "FLOWTRAIN_FAULT")}
    env["FLOWTRAIN_CACHE"] = str(tmp_path / "cache")

    def train(*args):
        proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--model", "tiny", "--batch-size", "4",
                               "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu", "--no-progress",
                               "--data", str(data), *args], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc

    a = tmp_path / "a"
    train("--steps", "4", "--save-every", "2", "--out", str(a))
    corrupt(tmp_path / "cache" / "data", "input_ids")
    b = tmp_path / "b"
    proc = train("--steps", "4", "--resume", str(a / "checkpoint-2"), "--out", str(b))
    want, got = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert "does not match its checksum" in proc.stderr, proc.stderr
