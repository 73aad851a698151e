"""``flowtrain viz`` writes what it is asked for and nothing else, in the working directory too.

``--png FILE`` alone once wrote ``report.html`` beside the picture as well (``--out``'s default):
a file nobody asked for, in whatever folder the command ran. Now ``--png`` alone writes the
picture, ``--out`` alone (or neither) the report, and both write both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "viz"))
from viz_helpers import engine_trace_file

from flowtrain.cli import main

pytest.importorskip("matplotlib")


@pytest.fixture
def trace(tmp_path, monkeypatch):
    """A real engine trace, and a fresh working directory holding nothing else."""
    path = engine_trace_file(tmp_path / "trace.json", policy="double_buffer", layers=2, steps=2)
    monkeypatch.chdir(tmp_path)
    return path


def files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_png_alone_writes_only_the_png(trace, tmp_path, capsys):
    assert main(["viz", "trace.json", "--png", "out.png"]) == 0
    assert files(tmp_path) == {"trace.json", "out.png"}
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "wrote out.png" in printed and "report.html" not in printed
    assert "step time" in printed  # the trace's summary is printed all the same


@pytest.mark.parametrize("args, written", [
    ([], {"report.html"}),
    (["--out", "r.html"], {"r.html"}),
    (["--out", "r.html", "--png", "p.png"], {"r.html", "p.png"}),
])
def test_the_report_is_written_where_asked_and_by_default(trace, tmp_path, args, written):
    assert main(["viz", "trace.json", *args]) == 0
    assert files(tmp_path) == {"trace.json", *written}
