"""How ``flowtrain`` ends on an error: one line on stderr and an exit status saying whose fault
it is (2 the input, 1 the system, 130 interrupted), no traceback unless FLOWTRAIN_DEBUG=1."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from flowtrain.cli import graph as graph_cli
from flowtrain.cli import main
from flowtrain.errors import ConfigError


def run_flowtrain(*args, env=None):
    env = env or {k: v for k, v in os.environ.items() if k != "FLOWTRAIN_DEBUG"}
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("exc, status, line", [
    (ConfigError("--lr must be a finite number >= 0 (got nan)"), 2,
     "flowtrain: error: --lr must be a finite number >= 0 (got nan)"),
    (ValueError("bad value\n  second line"), 2,
     "flowtrain: error: ValueError: bad value second line (set FLOWTRAIN_DEBUG=1 to see the traceback)"),
    (OSError(errno.ENOSPC, "No space left on device", "/out/model.safetensors"), 1,
     "flowtrain: error: No space left on device: /out/model.safetensors (set FLOWTRAIN_DEBUG=1 to see the traceback)"),
    (PermissionError("no permission"), 1,
     "flowtrain: error: PermissionError: no permission (set FLOWTRAIN_DEBUG=1 to see the traceback)"),
    (KeyboardInterrupt(), 130, "flowtrain: interrupted"),
])
def test_an_error_ends_as_one_line_and_a_status(monkeypatch, capsys, exc, status, line):
    def run(args):
        raise exc

    monkeypatch.delenv("FLOWTRAIN_DEBUG", raising=False)
    monkeypatch.setattr(graph_cli, "run", run)
    assert main(["graph", "--layers", "1", "--out", "unused.json"]) == status
    assert capsys.readouterr().err.splitlines() == [line]


def test_flowtrain_debug_lets_the_exception_through(monkeypatch):
    def run(args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setenv("FLOWTRAIN_DEBUG", "1")
    monkeypatch.setattr(graph_cli, "run", run)
    with pytest.raises(OSError, match="I/O error"):
        main(["graph", "--layers", "1", "--out", "unused.json"])


def test_a_real_os_error_exits_1_in_one_line(tmp_path):
    proc = run_flowtrain("graph", "--layers", "1", "--out", str(tmp_path))  # --out names a folder
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"flowtrain: error: Is a directory: {tmp_path} (set FLOWTRAIN_DEBUG=1 to see the traceback)"]


def test_flowtrain_debug_shows_the_traceback(tmp_path):
    args = ("train", "--no-progress", "--lr", "nan", "--out", str(tmp_path / "out"))
    proc = run_flowtrain(*args, env={**os.environ, "FLOWTRAIN_DEBUG": "1"})
    assert proc.returncode == 1  # Python's own status for an uncaught exception
    # the exception itself names the field, as the Python API spells it
    assert "Traceback" in proc.stderr and "ConfigError: lr must be a finite number >= 0 (got nan)" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["simulate", "--model", "tiny", "--seq-len", "64", "--batch-size", "2",
                                      "--micro-batch-size", "1", "--machine", "h200"],
                                     ["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "2"]])
def test_a_reader_that_stops_early_is_no_error(command):
    """``flowtrain simulate ... | head -1``: the reader closed the pipe before the output was
    written; the command ends quietly with status 0 (the pipe is closed here before the child
    writes anything, so the child always meets it)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "flowtrain.cli", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and err == "", err
