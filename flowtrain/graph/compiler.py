"""Compile one training step into a DAG of typed tasks.

The graph's edges are data dependencies only; *when* independent tasks run is a policy's
choice. Nodes are inserted in a natural serial order (the order one thread would run them),
which policies may use as a starting point; networkx keeps insertion order.

A 2-layer, 1-micro-batch step with checkpoints every layer looks like this (``=>`` marks an
edge that reads the producer's slot)::

    fetch embed ==> embed m0 -> forward L0 m0 -> forward L1 m0 -> loss m0 -> backward L1 m0
    fetch L0 (fwd) ==> forward L0          fetch head ==> loss      fetch L1 (bwd) ==> backward L1
    fetch L1 (fwd) ==> forward L1          zero_grad head ==> loss -> offload_grad head -> cpu_adam head
    backward L1 m0 -> backward L0 m0 -> embed_backward m0 -> offload_grad embed -> cpu_adam embed
    zero_grad L1 ==> backward L1 m0 -> offload_grad L1 -> cpu_adam L1      (and so on for L0)

``cpu_adam`` of a unit depends only on that unit's backward work, so Adam for upper layers can
run on the CPU while the device is still in backward below them. The next step's ``fetch`` of
a unit depends on this step's ``cpu_adam`` of it (:func:`cross_step_edges`), so steps may overlap.

Micro-batch order: ``"layer"`` (layer-major) runs every micro-batch through a layer before the
next layer, so each unit is fetched once per pass; ``"micro"`` (micro-batch-major) runs each
micro-batch through the whole model and fetches weights per micro-batch.

Where the parts are, each a module of this package: :mod:`~flowtrain.graph.spec` (the
:class:`StepSpec` and its checks), :mod:`~flowtrain.graph.builder` (how a task and an edge are
added), :mod:`~flowtrain.graph.step_builder` (one step's tasks and edges, stage by stage, and
what each setting of the spec changes), :mod:`~flowtrain.graph.cross_step` (the edges between
steps). This module puts them together and keeps the names that other code imports from here.
"""

from __future__ import annotations

import networkx as nx

from ..errors import ConfigError
from .cross_step import cross_step_edges
from .spec import MAX_LAYER_PASSES, StepSpec, check_layer_passes, checkpoint_layers, trained_units, units
from .step_builder import StepBuilder

__all__ = ["MAX_LAYER_PASSES", "StepSpec", "check_layer_passes", "checkpoint_layers", "compile_step", "compile_steps",
           "cross_step_edges", "trained_units", "units"]


def compile_step(spec: StepSpec, step: int = 0) -> nx.DiGraph:
    """Build the task graph of one optimizer step (``step`` is stamped on every task).

    The stages are called in serial order, which is the order the nodes are inserted in.
    Layer-major, all micro-batches go through each stage together, and each layer's gradient is
    handed off as soon as its backward is done. Micro-batch-major, each micro-batch runs forward
    and backward alone, and the gradients are handed off once every micro-batch has added to them.
    A spec of more than :data:`MAX_LAYER_PASSES` layer passes is refused before a task is built.
    """
    spec.validate()
    s = StepBuilder(spec, step)
    every = range(spec.micro_batches)
    if spec.order == "layer":
        s.forward(every, fetch_mb=None)
        s.hand_off_head()  # complete once every loss has run
        s.backward(every, fetch_mb=None, hand_off=True)
    else:
        for m in every:
            s.forward([m], fetch_mb=m)
            s.backward([m], fetch_mb=m, hand_off=False)
        s.hand_off_head()
        for i in reversed(range(spec.layers)):
            s.hand_off_layer(i)
    s.hand_off_embed()
    s.optimizer()
    s.place_disk_reads()
    return s.g


def compile_steps(spec: StepSpec, steps: int) -> nx.DiGraph:
    """``steps`` consecutive steps in one graph, linked by :func:`cross_step_edges`; refused
    before a task is built where they would hold more than :data:`MAX_LAYER_PASSES` layer passes."""
    if steps < 1:
        raise ConfigError(f"steps must be at least 1 (got {steps})")
    spec.validate()
    check_layer_passes(spec.layers, spec.micro_batches, steps)
    graph = compile_step(spec, 0)
    for s in range(1, steps):
        nxt = compile_step(spec, s)
        edges = cross_step_edges([t for t in graph if t.step == s - 1], nxt, spec)
        graph = nx.compose(graph, nxt)
        graph.add_edges_from(edges, reads=False)
    return graph

