"""What the first step leaves behind: frozen out of full collections, pinned blocks given back.

The run freezes what exists once it is set up and again once its first step is over (the compiled
layer's graphs, guards and kernels are made then), so later full collections walk only what the
steps themselves leave; on CUDA it also gives torch's unused cached pinned host blocks back.
"""

from __future__ import annotations

import gc

import pytest
import torch

from flowtrain.train import TrainConfig, first_step, train
from flowtrain.train.loop import TrainingLoop


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    gc.unfreeze()  # what the runs here froze goes back to the collector for the tests after


def _run(steps: int, on_step=None, **kw) -> list:
    return train(TrainConfig(model="tiny", batch_size=4, micro_batch_size=2, seq_len=16, device="cpu", steps=steps,
                             progress=False, **kw), on_step=on_step)


def test_the_run_freezes_once_set_up_and_once_its_first_step_is_over(monkeypatch):
    events: list[str] = []
    close = TrainingLoop._close_step

    def closing(self, done):
        events.append("close")
        close(self, done)

    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (events.append("freeze"), freeze()))
    monkeypatch.setattr(TrainingLoop, "_close_step", closing)
    metrics = _run(3, on_step=lambda m: events.append(f"step {m.step}"))
    assert [m.step for m in metrics] == [1, 2, 3]
    assert events == ["freeze", "close", "freeze", "step 1", "close", "step 2", "close", "step 3"]


def test_objects_the_first_step_made_are_out_of_later_collections(monkeypatch):
    made: list[list[int]] = []  # one tracked object made as each step closes, before the report
    close = TrainingLoop._close_step

    def closing(self, done):
        made.append([done.step])
        close(self, done)

    def collected(obj) -> bool:  # gc.get_objects() lists what full collections walk, not what is frozen
        return any(o is obj for o in gc.get_objects())

    seen: dict[int, bool] = {}
    monkeypatch.setattr(TrainingLoop, "_close_step", closing)
    _run(3, on_step=lambda m: seen.setdefault(m.step, collected(made[-1])))
    assert all(gc.is_tracked(obj) for obj in made)
    assert seen == {1: False, 2: True, 3: True}


def test_a_resumed_run_settles_after_its_own_first_step(tmp_path, monkeypatch):
    _run(2, out=str(tmp_path / "run"), save_every=2)
    settled: list[str] = []
    monkeypatch.setattr("flowtrain.train.loop.settle_after_first_step",
                        lambda device_type: settled.append(device_type))
    metrics = _run(4, out=str(tmp_path / "run"), resume=str(tmp_path / "run"))
    assert [m.step for m in metrics] == [3, 4]
    assert settled == ["cpu"]


def test_pinned_blocks_are_given_back_only_on_cuda(monkeypatch):
    released: list[bool] = []
    monkeypatch.setattr(first_step, "empty_pinned_cache", lambda: released.append(True))
    first_step.settle_after_first_step("cpu")
    assert released == []
    first_step.settle_after_first_step("cuda")
    assert released == [True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without an accelerator")
def test_giving_pinned_blocks_back_without_an_accelerator_changes_nothing():
    first_step.empty_pinned_cache()  # torch raises here without one; the run goes on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unused_pinned_blocks_go_back_and_those_in_use_stay():
    def pinned() -> int:
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    first_step.empty_pinned_cache()
    start = pinned()
    kept = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)
    dropped = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    del dropped
    assert pinned() >= start + (96 << 20)  # the dropped block is cached, not freed
    first_step.empty_pinned_cache()
    assert start + (32 << 20) <= pinned() < start + (96 << 20)
    kept.fill_(1)
    assert int(kept[-1]) == 1
