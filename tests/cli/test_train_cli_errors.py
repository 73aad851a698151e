"""Bad input to ``flowtrain train`` ends with one clear line, exit status 2, no traceback,
and nothing written to --out.

Each case starts a process (seconds each, importing torch): the default tier runs one of each
kind, the slow tier the rest, whose messages are also checked in-process (test_checks.py,
test_model_config.py, test_data.py, test_plan.py, test_policies.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from flowtrain.model.hf_config import to_hf


def run_train(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "FLOWTRAIN_DEBUG"}  # it would show tracebacks
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--no-progress", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120, env=env)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model"], "neither a directory nor a preset"),
    pytest.param(["--batch-size", "8", "--micro-batch-size", "3"], "--micro-batch-size 3 does not divide --batch-size 8",
                 marks=SLOW),
    pytest.param(["--seq-len", "100000"], "beyond the model's", marks=SLOW),
    pytest.param(["--policy", "nope"], "unknown policy", marks=SLOW),
    pytest.param(["--steps", "0"], "--steps must be at least 1", marks=SLOW),
])
def test_bad_flags(tmp_path, args, needle):
    out = tmp_path / "out"
    proc = run_train(*args, "--out", str(out))
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


@SLOW  # in-process: test_model_config.py (unsupported architecture), test_data.py (empty data)
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


@pytest.mark.slow  # a whole run in a subprocess: the slow tier
def test_a_good_run_writes_a_loadable_model(tmp_path):
    proc = run_train("--steps", "3", "--out", str(tmp_path / "out"), "--metrics", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert set(lines[0]) == {"step", "loss", "tokens", "seconds", "tokens_per_s", "lr", "grad_norm", "skipped"}
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "model.safetensors").exists()
    # an existing non-empty --out is refused, not overwritten
    proc = run_train("--steps", "1", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--overwrite" in proc.stderr


def assert_one_line_refusal(proc, needle, status=2):
    assert proc.returncode == status, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--lr", "nan"], "--lr must be a finite number >= 0 (got nan)"),
    *(pytest.param(args, needle, marks=SLOW) for args, needle in [
        (["--lr=-1"], "--lr must be a finite number >= 0 (got -1.0)"),
        (["--eps", "inf"], "--eps must be a finite number >= 0 (got inf)"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0 (got nan)"),
        (["--grad-clip", "0"], "--grad-clip must be a finite number > 0 (got 0.0)"),
        (["--min-lr", "nan"], "--min-lr must be a finite number >= 0 (got nan)"),
        (["--betas", "0.9,nan"], "--betas must be two numbers in [0, 1) like 0.9,0.999 (got 0.9,nan)"),
        (["--betas", "0.9,1.5"], "--betas must be two numbers in [0, 1)"),
        (["--host-mem", "inf"], "--host-mem must be a finite number > 0 (got inf)"),
        (["--gpu-mem", "nan"], "--gpu-mem must be a finite number > 0 (got nan)"),
        (["--warmup-steps", "-1"], "--warmup-steps must be at least 0 (got -1)"),
        (["--chunk-tokens", "0"], "--chunk-tokens must be at least 1 (got 0)"),
        (["--checkpoint-every", "0"], "--activation-checkpoint-every must be at least 1 (got 0)"),  # the old name works
        (["--adam-workers", "0"], "--adam-workers must be at least 1 (got 0)"),
        (["--compile", "nosuch"], "--compile 'nosuch' is not a torch.compile backend; choose auto, none, eager"),
    ]),
])
def test_bad_numbers_and_backends_are_refused_before_loading(tmp_path, args, needle):
    out = tmp_path / "out"
    assert_one_line_refusal(run_train(*args, "--out", str(out)), needle)
    assert not out.exists()


@SLOW  # five processes; the refusals are checked in-process in test_checks.py
def test_unwritable_outputs_are_refused_before_training(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    out = tmp_path / "out"
    for args, needle in [
        (["--out", str(f)], f"--out {f} is a file"),
        (["--out", str(f / "out")], f"{f} is a file, so no folder can be made under it"),
        (["--out", str(out), "--trace", str(tmp_path)], f"--trace {tmp_path} is a folder"),
        (["--out", str(out), "--metrics", str(tmp_path / "no" / "m.jsonl")], "does not exist; create it first"),
        (["--out", str(out), "--metrics", str(f / "m.jsonl")], f"{f} is a file, so nothing can be written under it"),
    ]:
        assert_one_line_refusal(run_train(*args), needle)
        assert not out.exists() and f.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bad_values_in_config_json_are_refused(tmp_path):
    from flowtrain.model import preset

    model = tmp_path / "model"
    model.mkdir()
    d = to_hf(preset("tiny"))
    d["vocab_size"] = "lots"
    (model / "config.json").write_text(json.dumps(d))
    proc = run_train("--model", str(model), "--out", str(tmp_path / "out"))
    assert_one_line_refusal(proc, "config.json: vocab_size must be a positive integer (got 'lots')")
    assert not (tmp_path / "out").exists()
