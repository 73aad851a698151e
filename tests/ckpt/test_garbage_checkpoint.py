"""A checkpoint whose small files are garbage is refused in one short line, before anything is
allocated: a deeply nested or huge manifest, a trainer state that is not one, and a model folder
with a config but no weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from flowtrain.cli import main

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--micro-batch-size", "1", "--device", "cpu",
        "--no-progress"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One real two-step run with a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("run") / "out"
    assert main(["train", *TINY, "--steps", "2", "--save-every", "2", "--out", str(out)]) == 0
    return out / "checkpoint-2"


def _resume(ckpt, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", *TINY, "--steps", "3", "--resume", str(ckpt),
                           "--out", str(tmp_path / "again")], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("garbage", ["[" * 100_000, json.dumps({"files": ["x" * 10_000]}), "{\"files\": 3}"],
                         ids=["nested", "huge-entry", "not-a-map"])
def test_a_garbage_manifest_is_one_short_line(saved, tmp_path, garbage):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saved, ckpt)
    (ckpt / "manifest.json").write_text(garbage)
    proc = _resume(ckpt, tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 400 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "manifest" in err[0]


@pytest.mark.parametrize("state", ["[" * 100_000, "[1, 2, 3]", json.dumps({"step": "two"})],
                         ids=["nested", "a-list", "step-not-a-number"])
@pytest.mark.slow
def test_a_trainer_state_that_is_not_one_is_refused_in_one_line(saved, tmp_path, state):
    """The manifest is made to match the broken file, as a careless hand edit would leave it."""
    import hashlib

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saved, ckpt)
    (ckpt / "trainer_state.json").write_text(state)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "trainer_state.json").read_bytes()
    manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = _resume(ckpt, tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "trainer_state.json" in err[0]


def test_a_model_folder_without_weights_is_refused_before_training(saved, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(saved / "config.json", folder / "config.json")
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--model", str(folder), "--seq-len", "32",
                           "--batch-size", "2", "--micro-batch-size", "1", "--device", "cpu", "--steps", "1",
                           "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "step 1" not in proc.stdout
