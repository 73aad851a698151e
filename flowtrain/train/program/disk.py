"""Handlers of the state folder: ``read_state`` and ``write_state``, and the part they share.

Where a unit's optimizer state lives on disk (``--state-dir``, :mod:`flowtrain.train.disk_state`),
``read_state`` reads one chunk of it into a ``host_state`` staging slot early in the step, its
``cpu_adam`` updates it there (:meth:`DiskPart.pieces` hands the update the slot's views), and
``write_state`` writes the slot back. Between the two the chunk is *bound* to its slot; an undo
of a step found not finite (``verify_step``) puts a record back into the slot while it is bound
(the write that follows takes it), or into the file once it has been written.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ...graph.tasks import HOST_STATE, ReadState, Task, WriteState
from ...runtime.engine import TaskContext
from ..disk_state import StateStore, aligned_empty
from ..host_state import HostState, UnitState
from .registry import HANDLERS

if TYPE_CHECKING:
    from ..nonfinite import Saved
    from .core import StepProgram


class DiskPart:
    """The ``host_state`` staging slots and the store behind them (none without a state folder)."""

    def __init__(self, state: HostState, budgets: dict[str, int]) -> None:
        self.state = state
        self.store: StateStore | None = state.store
        n = self.store.slot_numel if self.store is not None else 0
        self.slots = [aligned_empty(n) for _ in range(budgets.get(HOST_STATE, 0))] if n else []

    def pieces(self, unit: UnitState, task: Task, lo: int, hi: int):
        """``(master, m, v, put_back)`` of ``[lo, hi)`` for a unit's ``cpu_adam``: views of the
        unit's host tensors, or where its state is on disk, of the slot its ``read_state``
        filled (the master still in memory where only the moments are on disk); ``put_back``
        undoes an update (None: the undo record's own way)."""
        if not unit.disk_fields:
            return unit.master[lo:hi], unit.exp_avg[lo:hi], unit.exp_avg_sq[lo:hi], None
        assert self.store is not None
        key = (unit.flat_map.key, task.chunk)
        views = self.store.bound[key]
        master = views["master"] if unit.master_on_disk else unit.master[lo:hi]
        return master, views["exp_avg"], views["exp_avg_sq"], functools.partial(self.restore, key)

    def restore(self, key: tuple[str, int | None], saved: Saved) -> None:
        """Put an undo record of a chunk on disk back: into its slot while it is bound (the
        ``write_state`` to come writes it), else into its file."""
        assert self.store is not None
        u, fields = saved.unit, saved.fields()
        with self.store.lock:  # a write_state writes and unbinds under it
            views = self.store.bound.get(key)
            if views is not None:
                for name, view in views.items():
                    view.copy_(fields[name])
            else:
                sf = self.store.files[key]
                self.store.fill(*key, {k: fields[k] for k in u.disk_fields}, aligned_empty(sf.numel))
        if not u.master_on_disk:
            u.master[saved.lo:saved.hi].copy_(fields["master"])
        u.refresh_from(fields["master"], saved.lo)


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

