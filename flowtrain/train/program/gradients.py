"""Handlers of gradients on their way out: ``zero_grad``, ``reduce_grad``, ``offload_grad``,
``grad_sq_norm``, ``grad_norm`` and ``found_inf``.

A streamed unit's gradient accumulates in a device gradient slot (``zero_grad`` takes and
zeroes it), is summed over the data-parallel processes (``reduce_grad``), and goes to host
memory (``offload_grad``): whole into the unit's own host gradient (``full`` layout), or chunk
by chunk into pinned staging slots. On its way each piece's squared norm and finiteness flag
are taken on the device, and the flag copied to the host on the same lane
(:mod:`flowtrain.train.nonfinite`). With clipping, ``grad_norm`` adds the squared norms into
the global norm before any Adam runs; with resident units, ``found_inf`` makes the one device
flag every ``gpu_adam`` passes to the fused kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...graph.tasks import GRADS, FoundInf, GradNorm, GradSqNorm, OffloadGrad, ReduceGrad, ZeroGrad
from ...plan.buffer_sizes import chunk_range
from ...runtime.engine import TaskContext
from ..distributed import all_reduce_sum
from ..host_state import UnitState
from ..nonfinite import nonfinite
from ..optimizer import clip_coefficient
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("zero_grad")
def run_zero_grad(p: StepProgram, task: ZeroGrad, ctx: TaskContext) -> None:
    """Zero the gradient slot this task took, as far as its unit (and what rides behind it) fills it."""
    p.slots.grad_slots[ctx.slot][: p.unit(task).flat_map.numel + p.head.slot_extra(task)].zero_()  # type: ignore[index]


@HANDLERS.register("reduce_grad")
def run_reduce_grad(p: StepProgram, task: ReduceGrad, ctx: TaskContext) -> None:
    """Sum a unit's gradient over the data-parallel processes, in place."""
    unit = p.unit(task)
    p.experts.sum_counts(task, p.steps[task.step].micro_batches)
    if unit.resident:  # its own accumulator (a tied head's matrix part is the embedding's)
        all_reduce_sum(unit.own_grad()[: unit.flat_map.numel])
    else:
        all_reduce_sum(p.slots.grad_slots[ctx.read(GRADS)][: unit.flat_map.numel + p.head.slot_extra(task)])


@HANDLERS.register("offload_grad")
def run_offload_grad(p: StepProgram, task: OffloadGrad, ctx: TaskContext) -> int:
    """Device gradient -> host: the whole unit into its own buffer (``full`` layout), or one
    chunk into the staging slot this task took. Each piece's squared norm is taken on the
    device on the way (for a tied embedding, on the host once the head's part is added)."""
    unit = p.unit(task)
    src = p.slots.grad_slots[ctx.read(GRADS)]
    moved = p.head.offload_extra(task, unit, src)
    lo, hi = chunk_range(unit.flat_map.numel, p.slots.stage_n, task.chunk)
    dst = unit.own_grad() if task.chunk is None else p.slots.staging[ctx.slot][: hi - lo]  # type: ignore[index]
    _flag_pieces(p, task, unit, src, lo, hi)
    for a, b in p.experts.offload_ranges(task, p.steps[task.step].micro_batches, lo, hi):
        dst[a - lo : b - lo].copy_(src[a:b], non_blocking=p.slots.non_blocking)  # an idle expert's stays behind
        moved += 4 * (b - a)
    return moved


def _flag_pieces(p: StepProgram, task: OffloadGrad, unit: UnitState, src: torch.Tensor, lo: int, hi: int) -> None:
    """Squared norm and non-finite flag of the piece ``src[lo:hi]`` an offload copies (a tied
    embedding's norm waits for the host sum, its flag does not), and of what rides behind it;
    each flag also goes to the host, on this lane."""
    data = p.steps[task.step]
    key = unit.flat_map.key
    piece = src[lo:hi]
    if p.head.norm_waits(task):
        flags = [(key, nonfinite(piece))]
    else:
        sq = data.sq_norms[(key, task.chunk)] = torch.dot(piece, piece)  # no temporary the piece's size
        flags = [(key, nonfinite(piece, sq))]
    flags += p.head.extra_flags(task, unit, src)
    data.check.add_pieces((key, task.chunk), [(name, f, p.slots.host_copy(f)) for name, f in flags])


@HANDLERS.register("grad_sq_norm")
def run_grad_sq_norm(p: StepProgram, task: GradSqNorm, ctx: TaskContext) -> None:
    p.finite.resident_sq_norm(p.steps[task.step], p.unit(task))


@HANDLERS.register("grad_norm")
def run_grad_norm(p: StepProgram, task: GradNorm, ctx: TaskContext) -> None:
    """With clipping every gradient is in before any Adam: the step is settled here, so its
    Adam tasks either all skip or all update, and nothing needs an undo record."""
    data = p.steps[task.step]
    data.clip = clip_coefficient(p.total_norm(data), p.adamw.grad_clip)
    p.finite.settle(data)


@HANDLERS.register("found_inf")
def run_found_inf(p: StepProgram, task: FoundInf, ctx: TaskContext) -> None:
    p.finite.found_inf(p.steps[task.step])
