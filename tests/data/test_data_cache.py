"""The data cache (flowtrain.data.cache): tokenise once, map afterwards, never trust half."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

from flowtrain.data import files as data_files
from flowtrain.data import source as data
from flowtrain.data import text as data_text
from flowtrain.data.source import load_sequences
from flowtrain.errors import DataError


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(root))
    return root / "data"


def folders(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_the_second_load_maps_the_cache_without_tokenising(tmp_path, cache, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "a" * i}) + "\n" for i in range(20)))
    first = load_sequences(path, seq_len=16, vocab_size=256)

    def refuse(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(data, "make_encoder", refuse)
    second = load_sequences(path, seq_len=16, vocab_size=256)
    for a, b in [(first.input_ids, second.input_ids), (first.targets, second.targets),
                 (first.positions, second.positions)]:
        assert torch.equal(a, b)
    assert len(folders(cache)) == 1
    (folder,) = cache.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "index.json", "input_ids.bin", "layout.npy", "positions.bin", "targets.bin"]
    assert os.path.getsize(folder / "input_ids.bin") == len(second) * 16 * 8


def test_every_setting_and_the_content_pick_their_own_folder(tmp_path, cache):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    load_sequences(path, seq_len=4, vocab_size=10)
    load_sequences(path, seq_len=4, vocab_size=10)
    assert len(folders(cache)) == 1
    load_sequences(path, seq_len=5, vocab_size=10)
    load_sequences(path, seq_len=4, vocab_size=10, packing=False)
    load_sequences(path, seq_len=4, vocab_size=10, pad_id=9)
    assert len(folders(cache)) == 4
    path.write_text(json.dumps({"input_ids": [1, 2, 4]}) + "\n")  # same name, new content
    assert load_sequences(path, seq_len=4, vocab_size=10).input_ids[0, :3].tolist() == [1, 2, 4]
    assert len(folders(cache)) == 5


def test_a_bad_row_late_in_the_file_leaves_no_cache_behind(tmp_path, cache):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"input_ids": [1, 2, 3]})] * 3000 + [json.dumps({"input_ids": [1, 99]})]
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl line 3001: token id 99 at position 1"):
        load_sequences(path, seq_len=4, vocab_size=10)
    assert folders(cache) == []  # nothing half-built is kept, nor trusted later


def test_a_killed_build_and_a_broken_folder_are_not_trusted(tmp_path, cache):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    want = load_sequences(path, seq_len=4, vocab_size=10).input_ids.clone()
    (folder,) = cache.iterdir()
    with open(folder / "targets.bin", "r+b") as f:  # a truncated file: rebuilt, not read
        f.truncate(8)
    abandoned = cache / f"{folder.name}.tmp-{2**22 + 12345}-0000"  # a pid that is not running
    abandoned.mkdir()
    seqs = load_sequences(path, seq_len=4, vocab_size=10)
    assert torch.equal(seqs.input_ids, want) and seqs.targets.tolist() == [[2, 3, -100, -100]]
    assert folders(cache) == [folder.name]


def test_an_unwritable_cache_says_how_to_move_it(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(blocker))
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(DataError, match="cannot write the data cache in .*; set FLOWTRAIN_CACHE"):
        load_sequences(path, seq_len=4, vocab_size=10)


def test_a_cached_text_load_still_refuses_a_folder_without_tokenizer(tmp_path, cache):
    path = tmp_path / "d.txt"
    path.write_text("hello there")
    load_sequences(path, seq_len=4, vocab_size=256, tokenizer_dir=tmp_path, byte_tokenizer=True)
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_sequences(path, seq_len=4, vocab_size=256, tokenizer_dir=tmp_path)


def _checkpoint_hash(*tensors):
    """The data hash checkpoints have recorded since resume existed: sha256 over each
    tensor's shape and bytes, 32 hex digits. Unpacked data must keep it, so old checkpoints
    still resume."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def test_the_fingerprint_is_resumes_and_comes_from_the_index(tmp_path, cache):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, n))}) + "\n" for n in range(3, 12)))
    plain = load_sequences(path, seq_len=6, vocab_size=20, packing=False)
    assert plain.fingerprint() == _checkpoint_hash(plain.input_ids, plain.targets)
    packed = load_sequences(path, seq_len=6, vocab_size=20)
    fresh = data.Sequences(packed.input_ids.clone(), packed.targets.clone(), packed.positions.clone())
    assert packed.fingerprint() == fresh.fingerprint() != plain.fingerprint()


def test_long_text_streams_in_blocks_and_gives_what_one_read_gives(tmp_path, cache, monkeypatch):
    text = "".join(f"line {i} é ü\n" + ("\n" if i % 7 == 0 else "") for i in range(400))
    path = tmp_path / "d.txt"
    path.write_text(text, encoding="utf-8")
    whole = load_sequences(path, seq_len=64, vocab_size=256).input_ids.flatten().tolist()
    monkeypatch.setattr(data_files, "_READ_BYTES", 7)  # blocks cut inside characters
    monkeypatch.setattr(data_text, "CHUNK_CHARS", 50)
    pieces = load_sequences(path, seq_len=64, vocab_size=256).input_ids.flatten().tolist()
    assert pieces == whole and bytes(whole[: len(text.encode())]) == text.encode()


def test_a_bad_utf8_byte_is_named_by_its_offset_across_blocks(tmp_path, cache, monkeypatch):
    path = tmp_path / "d.txt"
    path.write_bytes("abcé".encode() * 10 + b"\xff tail")
    monkeypatch.setattr(data_files, "_READ_BYTES", 3)
    with pytest.raises(DataError, match=r"bad byte at offset 50\)"):
        load_sequences(path, seq_len=4, vocab_size=256)


def test_a_large_npy_stream_is_read_in_chunks(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(data_files, "_NPY_CHUNK", 10)
    ids = np.arange(95, dtype=np.int32) % 50
    np.save(tmp_path / "d.npy", ids)
    seqs = load_sequences(tmp_path / "d.npy", seq_len=8, vocab_size=50)
    assert seqs.input_ids.flatten()[:95].tolist() == ids.tolist() and len(seqs) == 12
    bad = ids.copy()
    bad[37] = 70
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(DataError, match="token id 70 at position 37"):
        load_sequences(tmp_path / "bad.npy", seq_len=8, vocab_size=50)
