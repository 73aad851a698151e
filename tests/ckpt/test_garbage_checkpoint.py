"""A checkpoint whose small files are garbage is refused in one short line, before anything is
allocated: a deeply nested or huge manifest, a trainer state that is not one, and a model folder
with a config but no weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def _edit_state(saved, tmp_path, edit) -> Path:
    """A copy of the checkpoint with its trainer state edited by ``edit`` and the manifest made
    to match, as a careful hand edit would leave it."""
    import hashlib

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saved, ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    data = json.dumps(state).encode()
    (ckpt / "trainer_state.json").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


@pytest.mark.parametrize("edit, says", [
    (lambda s: s.update(rng="garbage"), "trainer_state.json is not a trainer state"),
    (lambda s: s["rng"].update(torch="AAAA"), "rng.torch is not a torch generator state"),
    (lambda s: s["data"].update(position=-5), "data.position"),
    (lambda s: s["data"].update(position=10**30), "counts more than its 2 steps"),
    (lambda s: s.update(skipped_steps=-1), "skipped_steps"),
    (lambda s: s["settings"].update(steps="many"), "settings are not a run's settings"),
    (lambda s: s["settings"].update(lr=-1.0), "settings are not a run's settings (lr must be"),
], ids=["rng-not-an-object", "rng-too-short", "negative-position", "position-past-the-steps", "negative-skipped",
        "steps-not-a-number", "negative-lr"])
def test_a_trainer_state_edited_by_hand_is_refused_in_one_line(saved, tmp_path, capsys, edit, says):
    ckpt = _edit_state(saved, tmp_path, edit)
    rc = main(["train", *TINY, "--steps", "3", "--resume", str(ckpt), "--out", str(tmp_path / "again")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "again").exists()
