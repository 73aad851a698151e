"""The ``--metrics`` file: one run at a time, and a resume continues it without repeating steps.

- A second run naming the file a running run writes is refused in one line and touches nothing
  (it once truncated the file while the first wrote on at its old offset: lost steps, and a line
  of NUL bytes that ``json.loads`` refuses).
- A run resumed from ``checkpoint-N`` onto the same file first drops the lines of later steps
  (those a killed run wrote past its last checkpoint) and a line a kill cut short, so every step
  is on one line, once.

The tests that race two processes wait on events (a line in ``--metrics``, a checkpoint's
manifest), never on guessed durations.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import test_signals as signals

sys.path.insert(0, str(Path(__file__).parents[1] / "ckpt"))
from test_out_folder import wait_for

from flowtrain.cli import main
from flowtrain.errors import ConfigError
from flowtrain.train.metrics_file import MetricsFile, check_metrics_free, kept_lines

TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--micro-batch-size", "1", "--device", "cpu",
        "--no-progress", "--lr-schedule", "constant"]


def start(*args, env=None):
    return signals.start(*args, env=env, argv=TINY)


def train(*args):
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", *TINY, *args],
                          env=signals.start_env(), capture_output=True, text=True, timeout=300)


def steps(path) -> list[int]:
    """The step of every line (each must parse), held-out loss lines left out."""
    return [d["step"] for d in map(json.loads, path.read_text().splitlines()) if "eval_loss" not in d]


def lines_up_to(path, step):
    return path.exists() and any(json.loads(x).get("step") == step for x in path.read_text().splitlines()
                                 if x.endswith("}"))


def test_two_writers_on_one_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n')
    with MetricsFile(path, resumed_at=1) as first:
        first.file.write('{"step": 2}\n')
        first.file.flush()
        with pytest.raises(ConfigError, match="is in use by another flowtrain run"):
            check_metrics_free(path)
        with pytest.raises(ConfigError, match="is in use by another flowtrain run"):
            MetricsFile(tmp_path / "." / "m.jsonl")  # another spelling of it: still the same file
        link = tmp_path / "link.jsonl"
        link.symlink_to(path)
        with pytest.raises(ConfigError, match="is in use"):
            MetricsFile(link)
        first.file.write('{"step": 3}\n')
    assert steps(path) == [1, 2, 3]  # the refused writers truncated nothing
    with MetricsFile(path, resumed_at=2) as again:  # free once the first closed it
        again.file.write('{"step": 3, "loss": 1.0}\n')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3, "loss": 1.0}\n'


def test_a_device_is_written_as_it_is():
    """``--metrics /dev/null`` (or a pipe) is neither locked nor emptied: two runs may share it."""
    with MetricsFile(os.devnull) as a, MetricsFile(os.devnull, resumed_at=3) as b:
        a.file.write('{"step": 1}\n')
        b.file.write('{"step": 4}\n')


def test_a_resume_rewrites_the_file_and_the_lock_follows(tmp_path):
    """Dropping lines renames a locked copy over the file: a writer that opened the old file
    finds the path moved on and meets the lock there."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    os.chmod(path, 0o640)
    stale = os.open(path, os.O_RDONLY)  # a second run that opened the file just before the rewrite
    try:
        with MetricsFile(path, resumed_at=2) as held:
            assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and (os.stat(path).st_mode & 0o777) == 0o640
            with pytest.raises(ConfigError, match="is in use"):
                MetricsFile(path)
            # the old file's lock is free, but it is no longer the file at the path: a run that
            # locks it looks again (lock_file) and meets the lock above
            fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert not os.path.samestat(os.fstat(stale), os.stat(path))
            held.file.write('{"step": 3}\n')
    finally:
        os.close(stale)
    assert steps(path) == [1, 2, 3] and [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]


def test_kept_lines():
    text = (b'{"step": 1, "loss": 2.0}\n{"step": 1, "eval_loss": 2.0, "eval_tokens": 8}\n{"step": 2}\n'
            b'\x00\x00\x00\n{"step": 3}\n{"step": 2, "lo')
    assert kept_lines(text, 1) == b'{"step": 1, "loss": 2.0}\n{"step": 1, "eval_loss": 2.0, "eval_tokens": 8}\n'
    assert kept_lines(text, 3) == b'{"step": 1, "loss": 2.0}\n{"step": 1, "eval_loss": 2.0, "eval_tokens": 8}\n' \
        b'{"step": 2}\n{"step": 3}\n'


def test_a_second_run_on_a_metrics_file_in_use_is_refused(tmp_path):
    """A real first run blocks in step 2's Adam (an injected hang) after its step 1 line; a
    second run with the same --metrics (its own --out) is refused in one line, and the file
    keeps nothing but whole lines of the first run."""
    metrics = tmp_path / "m.jsonl"
    first = start("--steps", "50", "--out", str(tmp_path / "a"), "--metrics", str(metrics),
                  env={"FLOWTRAIN_FAULT": "cpu_adam@step=1:hang"})
    try:
        wait_for(lambda: lines_up_to(metrics, 1), first, "step 1 reported")
        before = metrics.read_bytes()
        second = train("--steps", "3", "--out", str(tmp_path / "b"), "--metrics", str(metrics))
        assert second.returncode == 2, second.stderr
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and err[0] == f"flowtrain: error: --metrics {metrics} is in use by another flowtrain " \
            "run; wait for it to end, or give this run another --metrics", err
        assert metrics.read_bytes() == before and not (tmp_path / "b").exists() and first.poll() is None
    finally:
        first.kill()
        first.communicate()
    assert steps(metrics) == [1]


def test_a_resume_after_sigkill_repeats_no_step(tmp_path):
    """Killed (SIGKILL) after step 5, with checkpoint-4 its last: resumed onto the same
    --metrics, the file has each of steps 1..8 once, and the resumed steps are the ones an
    uninterrupted run writes."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    first = start("--steps", "8", "--save-every", "4", "--out", str(out), "--metrics", str(metrics),
                  env={"FLOWTRAIN_FAULT": "cpu_adam@step=5:hang"})
    try:
        wait_for(lambda: lines_up_to(metrics, 5) and (out / "checkpoint-4" / "manifest.json").is_file(), first,
                 "step 5 reported after checkpoint-4")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert steps(metrics) == [1, 2, 3, 4, 5]
    resumed = train("--steps", "8", "--save-every", "4", "--resume", str(out), "--out", str(out),
                    "--metrics", str(metrics))
    assert resumed.returncode == 0, resumed.stderr
    assert steps(metrics) == [1, 2, 3, 4, 5, 6, 7, 8]
    whole = tmp_path / "whole.jsonl"
    assert main(["train", *TINY, "--steps", "8", "--metrics", str(whole)]) == 0
    losses = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]
    assert losses == [json.loads(x)["loss"] for x in whole.read_text().splitlines()]


def test_a_resume_drops_later_steps_and_a_cut_line(tmp_path, capsys):
    out, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    assert main(["train", *TINY, "--steps", "6", "--save-every", "2", "--out", str(out),
                 "--metrics", str(metrics)]) == 0
    whole = metrics.read_text()
    with open(metrics, "a") as f:
        f.write('{"step": 7, "lo')  # a kill in the middle of a write
    assert main(["train", *TINY, "--steps", "6", "--resume", str(out / "checkpoint-2"),
                 "--out", str(tmp_path / "branch"), "--metrics", str(metrics)]) == 0
    assert steps(metrics) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(x)["loss"] for x in metrics.read_text().splitlines()] == \
        [json.loads(x)["loss"] for x in whole.splitlines()]
