"""The state folder's part of the step program: the ``host_state`` staging slots and the store.

:class:`DiskPart` hands a ``cpu_adam`` the master, m and v it updates (the unit's own, or the
slot a ``read_state`` filled) and puts an undo record of a unit on disk back; the handlers of
``read_state`` and ``write_state`` are :mod:`.disk`'s.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ...graph.tasks import HOST_STATE, Task
from ..disk_state import StateStore, aligned_empty
from ..host_state import HostState, UnitState

if TYPE_CHECKING:
    from ..nonfinite import Saved


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
