"""Save tasks: each unit's ``save`` sits between its Adam of this step and of the next.

A 1-layer step that ends with a checkpoint, and the next step (only the edges added here)::

    cpu_adam embed (s0) --> save embed (s0) --> cpu_adam embed (s1)
    cpu_adam L0 c0 (s0) -+
    cpu_adam L0 c1 (s0) -+-> save L0 (s0) ----> cpu_adam L0 c0 (s1), cpu_adam L0 c1 (s1)
    gpu_adam head (s0) ---> save head (s0) ---> gpu_adam head (s1)
"""

from __future__ import annotations

import itertools

import networkx as nx
import pytest

from flowtrain.graph import (
    CpuAdam,
    Fetch,
    GpuAdam,
    SaveUnit,
    StepSpec,
    add_saves,
    compile_step,
    cross_step_edges,
    save_edges,
    units,
)

SPECS = [
    StepSpec(layers=L, micro_batches=M, order=o, tied=t, grad_clip=c, resident=r, staged=st,
             grad_chunks={"embed": 3, "head": 2} if st else {})
    for L, M, o, t, c, r, st in itertools.product(
        [1, 3], [1, 2], ["layer", "micro"], [False, True], [False, True], [(), ("embed", "head", "layer.0")],
        [False, True])
    if not (c and st)
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_one_save_per_unit_after_all_of_its_adam(spec):
    g = compile_step(spec, step=4)
    saves = add_saves(g, spec)
    assert [(s.unit, s.layer) for s in saves] == units(spec)
    assert all(s.step == 4 and s.lane == "io" for s in saves)
    assert nx.is_directed_acyclic_graph(g)
    for s in saves:
        adams = [t for t in g if isinstance(t, (CpuAdam, GpuAdam)) and (t.unit, t.layer) == (s.unit, s.layer)]
        assert adams, s
        assert set(g.predecessors(s)) == set(adams)
        assert g.out_degree(s) == 0  # nothing in this step waits for the disk


@pytest.mark.parametrize("spec", SPECS[:8], ids=str)
def test_next_step_updates_wait_for_the_save_and_nothing_else_does(spec):
    g0 = compile_step(spec, step=0)
    saves = add_saves(g0, spec)
    g1 = compile_step(spec, step=1)
    edges = save_edges(saves, g1)
    consumers = {v for _, v in edges}
    assert consumers == {t for t in g1 if isinstance(t, (CpuAdam, GpuAdam))}
    assert all((u.unit, u.layer) == (v.unit, v.layer) for u, v in edges)
    # The two steps together stay acyclic, and the next forward does not wait for any save.
    both = nx.compose(g0, g1)
    both.add_edges_from(cross_step_edges(g0, g1, spec))
    both.add_edges_from(edges)
    assert nx.is_directed_acyclic_graph(both)
    for f in (t for t in g1 if isinstance(t, Fetch)):
        assert not any(isinstance(a, SaveUnit) for a in nx.ancestors(both, f))


def test_saves_of_a_finished_step_stand_alone():
    spec = StepSpec(layers=2)
    g = nx.DiGraph()
    saves = add_saves(g, spec, step=7)
    assert [(s.unit, s.layer, s.step) for s in saves] == [(u, layer, 7) for u, layer in units(spec)]
    assert g.number_of_edges() == 0
