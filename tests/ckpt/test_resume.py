"""Checkpoints and exact resume, through the real trainer on the CPU in fp32.

Four steps in one run give bit-identical weights, Adam moments and step counts to two steps, a
resume from ``checkpoint-2`` and two more, for every built-in policy and host layout, with
shuffled data and a warm-up + cosine schedule (whose rate depends on the step and the total);
and writing checkpoints changes nothing in the run that writes them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.errors import CheckpointError, ConfigError
from flowtrain.train.run import TrainConfig, train

BASE = dict(model="tiny", batch_size=4, micro_batch_size=2, seq_len=32, lr=3e-3, warmup_steps=2,
            lr_schedule="cosine", min_lr=1e-4, device="cpu", progress=False)


class StopAfter(Exception):
    pass


def stop_after(step: int):
    """Raise once ``step`` steps are done (``StepMetrics.step`` counts from 1)."""

    def hook(m):
        if m.step == step:
            raise StopAfter

    return hook


def tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``folder``, keyed ``file/name``."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(f).items():
            out[f"{f.name}/{k}"] = v
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def interrupted_then_resumed(tmp_path, steps=4, stop=2, **extra) -> None:
    cfg = dict(BASE, steps=steps, out=str(tmp_path / "b"), save_every=2, **extra)
    with pytest.raises(StopAfter):
        train(TrainConfig(**cfg), on_step=stop_after(stop))
    train(TrainConfig(**cfg, resume=str(tmp_path / "b")))


PLACEMENTS = [
    dict(layout="staged", resident="none"),
    dict(layout="full", resident="none"),
    dict(layout="stream-bf16", resident="none"),
    dict(layout="staged", resident="embed,head,layer.0"),
    dict(layout="full", resident="layer.1", grad_clip=0.5),
]


@pytest.mark.parametrize("policy", ["sequential", "double_buffer", "lookahead"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_resume_is_bit_identical(tmp_path, policy, placement):
    train(TrainConfig(**BASE, steps=4, out=str(tmp_path / "a"), save_every=2, policy=policy, **placement))
    interrupted_then_resumed(tmp_path, policy=policy, **placement)
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    for name in ("checkpoint-2", "checkpoint-4"):
        assert_identical(tensors(tmp_path / "a" / name), tensors(tmp_path / "b" / name))
    assert_identical(tensors(tmp_path / "a"), tensors(tmp_path / "b"))
    state = json.loads((tmp_path / "b" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["step"] == 4


def test_saving_changes_nothing_and_training_moves_the_weights(tmp_path):
    train(TrainConfig(**BASE, steps=4, out=str(tmp_path / "plain")))
    train(TrainConfig(**BASE, steps=4, out=str(tmp_path / "saved"), save_every=1, save_total_limit=2))
    assert_identical(tensors(tmp_path / "plain"), tensors(tmp_path / "saved"))
    assert sorted(p.name for p in (tmp_path / "saved").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    # the checkpoint's weights are the step-4 model, and Adam's state moved
    ck = tensors(tmp_path / "saved" / "checkpoint-4")
    final = load_file(tmp_path / "saved" / "model.safetensors")
    masters = {k.split("/", 1)[1]: v for k, v in ck.items() if k.startswith("model-")}
    assert masters.keys() == final.keys()
    for k in final:
        assert torch.equal(masters[k], final[k]), k
    steps = [v for k, v in ck.items() if k.endswith("/step")]
    assert steps and all(float(s) == 4 for s in steps)
    early = tensors(tmp_path / "saved" / "checkpoint-3")
    assert any(not torch.equal(early[k], ck[k]) for k in ck)


def test_resume_refuses_other_settings_and_data_in_one_line(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(**BASE, steps=2, out=str(out), save_every=2))
    with pytest.raises(ConfigError, match="lr"):
        train(TrainConfig(**dict(BASE, lr=1e-2), steps=4, out=str(out), resume=str(out)))
    with pytest.raises(ConfigError, match="this run has batch_size giving 8"):
        train(TrainConfig(**dict(BASE, batch_size=8), steps=4, out=str(out), resume=str(out)))
    other = tmp_path / "other.txt"
    other.write_text("some other text entirely " * 200)
    with pytest.raises(ConfigError, match="data"):
        train(TrainConfig(**BASE, steps=4, data=str(other), out=str(out), resume=str(out)))
    with pytest.raises(ConfigError, match="steps is 2; steps counts the whole run"):
        train(TrainConfig(**BASE, steps=2, out=str(out), resume=str(out)))
    with pytest.raises(CheckpointError):
        train(TrainConfig(**BASE, steps=4, out=str(tmp_path / "x"), resume=str(tmp_path / "nothing-here")))


def test_a_corrupt_checkpoint_is_refused(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(**BASE, steps=2, out=str(out), save_every=2))
    shard = sorted((out / "checkpoint-2").glob("optimizer-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        train(TrainConfig(**BASE, steps=4, out=str(out), resume=str(out)))


def test_new_checkpoints_never_mix_with_an_earlier_runs(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(**BASE, steps=2, out=str(out), save_every=1))
    with pytest.raises(ConfigError, match="continue it with resume "):  # the field, as the API has it
        train(TrainConfig(**BASE, steps=2, out=str(out), overwrite=True, save_every=1))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # a checkpoint is a model: training can start from it like from any Hugging Face folder
    train(TrainConfig(**dict(BASE, model=str(out / "checkpoint-2")), steps=1, out=str(tmp_path / "fresh")))
    assert (tmp_path / "fresh" / "model.safetensors").exists()
