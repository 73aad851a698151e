"""Signals, faults and non-finite steps on the real command line, in a subprocess.

Each run ends with one line on stderr, the promised exit status, and nothing partial on disk:
no temporary folder, no model at ``--out`` unless the run finished, every checkpoint whole and
resumable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

TINY = ["--model", "tiny", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu",
        "--no-progress"]


def start(*args, env=None):
    e = {k: v for k, v in os.environ.items() if k not in ("FLOWTRAIN_DEBUG", "FLOWTRAIN_FAULT")}
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "flowtrain.cli", "train", *TINY, *args], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(path, n, proc, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {n} lines")


def finish(proc, timeout):
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=timeout)
    return out, err, time.monotonic() - t0


def hidden(folder):
    return [p.name for p in folder.rglob(".*")] if folder.exists() else []


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_with_checkpoints_saves_then_resumes(tmp_path, sig, status):
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    proc = start("--steps", "100000", "--save-every", "1000", "--out", str(out), "--metrics", str(metrics))
    wait_for_lines(metrics, 3, proc)
    proc.send_signal(sig)
    _, err, waited = finish(proc, 30)
    assert proc.returncode == status, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len([x for x in lines if x.startswith("flowtrain:")]) == 1, err
    assert "saved to" in lines[-1]
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / "model.safetensors").exists() and not hidden(out)
    done = int(ckpts[0].name.split("-")[1])
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert done == len(rows)  # the checkpoint is the last reported step
    # it resumes, and the curve goes on from there
    proc = start("--steps", str(done + 2), "--resume", str(out), "--out", str(out), "--metrics", str(metrics))
    _, err, _ = finish(proc, 60)
    assert proc.returncode == 0, err
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(done + 2))
    assert (out / "model.safetensors").exists()


def test_a_blocked_lane_does_not_keep_ctrl_c_waiting(tmp_path):
    """A task hangs mid-run; Ctrl-C still ends the run within seconds, and nothing is written."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    proc = start("--steps", "50", "--out", str(out), "--metrics", str(metrics),
                 env={"FLOWTRAIN_FAULT": "cpu_adam@step=2:hang"})
    wait_for_lines(metrics, 1, proc)
    time.sleep(2.0)  # step 2's cpu_adam is stuck by now; nothing else can finish
    assert proc.poll() is None and len(metrics.read_text().splitlines()) == 2
    proc.send_signal(signal.SIGINT)
    _, err, waited = finish(proc, 30)
    assert proc.returncode == 130, err
    assert waited < 15, waited
    assert "Traceback" not in err and "was still running" in err, err
    assert not out.exists() and not hidden(tmp_path)


@pytest.mark.parametrize("kind", ["fetch", "forward", "backward", "offload_grad", "cpu_adam", "save"])
def test_an_injected_fault_names_its_task_and_keeps_the_last_checkpoint(tmp_path, kind):
    out = tmp_path / "out"
    proc = start("--steps", "6", "--save-every", "2", "--out", str(out), env={"FLOWTRAIN_FAULT": f"{kind}@step=3:raise"})
    _, err, _ = finish(proc, 120)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and kind in err, err
    assert not (out / "model.safetensors").exists() and not hidden(out)
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    proc = start("--steps", "6", "--resume", str(out), "--out", str(out))
    _, err, _ = finish(proc, 120)
    assert proc.returncode == 0, err


def test_a_hung_task_is_named_by_the_watchdog(tmp_path):
    proc = start("--steps", "6", "--task-timeout", "2", env={"FLOWTRAIN_FAULT": "backward@step=1:hang"})
    _, err, waited = finish(proc, 60)
    assert proc.returncode == 2 and "backward" in err and "did not finish" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_run_that_blows_up_stops_with_one_line_and_saves_nothing(tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    proc = start("--steps", "40", "--lr", "1e4", "--max-skipped", "2", "--out", str(out), "--metrics", str(metrics))
    _, err, _ = finish(proc, 120)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--max-skipped 2" in err, err
    assert not out.exists()
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]  # valid JSON: no bare NaN
    skipped = [r for r in rows if r["skipped"]]
    assert len(skipped) == 3 and all(r["loss"] is None or isinstance(r["loss"], float) for r in rows)
    assert rows[-3:] == skipped


@pytest.mark.parametrize("delay", [0.0, 0.7, 1.9])
def test_ctrl_c_ends_a_half_billion_parameter_run_within_15_s(tmp_path, delay):
    """The case that hung 3 times in 4: a 0.5B model (the qwen-0.5b preset) on the CPU, Ctrl-C at
    some moment of a step (its Adam alone moves 6 GB of state)."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowtrain.cli", "train", "--model", "qwen-0.5b", "--batch-size", "2",
         "--micro-batch-size", "1", "--seq-len", "32", "--device", "cpu", "--no-progress", "--steps", "50",
         "--out", str(out), "--metrics", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_lines(metrics, 1, proc, timeout=120)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err, waited = finish(proc, 60)
    assert proc.returncode == 130, err
    assert waited < 15, waited
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("flowtrain: stopped by SIGINT"), err
    assert not out.exists() and not hidden(tmp_path)
