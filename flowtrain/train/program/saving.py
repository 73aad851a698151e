"""Handlers of a step's checkpoint and of a node's shared state: ``save`` and ``sync_step``.

A ``save`` task writes one unit (fp32 master, Adam m and v, step count) into its step's open
checkpoint (:class:`~flowtrain.ckpt.checkpoints.CheckpointWriter`, by step in
``program.checkpoints``), after this step's Adam of the unit and before the next step's, on
the ``io`` lane while the next step computes (:mod:`flowtrain.graph.saving`). ``sync_step`` is
the barrier of the processes of a node that share one host copy of the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...graph.tasks import SaveUnit, SyncStep
from ...runtime.engine import TaskContext
from ..distributed import node_barrier
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("save")
def run_save(p: StepProgram, task: SaveUnit, ctx: TaskContext) -> int:
    """Write one unit into its step's checkpoint; returns the bytes written."""
    unit = p.unit(task)  # where its state is on disk, read back for the write (one unit at a time)
    p.checkpoints[task.step].write_unit(p.state.trained.index(unit), p.state.saved_unit(unit))
    return 12 * unit.flat_map.numel


@HANDLERS.register("sync_step")
def run_sync_step(p: StepProgram, task: SyncStep, ctx: TaskContext) -> None:
    node_barrier()
