"""Handlers of the state folder: ``read_state`` and ``write_state``, and the part they share.

Where a unit's optimizer state lives on disk (``--state-dir``, :mod:`flowtrain.train.disk_state`),
``read_state`` reads one chunk of it into a ``host_state`` staging slot early in the step, its
``cpu_adam`` updates it there (:meth:`DiskPart.pieces` hands the update the slot's views), and
``write_state`` writes the slot back. Between the two the chunk is *bound* to its slot; an undo
of a step found not finite (``verify_step``) puts a record back into the slot while it is bound
(the write that follows takes it), or into the file once it has been written
(:class:`~.disk_part.DiskPart`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...graph.tasks import HOST_STATE, ReadState, WriteState
from ...runtime.engine import TaskContext
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("read_state")
def run_read_state(p: StepProgram, task: ReadState, ctx: TaskContext) -> int:
    """One chunk's state from its file into the slot this task took."""
    store = p.disk.store
    assert store is not None
    key = (p.unit(task).flat_map.key, task.chunk)
    views = store.read(*key, p.disk.slots[ctx.slot])  # type: ignore[index]
    with store.lock:
        store.bound[key] = views
    return 4 * store.files[key].numel


@HANDLERS.register("write_state")
def run_write_state(p: StepProgram, task: WriteState, ctx: TaskContext) -> int:
    """The chunk's state, as its ``cpu_adam`` left it in the slot, back into its file."""
    store = p.disk.store
    assert store is not None
    key = (p.unit(task).flat_map.key, task.chunk)
    with store.lock:
        store.write(*key, p.disk.slots[ctx.read(HOST_STATE)])
        del store.bound[key]
    return 4 * store.files[key].numel

