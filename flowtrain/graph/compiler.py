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

Activations: a layer in ``keep`` runs its forward under autograd and keeps what the backward
needs on the device; its ``forward`` and ``backward`` tasks carry phase ``"keep"`` and the
backward computes no forward again. The graph's shape is the same (the backward still fetches
the layer's weights: the kept tensors refer to the weights by place, not by copy).

Placement: a unit named in ``resident`` keeps its master weights and Adam state in device
memory. It has no ``fetch``, ``zero_grad`` or ``offload_grad``: its tasks read the unit's own
device buffers, and a ``gpu_adam`` on the compute lane updates it; the next step's tasks that
read the unit wait for that ``gpu_adam``, fenced on the device.

Non-finite steps (see ``flowtrain.train.nonfinite``): a step whose loss or any gradient is not
finite must not change any weight. Every ``loss`` precedes every Adam task (all gradients flow
from the losses), so the loss is always checked first. A ``cpu_adam`` checks what is known when
it runs; a lower layer's gradient can still turn out bad afterwards, so one ``verify_step``
(cpu lane) follows every ``cpu_adam`` of the step and puts back what they changed, and the next
step's fetches wait for it (:func:`cross_step_edges`). A resident unit cannot be put back
without a host sync, so every ``gpu_adam`` waits for one ``found_inf`` task (compute lane) that
follows every gradient of the step and flags, on the device, whether any is not finite. With
``grad_clip`` the ``grad_norm`` task already follows every gradient and precedes every Adam:
it decides for the whole step, and neither task is added.

Gradient layout: with ``staged``, ``offload_grad`` copies a unit's gradient into a pinned host
*staging slot* (pool ``host_grads``) that its ``cpu_adam`` reads and then gives back, so no
per-unit host gradient exists. A unit larger than one staging slot (the embedding, the head)
is offloaded and updated in ``grad_chunks[key]`` pieces, each a pair ``offload_grad c<k>`` ->
``cpu_adam c<k>``.

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
    FoundInf,
    GradNorm,
    Loss,
    OffloadGrad,
    Recompute,
    GpuAdam,
    GradSqNorm,
    Task,
    VerifyStep,
    WEIGHT_READERS,
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
    #: units whose state lives on the device (``"embed"``, ``"head"``, ``"layer.3"``, ...).
    resident: tuple[str, ...] = ()
    #: gradients leave through host staging slots (12 bytes per parameter), not per-unit buffers.
    staged: bool = False
    #: with ``staged``: how many staging-slot chunks a unit's gradient takes (1 if not named).
    grad_chunks: dict[str, int] = msgspec.field(default_factory=dict)
    #: layers whose forward keeps what its backward needs on the device (activation placement
    #: ``keep``): their ``forward`` and ``backward`` tasks carry phase ``"keep"``, and their
    #: backward runs no forward again. The other layers recompute (``checkpoint_every``).
    keep: tuple[int, ...] = ()

    def unit_key(self, unit: str, layer: int | None) -> str:
        return f"layer.{layer}" if unit == "layer" else unit

    def is_resident(self, unit: str, layer: int | None) -> bool:
        return self.unit_key(unit, layer) in self.resident

    def chunks(self, unit: str, layer: int | None) -> int:
        return self.grad_chunks.get(self.unit_key(unit, layer), 1)

    def validate(self) -> "StepSpec":
        if self.layers < 1:
            raise ConfigError(f"--layers must be at least 1 (got {self.layers})")
        if self.micro_batches < 1:
            raise ConfigError(f"--micro-batches must be at least 1 (got {self.micro_batches})")
        if self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be at least 1 (got {self.checkpoint_every})")
        if self.order not in ("layer", "micro"):
            raise ConfigError(f"--order must be 'layer' or 'micro' (got {self.order!r})")
        valid = {"embed", "head", *(f"layer.{i}" for i in range(self.layers))}
        unknown = sorted(set(self.resident) - valid)
        if unknown:
            raise ConfigError(f"resident units {unknown} are not units of this model (embed, layer.0..layer.{self.layers - 1}, head)")
        if self.tied and ("embed" in self.resident) != ("head" in self.resident):
            raise ConfigError("a tied embedding is read by the head: keep embed and head both resident or both streamed")
        if self.staged and self.grad_clip:
            raise ConfigError(
                "--grad-clip needs every gradient before any update, so it keeps a whole host gradient: "
                "use --layout full (16 bytes per parameter) with --grad-clip"
            )
        if self.keep and self.checkpoint_every != 1:
            raise ConfigError(
                "kept activations need a checkpoint at every layer: use --activation-checkpoint-every 1 "
                "with --activations keep (a segment recomputes all of its layers)"
            )
        bad = sorted(i for i in self.keep if not 0 <= i < self.layers)
        if bad or len(set(self.keep)) != len(self.keep):
            raise ConfigError(f"kept layers {list(self.keep)} must be distinct layers of 0..{self.layers - 1}")
        if any(c < 1 for c in self.grad_chunks.values()):
            raise ConfigError(f"grad_chunks must be at least 1 (got {self.grad_chunks})")
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

    def fetch(unit: str, layer: int | None, phase: str, m: int | None) -> Task | None:
        """The fetch of a streamed unit; ``None`` for a resident one (its weights are there)."""
        if spec.is_resident(unit, layer):
            return None
        return b.node(Fetch, unit=unit, layer=layer, phase=phase, micro_batch=None if layer_major else m)

    def reads(slot_task: Task | None, consumer: Task) -> None:
        if slot_task is not None:
            b.dep(slot_task, consumer, reads=True)

    keep = frozenset(spec.keep)

    def kept(i: int) -> str | None:
        """The phase of layer i's forward and backward: ``"keep"`` where its activations stay."""
        return "keep" if i in keep else None

    # Which task produced the input of layer i for micro-batch m during the forward pass.
    fwd_input: dict[tuple[int, int], Task] = {}
    embeds: dict[int, Task] = {}
    losses: dict[int, Task] = {}

    # ---- forward ---------------------------------------------------------------------
    def forward_pass(m_range: Iterator[int] | range, per_mb: int | None) -> None:
        f = fetch("embed", None, "forward", per_mb)
        for m in m_range:
            embeds[m] = b.node(Embed, unit="embed", micro_batch=m)
            reads(f, embeds[m])
            fwd_input[(0, m)] = embeds[m]

    def layer_forward(i: int, m_range, per_mb: int | None) -> None:
        f = fetch("layer", i, "forward", per_mb)
        for m in m_range:
            t = b.node(Forward, unit="layer", layer=i, micro_batch=m, phase=kept(i))
            reads(f, t)
            b.dep(fwd_input[(i, m)], t)
            fwd_input[(i + 1, m)] = t

    head_grad = None

    def loss_pass(m_range, per_mb: int | None) -> None:
        nonlocal head_grad
        f = fetch("head", None, "forward", per_mb)
        if head_grad is None:
            head_grad = zero_grad("head", None)
        for m in m_range:
            t = b.node(Loss, unit="head", micro_batch=m)
            reads(f, t)
            reads(head_grad, t)
            b.dep(fwd_input[(L, m)], t)
            losses[m] = t

    # ---- backward --------------------------------------------------------------------
    grad_slot: dict[tuple[str, int | None], Task] = {}
    grad_out: dict[tuple[int, int], Task] = {}  # producer of d(output of layer i) for m
    bwd_input: dict[tuple[int, int], Task] = {}  # producer of the input of layer i in backward
    offloads: list[Task] = []
    resident_done: list[Task] = []  # the last gradient writers of resident units

    def zero_grad(unit: str, layer: int | None) -> Task | None:
        """The gradient slot of a streamed unit; ``None`` for a resident one (it has its own)."""
        if spec.is_resident(unit, layer):
            return None
        key = (unit, layer)
        if key not in grad_slot:
            grad_slot[key] = b.node(ZeroGrad, unit=unit, layer=layer)
        return grad_slot[key]

    def recompute(j: int, m_range, per_mb: int | None) -> None:
        f = fetch("layer", j, "recompute", per_mb)
        for m in m_range:
            t = b.node(Recompute, unit="layer", layer=j, micro_batch=m)
            reads(f, t)
            b.dep(bwd_input[(j, m)], t)
            bwd_input[(j + 1, m)] = t

    def backward(i: int, m_range, per_mb: int | None) -> None:
        f = fetch("layer", i, "backward", per_mb)
        z = zero_grad("layer", i)
        for m in m_range:
            t = b.node(Backward, unit="layer", layer=i, micro_batch=m, phase=kept(i))
            reads(f, t)
            reads(z, t)
            b.dep(bwd_input[(i, m)], t)
            b.dep(grad_out[(i, m)], t)
            grad_out[(i - 1, m)] = t

    def embed_backward(m_range) -> None:
        z = zero_grad("embed", None)
        for m in m_range:
            t = b.node(EmbedBackward, unit="embed", micro_batch=m)
            reads(z, t)
            b.dep(grad_out[(-1, m)], t)

    def offload(unit: str, layer: int | None, readers: list[Task]) -> list[Task]:
        """What hands a unit's finished gradient to its optimizer: ``offload_grad`` tasks of a
        streamed unit (one per staging chunk), or, for a resident unit, its last gradient
        writers themselves (plus a ``grad_sq_norm`` when clipping needs the norm first)."""
        if spec.is_resident(unit, layer):
            resident_done.extend(readers)
            if spec.grad_clip:
                t = b.node(GradSqNorm, unit=unit, layer=layer)
                for r in readers:
                    b.dep(r, t)
                offloads.append(t)
            return list(readers)
        slot = grad_slot[(unit, layer)] if unit != "head" else head_grad
        chunks = [None] if not spec.staged else list(range(spec.chunks(unit, layer)))
        out = []
        for c in chunks:
            t = b.node(OffloadGrad, unit=unit, layer=layer, chunk=c)
            b.dep(slot, t, reads=True)
            for r in readers:
                b.dep(r, t)
            offloads.append(t)
            out.append(t)
        return out

    adam_after: list[tuple[list[Task], str, int | None]] = []

    def adam(offs: list[Task], unit: str, layer: int | None) -> None:
        if spec.grad_clip or spec.is_resident(unit, layer):
            adam_after.append((offs, unit, layer))  # placed after the global norm / found_inf
            return
        adam_tasks(offs, unit, layer, norm=None)

    def adam_tasks(offs: list[Task], unit: str, layer: int | None, norm: Task | None) -> None:
        """``gpu_adam`` of a resident unit after all its gradient writers; ``cpu_adam`` of a
        streamed one, per offloaded chunk (reading the chunk's staging slot when staged); each
        also after ``norm`` (the step's ``grad_norm`` or ``found_inf``) where there is one."""
        if spec.is_resident(unit, layer):
            t = b.node(GpuAdam, unit=unit, layer=layer)
            for off in offs:
                b.dep(off, t)
            after = [t]
        else:
            after = []
            for off in offs:
                t = b.node(CpuAdam, unit=unit, layer=layer, chunk=off.chunk)
                b.dep(off, t, reads=off.takes is not None)
                after.append(t)
        for t in after:
            if norm is not None:
                b.dep(norm, t)
            if spec.tied and unit == "embed" and not spec.is_resident(unit, layer):
                for h in head_offload:
                    b.dep(h, t)  # the tied matrix also has the head's gradient

    segments = [(c, min(c + k, L)) for c in range(0, L, k)]

    def backward_inputs(m: int) -> None:
        for c, _ in segments:
            bwd_input[(c, m)] = fwd_input[(c, m)]
        grad_out[(L - 1, m)] = losses[m]

    head_offload: list[Task] = []
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

    gate = None
    if spec.grad_clip:
        gate = _after_all(b, GradNorm, offloads)
    elif adam_after:
        gate = _after_all(b, FoundInf, offloads + resident_done)
    # Bottom-up, so that the next step's forward can start as soon as possible.
    order = {"embed": -1, "layer": 0, "head": L}
    for offs, unit, layer in sorted(adam_after, key=lambda a: order[a[1]] + (a[2] or 0)):
        adam_tasks(offs, unit, layer, norm=gate)
    if not spec.grad_clip:
        _verify_step(b, gate)
    return b.g


def _after_all(b: _Builder, cls: type[Task], gradients: list[Task]) -> Task:
    """One task after every gradient of the step (each offload, or each resident unit's last
    writer), which every held-back Adam task then waits for: ``grad_norm`` (the global norm for
    clipping, on the host) or ``found_inf`` (whether any gradient or the loss is not finite, on
    the device, for the resident units' ``gpu_adam``)."""
    t = b.node(cls)
    for g in gradients:
        b.dep(g, t)
    return t


def _verify_step(b: _Builder, found_inf: Task | None) -> None:
    """``verify_step`` after every ``cpu_adam`` of the step (and ``found_inf``, which covers the
    resident units' gradients): the point from which the step's updates are final. None without
    a ``cpu_adam``: resident units are only ever updated once the step is known finite."""
    adams = [t for t in b.g if isinstance(t, CpuAdam)]
    if not adams:
        return
    t = b.node(VerifyStep)
    for a in adams + ([found_inf] if found_inf is not None else []):
        b.dep(a, t)


def cross_step_edges(earlier: Iterable[Task], later: Iterable[Task], spec: StepSpec) -> list[tuple[Task, Task]]:
    """The edges from one step's Adam of each unit (every chunk's ``cpu_adam``, or its
    ``gpu_adam``) to what reads that unit's weights in a later step: every ``fetch`` of a
    streamed unit, every weight-reading task of a resident one. With tied embeddings the head
    also reads the embedding matrix, so it waits for both. Every ``fetch`` also waits for the
    step's ``verify_step``, which may put streamed units back. Executors that receive steps one
    at a time add these themselves."""
    adams: dict[tuple[str | None, int | None], list[Task]] = {}
    verify = []
    for t in earlier:
        if isinstance(t, (CpuAdam, GpuAdam)):
            adams.setdefault((t.unit, t.layer), []).append(t)
        elif isinstance(t, VerifyStep):
            verify.append(t)
    edges = []
    for t in later:
        if isinstance(t, Fetch) or (isinstance(t, WEIGHT_READERS) and spec.is_resident(t.unit, t.layer)):  # type: ignore[arg-type]
            edges += [(a, t) for a in adams[(t.unit, t.layer)]]
            if spec.tied and t.unit == "head":
                edges += [(a, t) for a in adams[("embed", None)]]
        if isinstance(t, Fetch):
            edges += [(v, t) for v in verify]
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

