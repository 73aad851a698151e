"""The handler of ``fetch``: one unit's weights from host memory into a weight slot.

The slot is filled from the unit's host copy (:meth:`~.slots.Slots.stream_in`): the pinned
streaming copy where the layout keeps one, else the fp32 master cast on the device. Behind the
unit come what the parts say travels with it: a tied head's embedding matrix (:mod:`.tied`),
a layer's LoRA adapters held in host memory (:mod:`.training`). A sparse layer that skips idle
experts fetches, before its recompute and backward, only the experts its forwards routed to
(:mod:`.experts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...graph.tasks import Fetch
from ...runtime.engine import TaskContext
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("fetch")
def run_fetch(p: StepProgram, task: Fetch, ctx: TaskContext) -> int:
    """Fill the slot this fetch took; returns the bytes that crossed PCIe."""
    dst = p.slots.weight_c[ctx.slot]  # type: ignore[index]
    if (i := p.experts.skipping(task)) is not None and task.phase != "eval":
        # before its recompute and backward, only the experts the forwards of the micro-batches
        # this fetch serves routed to (the rest of the slot keeps what it held: no token reads it)
        mbs = range(p.steps[task.step].micro_batches) if task.micro_batch is None else [task.micro_batch]
        ranges = p.experts.idle.fetch_ranges(task.step, i, task.phase, mbs)
        return p.slots.stream_in(p.state.unit("layer", i), dst, ranges)
    units = [p.unit(task), *p.head.fetched_with(task), *p.training.fetched_with(task)]
    moved = off = 0
    for unit in units:
        n = unit.flat_map.numel
        moved += p.slots.stream_in(unit, dst[off : off + n], [(0, n)])
        off += n
    return moved
