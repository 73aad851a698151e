"""The activation store: each hand-off between a step's tasks is put once and taken once, and a
step that ends with anything of it still held fails loudly instead of leaking device memory."""

from __future__ import annotations

import pytest
import torch

from flowtrain.train import program as program_module
from flowtrain.train.activations import ActivationStore, Table
from flowtrain.train.run import TrainConfig, train


def test_a_table_hands_each_value_over_once():
    t: Table[int] = Table("input")
    t.put((0, 1, 0), 7)
    with pytest.raises(RuntimeError, match=r"input \(0, 1, 0\) put twice"):
        t.put((0, 1, 0), 8)
    assert t.peek((0, 1, 0)) == 7 and len(t) == 1  # a checkpoint: read, still there
    assert t.take((0, 1, 0)) == 7 and len(t) == 0
    with pytest.raises(RuntimeError, match=r"input \(0, 1, 0\) taken before it was put"):
        t.take((0, 1, 0))
    assert t.take_if_present((0, 1, 0)) is None


def test_the_store_says_what_a_step_left_behind():
    store = ActivationStore()
    store.grads.put((3, 5, 1), torch.zeros(1))
    store.inputs.put((4, 0, 0), torch.zeros(1))  # the next step's: not step 3's business
    store.eval_inputs.put((3, 2, 0), torch.zeros(1))
    assert store.held(3) == {"output gradient": [(3, 5, 1)]}
    with pytest.raises(AssertionError, match=r"step 3 ended holding \{'output gradient': \[\(3, 5, 1\)\]\}"):
        store.check_empty(3)
    store.check_empty(4, evaluation=True)
    with pytest.raises(AssertionError, match="the evaluation after step 3"):
        store.check_empty(3, evaluation=True)


def _programs(monkeypatch) -> list:
    made = []
    init = program_module.StepProgram.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(program_module.StepProgram, "__init__", recording_init)
    return made


@pytest.mark.parametrize("placement", [dict(activations="recompute", checkpoint_every=2),
                                       dict(activations="recompute", checkpoint_every=1),
                                       dict(activations="keep"), dict(activations="offload"),
                                       dict(activations="attention")])
def test_every_placement_ends_each_step_with_nothing_held(tmp_path, monkeypatch, placement):
    made = _programs(monkeypatch)
    train(TrainConfig(steps=3, batch_size=4, micro_batch_size=2, device="cpu", progress=False,
                      out=str(tmp_path / "out"), **placement))
    (program,) = made
    assert len(program.store) == 0


def test_a_task_that_leaves_a_tensor_behind_fails_its_step(tmp_path, monkeypatch):
    loss = program_module.HANDLERS["loss"]

    def leaky_loss(program, task, ctx):
        loss(program, task, ctx)
        program.store.grads.put((task.step, 10_000, task.micro_batch), torch.zeros(1))  # nobody takes it

    monkeypatch.setitem(program_module.HANDLERS, "loss", leaky_loss)
    with pytest.raises(AssertionError, match=r"activation store: step 0 ended holding \{'output gradient'"):
        train(TrainConfig(steps=2, device="cpu", progress=False, out=str(tmp_path / "out")))
