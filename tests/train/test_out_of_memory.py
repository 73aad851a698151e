"""A step that runs out of GPU memory ends the run in one line that says what was asked, what
the plan counted and what to change; the checkpoints already written stay whole and no final
model is written. The allocator's refusal is raised where a layer's backward would meet it
(the CPU has no allocator cap to run into)."""

from __future__ import annotations

import hashlib
import threading

import torch

from flowtrain.cli import main
from flowtrain.errors import GpuOutOfMemory
from flowtrain.train import program as program_module
from flowtrain.train.out_of_memory import gpu_out_of_memory

TINY = ["train", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--micro-batch-size", "1",
        "--device", "cpu", "--no-progress", "--lr-schedule", "constant"]
#: the CUDA caching allocator's message, as PyTorch 2.x words it
REFUSAL = ("CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
           "130.61 GiB is free. Including non-PyTorch memory, this process has 9.10 GiB memory in use. 8.60 GiB "
           "allowed; Of the allocated memory 7.96 GiB is allocated by PyTorch, and 276.61 MiB is reserved by "
           "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def digest(folder) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("*.safetensors")))).hexdigest()


def test_a_step_that_finished_before_the_failure_still_completes_its_checkpoint(tmp_path, monkeypatch, capsys):
    """Two steps are in flight: the step after a save can fail while the saving step is still
    open. Once that step's saves are written it has finished whole, and its checkpoint is
    completed before the failure is reported."""
    whole = tmp_path / "whole"
    assert main([*TINY, "--steps", "2", "--save-every", "2", "--out", str(whole)]) == 0
    capsys.readouterr()
    saved = threading.Event()
    save, backward = program_module.HANDLERS["save"], program_module.HANDLERS["backward"]
    writes: list[int] = []

    def counting_save(program, task, ctx):
        n = save(program, task, ctx)
        writes.append(task.step)
        if writes.count(1) == len(program.state.trained):  # every unit of step 2's checkpoint (0-based 1)
            saved.set()
        return n

    def refusing_once_saved(program, task, ctx):
        if task.step == 2:
            assert saved.wait(timeout=120), "step 2's checkpoint was never written"
            raise torch.OutOfMemoryError(REFUSAL)
        backward(program, task, ctx)

    monkeypatch.setitem(program_module.HANDLERS, "save", counting_save)
    monkeypatch.setitem(program_module.HANDLERS, "backward", refusing_once_saved)
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "4", "--save-every", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ran out of GPU memory" in err[-1], err
    assert digest(out / "checkpoint-2") == digest(whole / "checkpoint-2")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]


def _refuse_in_step(monkeypatch, step: int) -> None:
    backward = program_module.HANDLERS["backward"]

    def refusing(program, task, ctx):
        if task.step == step:
            raise torch.OutOfMemoryError(REFUSAL)
        backward(program, task, ctx)

    monkeypatch.setitem(program_module.HANDLERS, "backward", refusing)


def test_a_step_out_of_gpu_memory_ends_in_one_line_and_keeps_the_checkpoints(tmp_path, monkeypatch, capsys):
    whole = tmp_path / "whole"
    assert main([*TINY, "--steps", "2", "--save-every", "2", "--out", str(whole)]) == 0  # its first two steps alone
    capsys.readouterr()
    _refuse_in_step(monkeypatch, step=3)  # step 1 (checkpoint-2) is done before step 3 is added
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "4", "--save-every", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("flowtrain: error: task backward L") and " ran out of GPU memory: 384.00 MiB" in line
    assert "with 7.96 GiB allocated and 276.61 MiB reserved but unused" in line
    assert "the plan counted a peak of" in line and "--micro-batch-size" in line and "--gpu-peak-report" in line
    assert not list(out.glob("*.safetensors")) and sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "checkpoint-2"]  # no final model, nothing half-written
    assert digest(out / "checkpoint-2") == digest(whole / "checkpoint-2")  # the checkpoint before it, whole


class _Plan:
    def __init__(self, total_gib: float, limit_gib: float | None) -> None:
        self.gpu_total = int(total_gib * 2**30)
        self.gpu_limit = None if limit_gib is None else int(limit_gib * 2**30)


def test_without_the_allocators_details_the_line_still_names_the_plan():
    err = gpu_out_of_memory("task backward L3 m0", torch.OutOfMemoryError("out of memory"), _Plan(7.5, 8.32))  # type: ignore[arg-type]
    assert isinstance(err, GpuOutOfMemory)
    assert str(err).startswith("task backward L3 m0 ran out of GPU memory: a request could not be allocated, "
                               "where the plan counted a peak of 7.50 GiB of 8.32 usable.")


def test_a_plan_without_a_gpu_budget_says_its_count_alone():
    text = str(gpu_out_of_memory("task forward L0 m1", torch.OutOfMemoryError(REFUSAL), _Plan(3.0, None)))  # type: ignore[arg-type]
    assert "384.00 MiB could not be allocated with 7.96 GiB allocated" in text
    assert "the plan counted a peak of 3.00 GiB." in text and "usable" not in text
