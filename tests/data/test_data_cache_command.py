"""``flowtrain cache``: the data cache's entries with their sizes, least recently used first, and
``--clean [--max-gb G]`` removing them, oldest use first, never a build still running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain.cli import main
from flowtrain.data.cache_entries import entries
from flowtrain.data.source import load_sequences


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "data"


def build(tmp_path: Path, name: str, rows: int) -> Path:
    """A cache entry of ``rows`` id rows read from ``name``; returns its folder."""
    path = tmp_path / name
    path.write_text("".join(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n" for _ in range(rows)))
    before = {e.path.name for e in entries()}
    load_sequences(path, seq_len=4, vocab_size=8, packing=False)
    (new,) = [e.path for e in entries() if e.path.name not in before]
    return new


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def used_at(folder: Path, when: float) -> None:
    os.utime(folder / "index.json", (when, when))


def test_the_listing_shows_each_entry_its_size_and_source_oldest_use_first(tmp_path, cache, capsys):
    small, large = build(tmp_path, "small.jsonl", 2), build(tmp_path, "large.jsonl", 50)
    used_at(small, 2_000_000_000)
    used_at(large, 1_000_000_000)
    assert main(["cache"]) == 0
    lines = capsys.readouterr().out.splitlines()
    total = folder_size(small) + folder_size(large)
    assert lines[0] == f"{cache}: 2 entries, {total / 1e3:.1f} kB, least recently used first"
    assert [line.split()[-1] for line in lines[1:]] == [str(tmp_path / "large.jsonl"), str(tmp_path / "small.jsonl")]
    assert f"{folder_size(large) / 1e3:.1f} kB" in lines[1] and "50 x 4" in lines[1] and large.name in lines[1]


def test_a_load_marks_its_entry_used(tmp_path, cache):
    folder = build(tmp_path, "d.jsonl", 3)
    used_at(folder, 1_000_000_000)
    load_sequences(tmp_path / "d.jsonl", seq_len=4, vocab_size=8, packing=False)  # a cache hit
    assert (folder / "index.json").stat().st_mtime > 1_000_000_000


def test_max_gb_removes_the_least_recently_used_until_the_rest_fit(tmp_path, cache, capsys):
    old, recent, newest = (build(tmp_path, f"{n}.jsonl", rows) for n, rows in (("old", 20), ("recent", 21), ("newest", 22)))
    for k, folder in enumerate((old, recent, newest)):
        used_at(folder, 1_000_000_000 + k)
    sizes = {folder.name: folder_size(folder) for folder in (old, recent, newest)}
    keep = sizes[recent.name] + sizes[newest.name]
    assert main(["cache", "--clean", "--max-gb", str(keep / 1e9)]) == 0
    assert sorted(p.name for p in cache.iterdir()) == sorted([recent.name, newest.name])
    assert capsys.readouterr().out.splitlines() == [
        f"removed 1 entry ({sizes[old.name] / 1e3:.1f} kB) from {cache}; 2 entries ({keep / 1e3:.1f} kB) left"]
    assert main(["cache", "--clean", "--max-gb", str((keep - 1) / 1e9)]) == 0
    assert [p.name for p in cache.iterdir()] == [newest.name]


def test_clean_removes_everything_but_a_build_still_running(tmp_path, cache, capsys):
    build(tmp_path, "a.jsonl", 2)
    build(tmp_path, "b.jsonl", 3)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = cache / f"{'0' * 32}.tmp-{int(done.stdout)}-abcd"  # its process has ended: abandoned
    running = cache / f"{'1' * 32}.tmp-{os.getpid()}-abcd"  # this process: a build under way
    for folder in (dead, running):
        folder.mkdir()
        (folder / "input_ids.bin").write_bytes(b"\0" * 64)
    assert {e.state for e in entries()} == {"ready", "abandoned", "building"}
    assert main(["cache", "--clean"]) == 0
    assert [p.name for p in cache.iterdir()] == [running.name]
    out = capsys.readouterr().out
    assert out.startswith("removed 3 entries (") and "builds still running are left alone" in out


def test_max_gb_without_clean_or_below_zero_is_one_line(tmp_path, cache, capsys):
    folder = build(tmp_path, "a.jsonl", 2)
    assert main(["cache", "--max-gb", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "flowtrain: error: --max-gb 1 removes entries only with --clean: flowtrain cache --clean --max-gb 1"]
    assert main(["cache", "--clean", "--max-gb", "-1"]) == 2
    assert "--max-gb must be a finite number >= 0 (got -1.0)" in capsys.readouterr().err
    assert folder.exists()


def test_an_empty_cache_lists_nothing(cache, capsys):
    assert main(["cache"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{cache}: 0 entries, 0 B, least recently used first"]


def test_the_cache_command_runs_without_torch(tmp_path):
    probe = ("import sys; from flowtrain.cli import main\n"
             "for argv in (['cache', '--help'], ['cache'], ['cache', '--clean']):\n"
             "    try: main(argv)\n"
             "    except SystemExit: pass\n"
             "print('torch' in sys.modules)")
    env = {**os.environ, "FLOWTRAIN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False"
    assert "--clean" in proc.stdout and "--max-gb GB" in proc.stdout
