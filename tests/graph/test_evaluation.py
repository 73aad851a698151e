"""The held-out loss graph: forward only, after the step's Adam of every unit."""

from __future__ import annotations

import networkx as nx
import pytest

from flowtrain.errors import ConfigError
from flowtrain.graph import StepSpec, compile_eval, compile_step, cross_step_edges


def edges(g):
    return {(str(a), str(b), d["reads"]) for a, b, d in g.edges(data=True)}


def test_layer_major_eval_graph():
    """
    fetch embed (eval) ==> embed m0 (eval) -> forward L0 m0 (eval) -> eval_loss head m0
                       ==> embed m1 (eval) -> forward L0 m1 (eval) -> eval_loss head m1
    fetch L0 (eval) ==> forward L0 m0, m1        fetch head (eval) ==> eval_loss head m0, m1
    """
    g = compile_eval(StepSpec(layers=1, micro_batches=4), step=2, micro_batches=2)
    assert [str(t) for t in g] == [
        "fetch embed (eval) s2", "embed m0 (eval) s2", "embed m1 (eval) s2", "fetch L0 (eval) s2",
        "forward L0 m0 (eval) s2", "forward L0 m1 (eval) s2", "fetch head (eval) s2",
        "eval_loss head m0 s2", "eval_loss head m1 s2",
    ]
    assert edges(g) == {
        ("fetch embed (eval) s2", "embed m0 (eval) s2", True), ("fetch embed (eval) s2", "embed m1 (eval) s2", True),
        ("fetch L0 (eval) s2", "forward L0 m0 (eval) s2", True), ("fetch L0 (eval) s2", "forward L0 m1 (eval) s2", True),
        ("embed m0 (eval) s2", "forward L0 m0 (eval) s2", False), ("embed m1 (eval) s2", "forward L0 m1 (eval) s2", False),
        ("fetch head (eval) s2", "eval_loss head m0 s2", True), ("fetch head (eval) s2", "eval_loss head m1 s2", True),
        ("forward L0 m0 (eval) s2", "eval_loss head m0 s2", False),
        ("forward L0 m1 (eval) s2", "eval_loss head m1 s2", False),
    }
    kinds = {t.kind for t in g}
    assert kinds == {"fetch", "embed", "forward", "eval_loss"}  # no gradient, no backward, no Adam
    assert all(t.takes in (None, "weights") for t in g)


def test_micro_major_fetches_per_micro_batch_and_resident_units_have_none():
    spec = StepSpec(layers=2, order="micro", resident=("layer.1",))
    g = compile_eval(spec, step=0, micro_batches=2)
    fetches = sorted(str(t) for t in g if t.kind == "fetch")
    assert fetches == sorted(f"fetch {u} m{m} (eval)" for u in ("embed", "L0", "head") for m in (0, 1))
    assert nx.is_directed_acyclic_graph(g)


@pytest.mark.parametrize("spec", [
    StepSpec(layers=3, micro_batches=2),
    StepSpec(layers=3, micro_batches=2, resident=("embed", "head", "layer.1"), order="micro"),
    StepSpec(layers=2, tied=True, grad_clip=True),
])
def test_eval_reads_weights_after_every_units_adam(spec):
    """The training steps' cross-step edges put every eval weight read after the step's Adam of
    the unit (and the step's verify_step), so the eval graph and the step compose into one DAG
    whose eval tasks all come after every Adam task."""
    step = compile_step(spec, step=5)
    ev = compile_eval(spec, step=5, micro_batches=3)
    assert not set(step) & set(ev)  # phase "eval" keeps the tasks apart
    both = nx.compose(step, ev)
    both.add_edges_from(cross_step_edges(step, ev, spec), reads=False)
    assert nx.is_directed_acyclic_graph(both)
    adams = [t for t in step if t.kind in ("cpu_adam", "gpu_adam")]
    for t in ev:
        if t.kind == "eval_loss":
            assert all(nx.has_path(both, a, t) for a in adams)


def test_needs_a_micro_batch():
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        compile_eval(StepSpec(layers=1), step=0, micro_batches=0)
