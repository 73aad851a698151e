"""Compile a held-out loss evaluation into a forward-only DAG of typed tasks.

An evaluation runs the model forward over held-out micro-batches with the weights of the end of
optimizer step ``step`` and sums the cross-entropy of every target token. It is a graph of its
own, run by the same engine as the training steps, so policies, traces and the visualizer see
it: ``fetch`` (phase ``"eval"``), ``embed`` and ``forward`` (phase ``"eval"``, which keeps them
apart from the training step's tasks of the same step), and one ``eval_loss`` per micro-batch.
There is no gradient slot, no backward and no Adam. A 2-layer, 2-micro-batch evaluation in
layer-major order (``=>`` marks an edge that reads the producer's slot)::

    fetch embed (eval) ==> embed m0 (eval) -> forward L0 m0 (eval) -> forward L1 m0 (eval) -> eval_loss m0
                       ==> embed m1 (eval) -> forward L0 m1 (eval) -> forward L1 m1 (eval) -> eval_loss m1
    fetch L0 (eval) ==> forward L0 m*     fetch L1 (eval) ==> forward L1 m*     fetch head (eval) ==> eval_loss m*

It must read the weights *after* step ``step``'s Adam of every unit: the edges that say so are
the training steps' own :func:`~flowtrain.graph.cross_step.cross_step_edges` (each ``fetch``
after its unit's Adam and the step's ``verify_step``; a resident unit's readers after its
``gpu_adam``)::

    step = compile_step(spec, step=4)
    ev = compile_eval(spec, step=4, micro_batches=3)
    engine.add(ev, after=cross_step_edges(step, ev, spec))

Nothing here stops the *next* step's Adam from changing weights the evaluation still reads;
the caller waits for the evaluation before adding that step (``flowtrain.train.loop``).
Micro-batch order follows ``spec.order``, as in training: ``"layer"`` fetches each unit once
and keeps one activation per micro-batch alive; ``"micro"`` fetches per micro-batch.
"""

from __future__ import annotations

import networkx as nx

from ..errors import ConfigError
from .builder import GraphBuilder
from .spec import StepSpec
from .tasks import EVAL, Embed, Eval, EvalLoss, Fetch, Forward, Task


def compile_eval(spec: StepSpec, step: int, micro_batches: int) -> nx.DiGraph:
    """The forward-only graph of a held-out loss over ``micro_batches`` micro-batches, with the
    weights after optimizer step ``step`` (stamped on every task)."""
    spec.validate()
    if micro_batches < 1:
        raise ConfigError(f"an evaluation needs at least one micro-batch (got {micro_batches})")
    b = GraphBuilder(spec, step)
    b.g.graph["eval"] = True
    L = spec.layers
    last: dict[int, Task] = {}  # the producer of each micro-batch's current activation

    def fetch(unit: str, layer: int | None, m: int | None) -> Task | None:
        if spec.is_resident(unit, layer):
            return None  # its weights are on the device already
        return b.node(Fetch, unit=unit, layer=layer, phase=EVAL, micro_batch=m)

    def run(cls: type[Task], unit: str, layer: int | None, ms: list[int], per_mb: int | None) -> None:
        f = fetch(unit, layer, per_mb)
        for m in ms:
            phase: Eval | None = EVAL if cls is not EvalLoss else None  # eval_loss: its kind says so
            t = b.node(cls, unit=unit, layer=layer, micro_batch=m, phase=phase)
            if f is not None:
                b.dep(f, t, reads=True)
            if m in last:
                b.dep(last[m], t)
            last[m] = t

    def through_model(ms: list[int], per_mb: int | None) -> None:
        run(Embed, "embed", None, ms, per_mb)
        for i in range(L):
            run(Forward, "layer", i, ms, per_mb)
        run(EvalLoss, "head", None, ms, per_mb)

    if spec.order == "layer":
        through_model(list(range(micro_batches)), None)
    else:
        for m in range(micro_batches):
            through_model([m], m)
    return b.g
