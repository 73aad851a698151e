"""The final model's placement at --out: whole or not at all, the old one kept until then."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.ckpt.output import remove_stale_temp, save_final_model
from flowtrain.model import preset
from flowtrain.train.host_state import HostState


def state(seed: int) -> HostState:
    s = HostState.create(preset("tiny"), pin=False)
    s.init_random(seed)
    return s


def weights(folder):
    return load_file(folder / "model.safetensors")


def test_a_missing_out_gets_the_model_in_one_rename(tmp_path):
    out = save_final_model(state(0), tmp_path / "out", None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_overwrite_replaces_the_model_and_only_model_files(tmp_path):
    out = tmp_path / "out"
    save_final_model(state(0), out, None)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an old shard")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-5").mkdir()
    new = state(1)
    save_final_model(new, out, None)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["checkpoint-5", "config.json", "model.safetensors", "notes.txt"]
    new.save(tmp_path / "expected")
    for k, v in weights(tmp_path / "expected").items():
        assert torch.equal(weights(out)[k], v), k


def test_a_failed_save_keeps_the_old_model_whole(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_final_model(state(0), out, None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    new = state(1)
    real_replace = os.replace
    calls = []

    def fail_second(src, dst):  # the placement's second file move fails (a full disk, say)
        if os.path.dirname(dst) == str(out):
            calls.append(dst)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(OSError):
        save_final_model(new, out, None)
    monkeypatch.undo()
    # each file is the old one or the new one, whole; the temporary folder is gone
    new.save(tmp_path / "expected")
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after.keys() == before.keys() and len(calls) == 2
    assert after["config.json"] == (tmp_path / "expected" / "config.json").read_bytes()
    assert after["model.safetensors"] == before["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_temporary_folders_of_a_killed_run_are_removed(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-abc123").mkdir()
    (tmp_path / ".out.tmp-abc123" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".other.tmp-x").mkdir()
    remove_stale_temp(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-x"]
