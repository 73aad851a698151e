"""Handlers of the optimizer: ``cpu_adam``, ``gpu_adam`` and ``verify_step``.

``cpu_adam`` runs AdamW on a streamed unit's fp32 master in host memory (or one chunk of it,
from a staging slot), then refreshes the unit's streaming copy where the layout keeps one. It
asks the step's finiteness check first: skip (something is known bad), update, or update after
recording the range for an undo (the step is not verified yet). ``gpu_adam`` updates a resident
unit on the device with torch's fused kernel, which leaves it untouched where the step's
``found_inf`` flag is set. ``verify_step`` settles the step once every flag is on the host.
A sparse layer that skips idle experts updates each expert on its own step count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...graph.tasks import HOST_GRADS, CpuAdam, GpuAdam, VerifyStep
from ...plan.buffer_sizes import chunk_range
from ...runtime.engine import TaskContext
from ..nonfinite import SKIP, Saved
from ..optimizer import adamw_experts, adamw_pieces, adamw_step
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("cpu_adam")
def run_cpu_adam(p: StepProgram, task: CpuAdam, ctx: TaskContext) -> None:
    data = p.steps[task.step]
    unit = p.unit(task)
    lo, hi = chunk_range(unit.flat_map.numel, p.slots.stage_n, task.chunk)
    if task.chunk is None:  # full layout: the unit's own host gradient
        if task.unit == "embed":
            p.head.sum_whole(data)
        grad = unit.own_grad()
    else:
        grad = p.slots.staging[ctx.read(HOST_GRADS)][: hi - lo]
        p.head.add_to_chunk(data, task, grad, lo, hi)
    if p.owned is not None and unit.flat_map.key not in p.owned:
        return  # another process of the node updates the shared copy
    key = (unit.flat_map.key, task.chunk)
    verdict = data.check.admit(key, unit.flat_map.key if task.chunk is None else f"{key[0]} c{task.chunk}", hi - lo)
    if isinstance(verdict, str) and verdict == SKIP:
        return  # the step is known not finite
    no_decay = p.no_decay[unit.flat_map.key]
    # the range's master, m and v: the unit's own, or where its state is on disk, the slot its
    # read_state filled (p.disk)
    master, m, v, put_back = p.disk.pieces(unit, task, lo, hi)
    try:
        if isinstance(verdict, torch.Tensor):  # not verified yet: keep what it was first
            data.check.keep(Saved(unit, lo, hi, task.chunk or 0, verdict, (master, m, v), put_back))
        if data.clip is not None:
            grad.mul_(data.clip)
        if (i := p.experts.skipping(task)) is not None:  # each expert on its own step count
            assert (lo, hi) == (0, unit.flat_map.numel), "a layer that skips idle experts is one staging chunk"
            pieces = p.experts.idle.adam_pieces(task.step, i, data.micro_batches, unit, task.chunk)
            adamw_pieces(master, grad, m, v, pieces, p.adamw, data.lr, no_decay=no_decay)
        else:
            adamw_step(master, grad, m, v, unit.steps[task.chunk or 0], p.adamw, data.lr,
                       no_decay=[(a - lo, b - lo) for a, b in no_decay])
        unit.refresh_from(master, lo)
    finally:
        data.check.updated()


@HANDLERS.register("gpu_adam")
def run_gpu_adam(p: StepProgram, task: GpuAdam, ctx: TaskContext) -> None:
    """AdamW of a resident unit on the device (torch's fused CUDA kernel on a GPU), then a
    fresh compute copy and a zeroed accumulator for the next step. The kernel leaves the
    unit as it was where the step's ``found_inf`` flag is set (no host sync)."""
    data = p.steps[task.step]
    unit = p.unit(task)
    grad = unit.own_grad()
    no_decay = p.no_decay[unit.flat_map.key]
    if not data.check.skipped:  # known on the host already: with clipping, or a bad loss
        if data.clip is not None:
            grad.mul_(data.clip.to(grad.device))
        if (i := p.experts.skipping(task)) is not None:  # idle experts skipped on the device
            idle = p.experts.idle
            sl = idle.slices[i]
            assert unit.expert_steps is not None
            adamw_experts(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, sl.shared, unit.steps[0],
                          sl.experts, unit.expert_steps, idle.idle_on_device(task.step, i, data.micro_batches),
                          p.adamw, data.lr, found_inf=data.check.found_inf, no_decay=no_decay)
        else:
            adamw_step(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, unit.steps[0], p.adamw, data.lr,
                       found_inf=data.check.found_inf, no_decay=no_decay)
        data.check.gpu_updated.append(unit.flat_map.key)
        unit.refresh_copies()
    grad.zero_()


@HANDLERS.register("verify_step")
def run_verify_step(p: StepProgram, task: VerifyStep, ctx: TaskContext) -> None:
    p.finite.settle(p.steps[task.step])
