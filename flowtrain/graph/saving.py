"""Checkpoints as tasks: one ``save`` per unit, placed between two steps' Adam of that unit.

A checkpoint after step ``s`` must hold every unit exactly as step ``s``'s Adam left it. In the
DAG that is two kinds of edge per unit, and nothing else waits::

    cpu_adam L3 (s) -> save L3 (s) -> cpu_adam L3 (s+1)
    gpu_adam embed (s) -> save embed (s) -> gpu_adam embed (s+1)

So the next step's forward and backward run while the ``io`` lane writes the checkpoint (they
read the weights, which the save only reads too); only the next step's update of a unit waits
for that unit's write. Where the processes of a node share the state (``StepSpec.share``), the
process that saves is not the one that updates most units: its saves wait for the step's
``sync_step`` (every owner's Adam is in), and its next ``reduce_grad`` of each unit waits for
the unit's save, which holds back the owner's update of it (the owner's ``cpu_adam`` needs that
sum)::

    sync_step (s) -> save L3 (s) -> reduce_grad L3 (s+1)

:func:`add_saves` adds the save tasks to step ``s``'s graph; :func:`save_edges` gives the edges
into the next step's graph, for the executor to add beside
:func:`~flowtrain.graph.cross_step.cross_step_edges`::

    graph = compile_step(spec, step=s)
    saves = add_saves(graph, spec)                    # step s ends with a checkpoint
    ...
    nxt = compile_step(spec, step=s + 1)
    edges = cross_step_edges(graph, nxt, spec) + save_edges(saves, nxt)

This module is pure graph code: no torch.
"""

from __future__ import annotations

from typing import Iterable

import networkx as nx

from .spec import StepSpec, trained_units
from .tasks import CpuAdam, GpuAdam, ReduceGrad, SaveUnit, SyncStep, Task, WriteState, check_shape

ADAM_KINDS = (CpuAdam, GpuAdam)


def add_saves(graph: nx.DiGraph, spec: StepSpec, step: int | None = None) -> list[Task]:
    """Add a ``save`` task per trained unit (with LoRA, per adapter) to one step's graph, after every Adam task of that unit
    (all of its gradient chunks) and, where its state is on disk, every ``write_state`` of it;
    returns them, bottom unit first. ``step`` defaults to the
    graph's; into an empty graph (a step already finished) the saves go with no edges."""
    step = next(iter(graph)).step if step is None else step
    adams: dict[tuple[str | None, int | None], list[Task]] = {}
    syncs = [t for t in graph if isinstance(t, SyncStep)]
    for t in graph:
        if isinstance(t, ADAM_KINDS + (WriteState,)):
            adams.setdefault((t.unit, t.layer), []).append(t)
    saves: list[Task] = []
    for unit, layer in trained_units(spec):
        save = SaveUnit(step=step, unit=unit, layer=layer)
        check_shape(save)
        graph.add_node(save)
        for a in adams.get((unit, layer), []) + syncs:
            graph.add_edge(a, save, reads=False)
        saves.append(save)
    return saves


def save_edges(saves: Iterable[Task], later: Iterable[Task]) -> list[tuple[Task, Task]]:
    """Edges from each unit's save to that unit's Adam tasks in a later step: the update must
    not change the weights while they are being written. Where the later step ends in a
    ``sync_step`` (shared state), also to the unit's ``reduce_grad``: the owner process's
    update of the unit waits for that sum, so for this process's write."""
    later = list(later)
    shared = any(isinstance(t, SyncStep) for t in later)
    kinds = ADAM_KINDS + ((ReduceGrad,) if shared else ())
    by_unit = {(s.unit, s.layer): s for s in saves}
    return [(by_unit[(t.unit, t.layer)], t) for t in later
            if isinstance(t, kinds) and (t.unit, t.layer) in by_unit]
