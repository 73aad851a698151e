"""A resume with another ``--steps`` or ``--weight-decay-skip`` says how the schedule goes on.

A cosine or linear learning rate decays until ``--steps``: resuming with another ``--steps``
once stretched the schedule silently, and the rate jumped. Now such a resume is refused in one
line unless ``--extend-schedule`` says how to go on: from the rate the checkpoint reached, the
same decay to ``--min-lr`` at the new last step, recorded in every later checkpoint so that a
resume of the extended run continues it exactly. A constant schedule does not depend on
``--steps``, so there a new ``--steps`` is simply taken. A changed ``--weight-decay-skip`` (which
parameters decay) is refused like every other optimizer setting.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.ckpt.resume import ContinuedSchedule, schedule_record
from flowtrain.cli import main
from flowtrain.errors import CheckpointError, ConfigError
from flowtrain.train import TrainConfig, train
from flowtrain.train.optimizer import LRSchedule

LR, MIN_LR = 3e-3, 1e-4
BASE = dict(batch_size=4, micro_batch_size=2, seq_len=32, lr=LR, warmup_steps=1, lr_schedule="cosine", min_lr=MIN_LR,
            device="cpu", progress=False)
CLI = ["--model", "tiny", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu",
       "--no-progress", "--lr-schedule", "cosine", "--warmup-steps", "1"]


def refusal(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_changed_weight_decay_skip_is_refused_naming_the_flag_and_both_values(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", *CLI, "--steps", "4", "--save-every", "2", "--out", str(out)]) == 0
    line = refusal(capsys, ["train", *CLI, "--steps", "4", "--resume", str(out), "--out", str(out),
                            "--weight-decay-skip", "norms-biases"])
    assert "--weight-decay-skip" in line and "'none'" in line and "'norms-biases'" in line, line
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]  # nothing new
    # the same setting continues
    assert main(["train", *CLI, "--steps", "4", "--resume", str(out / "checkpoint-2"), "--out", str(tmp_path / "b"),
                 "--weight-decay-skip", "none"]) == 0


def test_a_changed_steps_under_a_decaying_schedule_needs_extend_schedule(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", *CLI, "--steps", "4", "--save-every", "2", "--out", str(out)]) == 0
    line = refusal(capsys, ["train", *CLI, "--steps", "6", "--resume", str(out / "checkpoint-2"),
                            "--out", str(tmp_path / "b")])
    assert "cosine schedule decays to --min-lr at step 4, this run has --steps 6" in line, line
    assert "give --steps 4 to finish it, or add --extend-schedule" in line, line
    assert not (tmp_path / "b").exists()


def test_a_constant_schedule_takes_a_new_steps_as_it_is(tmp_path):
    out = tmp_path / "out"
    run = {**BASE, "lr_schedule": "constant", "warmup_steps": 0}
    train(TrainConfig(model="tiny", steps=2, out=str(out), save_every=2, **run))
    more = train(TrainConfig(steps=4, resume=str(out), out=str(tmp_path / "b"), **run))
    assert [m.step for m in more] == [3, 4] and all(m.lr == LR for m in more)


def test_extend_schedule_decays_from_the_rate_reached_and_resumes_exactly(tmp_path):
    first = train(TrainConfig(model="tiny", steps=4, out=str(tmp_path / "a"), save_every=2, **BASE))
    ext = train(TrainConfig(steps=8, resume=str(tmp_path / "a" / "checkpoint-2"), extend_schedule=True,
                            out=str(tmp_path / "ext"), save_every=2, **BASE))
    assert [m.step for m in ext] == [3, 4, 5, 6, 7, 8]
    top = first[2].lr  # the rate the first run gave step 3: the extension starts there, no jump
    want = [MIN_LR + (top - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (s - 2) / 6)) for s in range(2, 8)]
    assert [m.lr for m in ext] == pytest.approx(want, rel=1e-12)
    stretched = LRSchedule(lr=LR, warmup_steps=1, schedule="cosine", total_steps=8, min_lr=MIN_LR)
    assert abs(stretched(2) - top) > 0.1 * top  # what a silent stretch would have made of step 3
    # the extended run's checkpoints carry the extension: a resume with --steps 8 goes on exactly
    again = train(TrainConfig(steps=8, resume=str(tmp_path / "ext" / "checkpoint-6"), out=str(tmp_path / "again"),
                              **BASE))
    assert [(m.step, m.lr) for m in again] == [(m.step, m.lr) for m in ext[-2:]]
    a, b = load_file(tmp_path / "ext" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and its schedule now ends at step 8: another --steps needs the flag again
    with pytest.raises(ConfigError, match="decays to min_lr at step 8, this run has steps 10"):
        train(TrainConfig(steps=10, resume=str(tmp_path / "ext" / "checkpoint-6"), out=str(tmp_path / "c"), **BASE))


def test_extending_a_schedule_that_reached_min_lr_is_refused(tmp_path):
    train(TrainConfig(model="tiny", steps=2, out=str(tmp_path / "a"), save_every=2, **BASE))
    with pytest.raises(ConfigError, match="had already decayed to min_lr 0.0001 by step 2"):
        train(TrainConfig(steps=4, resume=str(tmp_path / "a"), extend_schedule=True, out=str(tmp_path / "b"), **BASE))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("shape", ["cosine", "linear"])
def test_each_extension_goes_on_from_the_rate_the_one_before_reached(shape):
    base = LRSchedule(lr=1.0, warmup_steps=10, schedule=shape, total_steps=100, min_lr=0.1)
    lr = ContinuedSchedule(base, [(60, 200), (150, 160)])
    assert [lr(s) for s in range(60)] == [base(s) for s in range(60)]
    once = ContinuedSchedule(base, [(60, 200)])
    assert lr(60) == pytest.approx(base(60)) and lr(150) == pytest.approx(once(150))  # no jump at either start
    assert all(lr(s) > lr(s + 1) for s in range(10, 159))  # decaying all along
    assert lr(160) == pytest.approx(0.1) and lr(170) == pytest.approx(0.1)  # at --min-lr from the last step on
    assert ContinuedSchedule(base, lr.record()["extended"]).record() == {"steps": 100, "extended": [[60, 200], [150, 160]]}


def test_what_a_checkpoint_records_of_its_schedule_is_checked():
    assert schedule_record({"schedule": {"steps": 100, "extended": [[60, 200]]}}, "ck") == (100, [(60, 200)])
    assert schedule_record({"settings": {"steps": 100}}, "ck") == (100, [])  # written before it was recorded
    for bad in ("cosine", {"steps": 100}, {"steps": 100, "extended": [[60]]}, {"steps": "100", "extended": []}):
        with pytest.raises(CheckpointError, match='ck: trainer_state.json has a malformed "schedule"'):
            schedule_record({"schedule": bad}, "ck")
