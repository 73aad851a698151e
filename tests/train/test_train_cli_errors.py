"""Bad input to ``flowtrain train`` ends with one clear line, exit status 2, no traceback,
and nothing written to --out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_train(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--no-progress", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model"], "neither a directory nor a preset"),
    (["--batch-size", "8", "--micro-batch-size", "3"], "--micro-batch-size 3 does not divide --batch-size 8"),
    (["--seq-len", "100000"], "beyond the model's"),
    (["--policy", "nope"], "unknown policy"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bad_flags(tmp_path, args, needle):
    out = tmp_path / "out"
    proc = run_train(*args, "--out", str(out))
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_bad_model_directory_and_data(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    proc = run_train("--model", str(model), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "unsupported architecture" in proc.stderr and "Traceback" not in proc.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = run_train("--data", str(empty), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_good_run_writes_a_loadable_model(tmp_path):
    proc = run_train("--steps", "3", "--out", str(tmp_path / "out"), "--metrics", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert set(lines[0]) == {"step", "loss", "tokens", "seconds", "tokens_per_s", "lr", "grad_norm"}
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "model.safetensors").exists()
    # an existing non-empty --out is refused, not overwritten
    proc = run_train("--steps", "1", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
