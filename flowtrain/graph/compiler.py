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

Checkpoint spacing ``k``: the inputs of layers ``0, k, 2k, ...`` are kept from the forward pass;
in backward, each segment ``[c, c+k)`` first rebuilds the inputs of ``c+1 .. c+k-1`` with
``recompute`` tasks (which fetch those layers' weights once more), then runs backward from the
top of the segment down.

Micro-batch order: ``"layer"`` (layer-major) runs every micro-batch through a layer before the
next layer, so each unit is fetched once per pass; ``"micro"`` (micro-batch-major) runs each
micro-batch through the whole model and fetches weights per micro-batch.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import msgspec
import networkx as nx

from ..errors import ConfigError
from .tasks import (
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    Fetch,
    Forward,
    GradNorm,
    Loss,
    OffloadGrad,
    Recompute,
    Task,
    ZeroGrad,
)


class StepSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to compile: the shape of one optimizer step."""

    layers: int
    micro_batches: int = 1
    checkpoint_every: int = 1
    order: str = "layer"
    tied: bool = False
    grad_clip: bool = False

    def validate(self) -> "StepSpec":
        if self.layers < 1:
            raise ConfigError(f"--layers must be at least 1 (got {self.layers})")
        if self.micro_batches < 1:
            raise ConfigError(f"--micro-batches must be at least 1 (got {self.micro_batches})")
        if self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be at least 1 (got {self.checkpoint_every})")
        if self.order not in ("layer", "micro"):
            raise ConfigError(f"--order must be 'layer' or 'micro' (got {self.order!r})")
        return self


def units(spec: StepSpec) -> list[tuple[str, int | None]]:
    """The parameter units of the model, bottom to top: embed, layers, head."""
    return [("embed", None), *(("layer", i) for i in range(spec.layers)), ("head", None)]


class _Builder:
    """Adds nodes in serial order and edges with a ``reads`` flag."""

    def __init__(self, spec: StepSpec, step: int) -> None:
        self.g = nx.DiGraph(spec=msgspec.to_builtins(spec))
        self.step = step

    def node(self, cls: type[Task], **fields) -> Task:
        task = cls(step=self.step, **fields)
        assert task not in self.g, f"duplicate task {task}"
        self.g.add_node(task)
        return task

    def dep(self, producer: Task, consumer: Task, *, reads: bool = False) -> None:
        if self.g.has_edge(producer, consumer):
            self.g.edges[producer, consumer]["reads"] |= reads
        else:
            self.g.add_edge(producer, consumer, reads=reads)


def compile_step(spec: StepSpec, step: int = 0) -> nx.DiGraph:
    """Build the task graph of one optimizer step (``step`` is stamped on every task)."""
    spec.validate()
    b = _Builder(spec, step)
    L, M, k = spec.layers, spec.micro_batches, spec.checkpoint_every
    layer_major = spec.order == "layer"
    mbs = range(M)

    def fetch(unit: str, layer: int | None, phase: str, m: int | None) -> Task:
        return b.node(Fetch, unit=unit, layer=layer, phase=phase, micro_batch=None if layer_major else m)

    # Which task produced the input of layer i for micro-batch m during the forward pass.
    fwd_input: dict[tuple[int, int], Task] = {}
    embeds: dict[int, Task] = {}
    losses: dict[int, Task] = {}

    # ---- forward ---------------------------------------------------------------------
    def forward_pass(m_range: Iterator[int] | range, per_mb: int | None) -> None:
        f = fetch("embed", None, "forward", per_mb)
        for m in m_range:
            embeds[m] = b.node(Embed, unit="embed", micro_batch=m)
            b.dep(f, embeds[m], reads=True)
            fwd_input[(0, m)] = embeds[m]

    def layer_forward(i: int, m_range, per_mb: int | None) -> None:
        f = fetch("layer", i, "forward", per_mb)
        for m in m_range:
            t = b.node(Forward, unit="layer", layer=i, micro_batch=m)
            b.dep(f, t, reads=True)
            b.dep(fwd_input[(i, m)], t)
            fwd_input[(i + 1, m)] = t

    head_grad = None

    def loss_pass(m_range, per_mb: int | None) -> None:
        nonlocal head_grad
        f = fetch("head", None, "forward", per_mb)
        if head_grad is None:
            head_grad = b.node(ZeroGrad, unit="head")
        for m in m_range:
            t = b.node(Loss, unit="head", micro_batch=m)
            b.dep(f, t, reads=True)
            b.dep(head_grad, t, reads=True)
            b.dep(fwd_input[(L, m)], t)
            losses[m] = t

    # ---- backward --------------------------------------------------------------------
    grad_slot: dict[tuple[str, int | None], Task] = {}
    grad_out: dict[tuple[int, int], Task] = {}  # producer of d(output of layer i) for m
    bwd_input: dict[tuple[int, int], Task] = {}  # producer of the input of layer i in backward
    offloads: list[Task] = []

    def zero_grad(unit: str, layer: int | None) -> Task:
        key = (unit, layer)
        if key not in grad_slot:
            grad_slot[key] = b.node(ZeroGrad, unit=unit, layer=layer)
        return grad_slot[key]

    def recompute(j: int, m_range, per_mb: int | None) -> None:
        f = fetch("layer", j, "recompute", per_mb)
        for m in m_range:
            t = b.node(Recompute, unit="layer", layer=j, micro_batch=m)
            b.dep(f, t, reads=True)
            b.dep(bwd_input[(j, m)], t)
            bwd_input[(j + 1, m)] = t

    def backward(i: int, m_range, per_mb: int | None) -> None:
        f = fetch("layer", i, "backward", per_mb)
        z = zero_grad("layer", i)
        for m in m_range:
            t = b.node(Backward, unit="layer", layer=i, micro_batch=m)
            b.dep(f, t, reads=True)
            b.dep(z, t, reads=True)
            b.dep(bwd_input[(i, m)], t)
            b.dep(grad_out[(i, m)], t)
            grad_out[(i - 1, m)] = t

    def embed_backward(m_range) -> None:
        z = zero_grad("embed", None)
        for m in m_range:
            t = b.node(EmbedBackward, unit="embed", micro_batch=m)
            b.dep(z, t, reads=True)
            b.dep(grad_out[(-1, m)], t)

    def offload(unit: str, layer: int | None, readers: list[Task]) -> Task:
        t = b.node(OffloadGrad, unit=unit, layer=layer)
        slot = grad_slot[(unit, layer)] if unit != "head" else head_grad
        b.dep(slot, t, reads=True)
        for r in readers:
            b.dep(r, t)
        offloads.append(t)
        return t

    adam_after: list[tuple[Task, str, int | None]] = []

    def adam(off: Task, unit: str, layer: int | None) -> None:
        if spec.grad_clip:
            adam_after.append((off, unit, layer))  # placed after the global norm
            return
        t = b.node(CpuAdam, unit=unit, layer=layer)
        b.dep(off, t)
        if spec.tied and unit == "embed":
            b.dep(head_offload, t)  # the tied matrix also has the head's gradient

    segments = [(c, min(c + k, L)) for c in range(0, L, k)]

    def backward_inputs(m: int) -> None:
        for c, _ in segments:
            bwd_input[(c, m)] = fwd_input[(c, m)]
        grad_out[(L - 1, m)] = losses[m]

    head_offload: Task | None = None
    if layer_major:
        forward_pass(mbs, None)
        for i in range(L):
            layer_forward(i, mbs, None)
        loss_pass(mbs, None)
        head_offload = offload("head", None, [losses[m] for m in mbs])
        if not spec.tied:
            adam(head_offload, "head", None)
        for m in mbs:
            backward_inputs(m)
        for c, end in reversed(segments):
            for j in range(c, end - 1):
                recompute(j, mbs, None)
            for i in reversed(range(c, end)):
                backward(i, mbs, None)
                adam(offload("layer", i, [grad_out[(i - 1, m)] for m in mbs]), "layer", i)
        embed_backward(mbs)
    else:
        for m in mbs:
            forward_pass([m], m)
            for i in range(L):
                layer_forward(i, [m], m)
            loss_pass([m], m)
            backward_inputs(m)
            for c, end in reversed(segments):
                for j in range(c, end - 1):
                    recompute(j, [m], m)
                for i in reversed(range(c, end)):
                    backward(i, [m], m)
            embed_backward([m])
        head_offload = offload("head", None, [losses[m] for m in mbs])
        if not spec.tied:
            adam(head_offload, "head", None)
        for i in reversed(range(L)):
            adam(offload("layer", i, [grad_out[(i - 1, m)] for m in mbs]), "layer", i)
    embed_readers = [t for t in b.g if isinstance(t, EmbedBackward)]
    embed_off = offload("embed", None, embed_readers)
    adam(embed_off, "embed", None)
    if spec.tied:
        adam(head_offload, "head", None)

    if spec.grad_clip:
        norm = b.node(GradNorm)
        for off in offloads:
            b.dep(off, norm)
        # Bottom-up, so that the next step's forward can start as soon as possible.
        order = {"embed": -1, "layer": 0, "head": L}
        for off, unit, layer in sorted(adam_after, key=lambda a: order[a[1]] + (a[2] or 0)):
            t = b.node(CpuAdam, unit=unit, layer=layer)
            b.dep(off, t)
            b.dep(norm, t)
            if spec.tied and unit == "embed":
                b.dep(head_offload, t)
    return b.g


def cross_step_edges(earlier: Iterable[Task], later: Iterable[Task], spec: StepSpec) -> list[tuple[Task, Task]]:
    """The edges from one step's ``cpu_adam`` of each unit to every ``fetch`` of that unit in
    a later step. With tied embeddings the head's fetch carries the embedding matrix, so it
    waits for both. Executors that receive steps one at a time add these themselves."""
    adams = {(t.unit, t.layer): t for t in earlier if isinstance(t, CpuAdam)}
    edges = []
    for t in later:
        if isinstance(t, Fetch):
            edges.append((adams[(t.unit, t.layer)], t))
            if spec.tied and t.unit == "head":
                edges.append((adams[("embed", None)], t))
    return edges


def compile_steps(spec: StepSpec, steps: int) -> nx.DiGraph:
    """``steps`` consecutive steps in one graph, linked by :func:`cross_step_edges`."""
    if steps < 1:
        raise ConfigError(f"steps must be at least 1 (got {steps})")
    graph = compile_step(spec, 0)
    for s in range(1, steps):
        nxt = compile_step(spec, s)
        edges = cross_step_edges([t for t in graph if t.step == s - 1], nxt, spec)
        graph = nx.compose(graph, nxt)
        graph.add_edges_from(edges, reads=False)
    return graph

