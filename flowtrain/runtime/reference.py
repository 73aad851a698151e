"""The reference executor: one task at a time, in topological order, on the calling thread.

A few dozen lines with no lanes, fences or policies, so that its results are obviously right.
The async :class:`~flowtrain.runtime.engine.Engine` must give the same numbers; tests compare
them. Slots are numbered per pool and recycled as soon as every task reading one has run::

    records = run_reference(graph, program)
"""

from __future__ import annotations

import time

import networkx as nx

from ..errors import StepFailed
from ..graph.tasks import Task, pool_of
from .engine import Program, TaskContext
from .scheduler import Launch
from .trace import TaskRecord


def run_reference(graph: nx.DiGraph, program: Program) -> list[TaskRecord]:
    """Run every task of ``graph`` in a topological order; return their records."""
    free: dict[str, list[int]] = {}
    used: dict[str, int] = {}
    slot_of: dict[Task, int] = {}
    readers_left = {t: sum(1 for _, _, r in graph.out_edges(t, data="reads") if r) for t in graph}
    zero = time.perf_counter()
    records = []
    for task in nx.topological_sort(graph):
        slot = None
        if task.takes is not None:
            pool = free.setdefault(task.takes, [])
            slot = pool.pop(0) if pool else used.setdefault(task.takes, 0)
            if slot == used.get(task.takes):
                used[task.takes] = slot + 1
            slot_of[task] = slot
        holders = [p for p, _, r in graph.in_edges(task, data="reads") if r]
        reads: dict[str, list[int]] = {}
        for h in holders:
            reads.setdefault(pool_of(h), []).append(slot_of[h])
        launch = Launch(task, slot, reads, ())
        start = time.perf_counter() - zero
        try:
            moved = program(task, TaskContext(launch, None)) or 0
        except Exception as exc:
            raise StepFailed(task, exc) from exc
        end = time.perf_counter() - zero
        records.append(TaskRecord(task=task, lane=task.lane, start=start, end=end, slot=slot, reads=reads,
                                  bytes=int(moved), deps=list(graph.predecessors(task))))
        for h in holders:
            readers_left[h] -= 1
            if readers_left[h] == 0:
                free[pool_of(h)].append(slot_of[h])
                free[pool_of(h)].sort()
        if task.takes is not None and readers_left[task] == 0:
            assert slot is not None  # granted above: the task takes a slot
            free[task.takes].append(slot)
    return records
