"""One row's memory is bounded: a ``.jsonl`` line over ``MAX_LINE_BYTES`` is refused before it
is parsed, naming its file, line and size, and text is tokenised in pieces of at most
``2 * CHUNK_CHARS`` characters, so a long text row (or a ``.txt`` of one long line) costs the
memory of a piece, not of the whole.

The command-line test measures the peak resident memory of a real ``flowtrain train`` on a
30 MB line against the same command on a one-line file refused at the same place; memory is
measured, never time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain.data import files as data_files
from flowtrain.data import text as data_text
from flowtrain.data.files import MAX_LINE_BYTES, read_jsonl
from flowtrain.data.source import load_sequences
from flowtrain.data.text import ByteEncoder
from flowtrain.errors import DataError


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def drain(path: Path) -> list:
    return list(read_jsonl(path, 256, lambda: ByteEncoder(None)).pieces)


# --- the line limit ------------------------------------------------------------------------


def test_a_line_over_the_limit_is_refused_unparsed_naming_file_line_and_size(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_LINE_BYTES", 100)
    ok = '{"text": "%s"}' % ("a" * 88)  # 100 bytes
    assert len(ok) == 100
    path = tmp_path / "d.jsonl"
    path.write_text(ok + "\n" + ok)  # at the limit, with and without a newline: read
    assert len(drain(path)) == 2
    too_long = "{" + "x" * 250  # not JSON either: refused for its size, before any parsing
    path.write_text(ok + "\n\n" + too_long + "\n" + ok + "\n")
    with pytest.raises(DataError) as info:
        drain(path)
    assert str(info.value) == (
        f"{path} line 3 has 252 bytes, more than the 100 bytes one row may have (a row is read whole); split it into "
        "rows of a few MB (a long text into several text rows, or into a .txt file of its own, which is read in "
        "pieces)")
    path.write_text(ok + "\n" + too_long)  # the last line, without a newline
    with pytest.raises(DataError, match=r"line 2 has 251 bytes"):
        drain(path)


def test_the_limit_leaves_room_for_a_long_fine_tuning_example():
    # 16 MiB: 2 M token ids of 6 digits (", " between) plus their labels, or 4 M tokens of text
    assert MAX_LINE_BYTES == 16 << 20
    assert len(json.dumps({"input_ids": [151_643] * 1_000_000, "labels": [151_643] * 1_000_000})) < MAX_LINE_BYTES


MEASURE = """
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": proc.returncode, "stderr": proc.stderr,
                  "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def peak_of_train(data: Path, out: Path) -> dict:
    """``flowtrain train --data data`` in a fresh process of its own: its exit status, stderr and
    peak resident bytes (the wrapper waits for it alone, so RUSAGE_CHILDREN is its peak)."""
    env = {k: v for k, v in os.environ.items() if k != "FLOWTRAIN_DEBUG"}  # it would show tracebacks
    cmd = [sys.executable, "-c", MEASURE, sys.executable, "-m", "flowtrain", "train", "--no-progress",
           "--steps", "1", "--data", str(data), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)  # a hang guard only
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_30_mb_line_costs_little_memory_and_ends_in_one_line(tmp_path):
    size = 30_000_000
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        f.write('{"text": "' + "word " * ((size - 12) // 5) + '"}\n')
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": 5}\n')  # refused where the big line is, after the same start-up
    base = peak_of_train(small, tmp_path / "out")
    run = peak_of_train(big, tmp_path / "out")
    for result in base, run:
        assert result["rc"] == 2
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"][-2000:]
    assert run["stderr"].startswith(f"flowtrain: error: {big} line 1 has {big.stat().st_size:,} bytes, more than")
    assert run["peak"] - base["peak"] <= 12 * big.stat().st_size, (run["peak"], base["peak"])
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache" / "data").exists() or not list((tmp_path / "cache" / "data").iterdir())


# --- long text in pieces -------------------------------------------------------------------


def test_one_long_line_of_text_is_cut_into_bounded_pieces_however_it_is_read(monkeypatch):
    monkeypatch.setattr(data_text, "CHUNK_CHARS", 64)
    text = " ".join(f"w{i}" for i in range(400))  # 1,889 characters, no newline
    pieces = list(data_text.split_stream([text]))
    assert "".join(pieces) == text
    assert all(len(p) <= 2 * 64 for p in pieces) and len(pieces) > 10
    assert all(p.startswith(" ") for p in pieces[1:])  # cut before a word's space
    blocks = [text[i : i + 7] for i in range(0, len(text), 7)]
    assert list(data_text.split_stream(blocks)) == pieces  # the same cuts, however the text arrives
    solid = "x" * 300  # no space either: cut at 2 * CHUNK_CHARS
    assert [len(p) for p in data_text.split_stream([solid])] == [128, 128, 44]
    lines = "a line\n" * 40  # lines: cut where one starts, as before
    pieces = list(data_text.split_stream([lines]))
    assert len(pieces) > 1 and all(p.endswith("\n") for p in pieces) and "".join(pieces) == lines


def test_a_long_text_row_is_tokenised_in_pieces_as_the_same_text_in_a_txt_file(tmp_path, monkeypatch):
    monkeypatch.setattr(data_text, "CHUNK_CHARS", 64)
    longest = []

    class Recording(ByteEncoder):
        def encode_many(self, texts):
            longest.append(max(map(len, texts), default=0))
            return super().encode_many(texts)

        def encode_bare(self, texts):
            longest.append(max(map(len, texts), default=0))
            return super().encode_bare(texts)

    monkeypatch.setattr("flowtrain.data.source.make_encoder", lambda *a, **k: Recording(2))
    text = " ".join(f"w{i}" for i in range(400))
    rows = tmp_path / "d.jsonl"
    rows.write_text(json.dumps({"text": "short one"}) + "\n" + json.dumps({"text": text}) + "\n")
    doc = tmp_path / "d.txt"
    doc.write_text(text)
    from_rows = load_sequences(rows, seq_len=16, vocab_size=256)
    assert max(longest) <= 2 * 64
    from_txt = load_sequences(doc, seq_len=16, vocab_size=256)
    want = list(b"short one") + [2] + list(text.encode())
    got = from_rows.input_ids.flatten().tolist()
    assert got[: len(want)] == want  # the pieces join into the row's bytes, EOS between the rows
    full = len(text) // 16 * 16  # the .txt's full windows (a 1-token tail predicts nothing)
    assert from_txt.input_ids.flatten().tolist()[:full] == list(text.encode())[:full]


def test_a_batch_of_rows_is_bounded_in_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "_ENCODE_BATCH_BYTES", 1000)
    batches = []

    class Recording(ByteEncoder):
        def encode_bare(self, texts):
            batches.append(sum(map(len, texts)))
            return super().encode_bare(texts)

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p" * 300, "completion": "c" * 100}) + "\n" for _ in range(20)))
    pieces = list(read_jsonl(path, 256, lambda: Recording(None)).pieces)
    assert len(pieces) == 20
    assert max(batches) <= 1000 and len(batches) > 2  # prompts and completions of a few rows at a time


def test_the_tokenizer_encodes_a_long_text_in_pieces_with_the_ids_and_offsets_of_one_call(tmp_path, monkeypatch):
    from test_data import make_tokenizer

    from flowtrain.data.text import TokenizerEncoder

    make_tokenizer(tmp_path / "model")
    enc = TokenizerEncoder(tmp_path / "model" / "tokenizer.json", None)
    text = " ".join(["the cat sat on a mat"] * 40)  # 819 characters, one line
    whole = enc._tokenizer.encode(text, add_special_tokens=False)
    seen = []

    class Recording:  # the tokenizer, recording the longest text each call hands it
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def encode_batch(self, texts, add_special_tokens):
            seen.append(max(map(len, texts), default=0))
            return self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(data_text, "CHUNK_CHARS", 64)
    enc._tokenizer = Recording(enc._tokenizer)
    ids, offsets = enc.encode_offsets(text)
    assert ids.tolist() == whole.ids and offsets.tolist() == [list(o) for o in whole.offsets]
    assert [a.tolist() for a in enc.encode_bare(["a cat", text])] == [enc.encode_bare(["a cat"])[0].tolist(), whole.ids]
    assert enc.encode_document(text).tolist() == [1, *whole.ids]  # the template's <s> once, in front
    assert max(seen) <= 2 * 64


def test_running_out_of_memory_while_reading_is_one_data_error_and_no_cache(tmp_path, monkeypatch):
    from flowtrain.data import pack as data_pack

    def no_memory(*args, **kwargs):
        raise MemoryError  # what numpy raises when a limit (ulimit -v, a container) refuses an array

    monkeypatch.setattr(data_pack, "stream_rows", no_memory)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "some text"}) + "\n")
    with pytest.raises(DataError) as info:
        load_sequences(path, seq_len=4, vocab_size=256)
    assert str(info.value) == (f"ran out of memory reading {path} into token rows; give the run more memory, or "
                               "split its longest rows (docs/training.md, \"How long a row may be\")")
    assert not list((tmp_path / "cache" / "data").iterdir())  # the half-built folder is gone
