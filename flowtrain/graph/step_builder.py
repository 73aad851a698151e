"""The tasks and edges of one training step, stage by stage: :class:`StepBuilder`.

:func:`~flowtrain.graph.compiler.compile_step` is a short list of calls to ``StepBuilder``, one
method per stage, in the order the tasks are inserted: forward (``embed``, each layer's
``forward``, ``loss``), backward (per checkpoint segment from the top, ``recompute`` then
``backward``; last ``embed_backward``), gradient hand-off (``offload_grad``, or a resident unit's
last gradient writers) and the optimizer (a streamed unit's ``cpu_adam`` as soon as its gradient
is handed off; the ``grad_norm`` / ``found_inf`` gate and the Adam held back for it;
``verify_step``).

What the settings of a :class:`~flowtrain.graph.spec.StepSpec` do to the graph:

Checkpoint spacing ``k``: the inputs of layers ``0, k, 2k, ...`` are kept from the forward pass;
in backward, each segment ``[c, c+k)`` first rebuilds the inputs of ``c+1 .. c+k-1`` with
``recompute`` tasks (which fetch those layers' weights once more), then runs backward from the
top of the segment down.

Activations: a layer in ``keep`` runs its forward under autograd and keeps what the backward
needs on the device; its ``forward`` and ``backward`` tasks carry activations ``"keep"`` and the
backward computes no forward again. The graph's shape is the same (the backward still fetches
the layer's weights: the kept tensors refer to the weights by place, not by copy). A layer in
``save_attention`` recomputes, but its forward keeps its attention output on the device and the
rebuild before its backward skips attention: activations ``"attn"`` on both tasks, the same graph.

Placement: a unit named in ``resident`` keeps its master weights and Adam state in device
memory. It has no ``fetch``, ``zero_grad`` or ``offload_grad``: its tasks read the unit's own
device buffers, and a ``gpu_adam`` on the compute lane updates it; the next step's tasks that
read the unit wait for that ``gpu_adam``, fenced on the device.

LoRA (``lora``): the base model is frozen and each decoder layer's adapters (unit
``adapter.i``) are resident on the device. The base's units are fetched and computed as ever,
but have no ``zero_grad``, ``offload_grad`` or Adam, and nothing runs ``embed_backward`` (no
gradient reaches the embedding). Each layer's backward adds into its adapters' own gradient,
and a ``gpu_adam`` of ``adapter.i`` follows the step's ``found_inf`` like any resident unit's;
the next step's tasks that run layer i wait for it. With ``host_adapters`` the adapters are
streamed instead: layer i's ``fetch`` brings them with its weights, its backward adds into a
gradient slot of ``adapter.i`` (its own ``zero_grad``), and an ``offload_grad`` (whole: no
staging chunks) and a ``cpu_adam`` follow, which the next step's fetches of layer i wait for.

Non-finite steps (see ``flowtrain.train.nonfinite``): a step whose loss or any gradient is not
finite must not change any weight. Every ``loss`` precedes every Adam task (all gradients flow
from the losses), so the loss is always checked first. A ``cpu_adam`` checks what is known when
it runs; a lower layer's gradient can still turn out bad afterwards, so one ``verify_step``
(cpu lane) follows every ``cpu_adam`` of the step and puts back what they changed, and the next
step's fetches wait for it (:func:`~flowtrain.graph.cross_step.cross_step_edges`). A resident
unit cannot be put back without a host sync, so every ``gpu_adam`` waits for one ``found_inf``
task (compute lane) that follows every gradient of the step and flags, on the device, whether
any is not finite. With ``grad_clip`` the ``grad_norm`` task already follows every gradient and
precedes every Adam: it decides for the whole step, and neither task is added.

Gradient layout: with ``staged``, ``offload_grad`` copies a unit's gradient into a pinned host
*staging slot* (pool ``host_grads``) that its ``cpu_adam`` reads and then gives back, so no
per-unit host gradient exists. A unit larger than one staging slot (the embedding, the head)
is offloaded and updated in ``grad_chunks[key]`` pieces, each a pair ``offload_grad c<k>`` ->
``cpu_adam c<k>``.

Optimizer state on disk (``disk``): a streamed unit named there keeps its Adam moments (and
perhaps its fp32 master) in a file. Each of its ``cpu_adam`` tasks (one per staging chunk)
reads a host staging slot that a ``read_state`` filled from the file, and a ``write_state``
after it puts the slot back into the file::

    read_state L3 ==> cpu_adam L3 -> write_state L3        (read_state L3 ==> write_state L3)

The ``disk`` lane issues in order, so where its tasks stand in the serial order is what makes
the reads run ahead: the first ``disk_ahead`` reads (in the order the Adam tasks come) open the
step, before its first fetch, and every later read follows the write ``disk_ahead`` places
before it, whose slot it will take. So the disk reads a unit's state while the layers below
it still run their forward and backward, and ``disk_ahead`` staging slots are enough.

Idle experts (``skip_idle_experts``): a sparse layer named there leaves alone the experts that no token of
the step was routed to, as ``torch.optim.AdamW`` skips a parameter without a gradient. Which
experts those are is known once its forwards have run, so the layer's ``recompute`` and
``backward`` fetches follow its ``forward`` of every micro-batch they serve (an edge from each)
and copy only the experts that routing reached; nothing else of the graph changes. (A resident
layer has no fetch: its ``gpu_adam`` leaves the idle experts alone on the device.)
"""

from __future__ import annotations

from typing import Iterable

from .builder import GraphBuilder
from .spec import StepSpec, checkpoint_layers
from .tasks import (
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    Fetch,
    FetchAct,
    FetchPass,
    Forward,
    KeptActivations,
    FoundInf,
    GpuAdam,
    GradNorm,
    GradSqNorm,
    Loss,
    OffloadAct,
    OffloadGrad,
    ReadState,
    Recompute,
    ReduceGrad,
    SyncStep,
    Task,
    VerifyStep,
    WriteState,
    ZeroGrad,
)


class StepBuilder(GraphBuilder):
    """One step's graph under construction: one method per stage, called by
    :func:`~flowtrain.graph.compiler.compile_step`.

    Stages pass tasks to each other through the tables below, keyed by ``(layer, micro_batch)``.
    In the methods, ``mbs`` are the micro-batches a call covers (all of them layer-major, one
    micro-batch-major) and ``fetch_mb`` the micro-batch its fetches serve (``None`` where one
    fetch serves them all).
    """

    def __init__(self, spec: StepSpec, step: int) -> None:
        super().__init__(spec, step)
        self.spec = spec
        L, k = spec.layers, spec.checkpoint_every
        #: checkpoint segments ``[c, end)``: the input of layer ``c`` is kept from the forward.
        self.segments = [(c, min(c + k, L)) for c in sorted(checkpoint_layers(L, k))]
        self.fwd_input: dict[tuple[int, int], Task] = {}  # producer of layer i's input, forward
        self.bwd_input: dict[tuple[int, int], Task] = {}  # producer of layer i's input, backward
        self.grad_out: dict[tuple[int, int], Task] = {}  # producer of d(output of layer i)
        self.act_offload: dict[tuple[int, int], Task] = {}  # offload_act of layer i's input
        self.act_fetched: set[tuple[int, int]] = set()  # bwd_input entries that are fetch_act slots
        self.losses: dict[int, Task] = {}
        self.embed_grads: list[Task] = []  # the embed_backward tasks
        self.grad_slot: dict[tuple[str, int | None], Task] = {}  # zero_grad of a streamed unit
        self.head_hand_off: list[Task] = []
        self.hand_offs: list[Task] = []  # every gradient hand-off, for grad_norm / found_inf
        self.resident_done: list[Task] = []  # the last gradient writers of resident units
        self.held_back: list[tuple[list[Task], str, int | None]] = []  # Adam placed after the gate

    # ---- weights and gradient slots ----------------------------------------------------
    def fetch(self, unit: str, layer: int | None, phase: FetchPass, fetch_mb: int | None) -> Task | None:
        """The fetch of a streamed unit; ``None`` for a resident one (its weights are there)."""
        if self.spec.is_resident(unit, layer):
            return None
        return self.node(Fetch, unit=unit, layer=layer, phase=phase, micro_batch=fetch_mb)

    def zero_grad(self, unit: str, layer: int | None) -> Task | None:
        """The gradient slot of a streamed unit, zeroed once a step and added to by every
        micro-batch; ``None`` for a resident one (it has its own)."""
        if self.spec.is_resident(unit, layer) or self.spec.is_frozen(unit):
            return None
        key = (unit, layer)
        if key not in self.grad_slot:
            self.grad_slot[key] = self.node(ZeroGrad, unit=unit, layer=layer)
        return self.grad_slot[key]

    def reads(self, slot_task: Task | None, consumer: Task) -> None:
        """``consumer`` reads the slot ``slot_task`` filled; no edge for a resident unit's ``None``."""
        if slot_task is not None:
            self.dep(slot_task, consumer, reads=True)

    def layer_activations(self, i: int) -> KeptActivations | None:
        """What layer i's forward and backward keep for the backward: ``"keep"`` where its
        activations stay, ``"attn"`` where its attention output does."""
        if i in self.spec.keep:
            return "keep"
        return "attn" if i in self.spec.save_attention else None

    # ---- forward: embed, layer forwards, loss ------------------------------------------
    def forward(self, mbs: Iterable[int], fetch_mb: int | None) -> None:
        """Embed ``mbs``, run them up through every layer, and end each in its loss."""
        self.embed(mbs, fetch_mb)
        for i in range(self.spec.layers):
            self.layer_forward(i, mbs, fetch_mb)
        self.loss(mbs, fetch_mb)

    def embed(self, mbs: Iterable[int], fetch_mb: int | None) -> None:
        """``embed`` per micro-batch, reading the embedding's weights: the input of layer 0."""
        f = self.fetch("embed", None, "forward", fetch_mb)
        for m in mbs:
            t = self.node(Embed, unit="embed", micro_batch=m)
            self.reads(f, t)
            self.fwd_input[(0, m)] = t

    def layer_forward(self, i: int, mbs: Iterable[int], fetch_mb: int | None) -> None:
        """``forward`` of layer i per micro-batch: its weights and its input give layer i+1's."""
        f = self.fetch("layer", i, "forward", fetch_mb)
        for m in mbs:
            t = self.node(Forward, unit="layer", layer=i, micro_batch=m, activations=self.layer_activations(i))
            self.reads(f, t)
            self.dep(self.fwd_input[(i, m)], t)
            self.offloaded_before(i, m, t)
            self.fwd_input[(i + 1, m)] = t
            if i in self.spec.offload:  # the forward has read its input: off to the host
                o = self.node(OffloadAct, unit="layer", layer=i, micro_batch=m)
                self.dep(t, o)
                self.act_offload[(i, m)] = o

    def offloaded_before(self, i: int, m: int, t: Task) -> None:
        """Bound the checkpoints that wait on the device for their ``offload_act``: task ``t``
        (layer i's forward of micro-batch m, or with ``i`` = layers its loss) starts only once
        the offload of the input of layer ``i - offload_lag`` has been issued. Without it the
        forward runs as far ahead of a slow copy lane as the weight slots let it, each layer
        leaving another micro-batch's checkpoint on the device (a 10 GiB llama-8b step ran out
        of memory so, about 1.1 GiB past its plan, once its first step page-locked the host
        buffers on the d2h lane)."""
        lag = self.spec.offload_lag
        # the loss stands for every layer past the top: it waits for the last ``lag`` offloads
        sources = [i - lag] if i < self.spec.layers else range(i - lag, i)
        for j in sources:
            o = self.act_offload.get((j, m))
            if o is not None:
                self.dep(o, t)

    def loss(self, mbs: Iterable[int], fetch_mb: int | None) -> None:
        """``loss`` per micro-batch on the top layer's output. It also starts the backward: it
        writes the head's gradient into the head's slot (the head has no backward task) and
        produces the gradient of the top layer's output."""
        f = self.fetch("head", None, "forward", fetch_mb)
        z = self.zero_grad("head", None)
        for m in mbs:
            t = self.node(Loss, unit="head", micro_batch=m)
            self.reads(f, t)
            self.reads(z, t)
            self.dep(self.fwd_input[(self.spec.layers, m)], t)
            self.offloaded_before(self.spec.layers, m, t)
            self.losses[m] = t

    # ---- backward: recompute segments, layer backwards, embed backward ------------------
    def backward(self, mbs: Iterable[int], fetch_mb: int | None, *, hand_off: bool) -> None:
        """Run ``mbs`` back down the model one checkpoint segment at a time, from the top: first
        rebuild the inputs the forward did not keep (``recompute``), then the segment's layers'
        backward top-down; end in ``embed_backward``. With ``hand_off`` each layer's gradient
        goes to its optimizer right after its backward (layer-major: all micro-batches are in)."""
        for m in mbs:
            for c, _ in self.segments:
                self.bwd_input[(c, m)] = self.fwd_input[(c, m)]
            self.grad_out[(self.spec.layers - 1, m)] = self.losses[m]
        for c, end in reversed(self.segments):
            for j in range(c, end - 1):
                self.recompute(j, mbs, fetch_mb)
            for i in reversed(range(c, end)):
                self.layer_backward(i, mbs, fetch_mb)
                if hand_off:
                    self.hand_off_layer(i)
        self.embed_backward(mbs)

    def recompute(self, j: int, mbs: Iterable[int], fetch_mb: int | None) -> None:
        """``recompute`` of layer j: its forward once more (its weights fetched once more) to
        rebuild the input of layer j+1 inside a segment."""
        f = self.fetch("layer", j, "recompute", fetch_mb)
        self.after_routing(f, j, mbs)
        for m in mbs:
            self.fetch_back(j, m)
            t = self.node(Recompute, unit="layer", layer=j, micro_batch=m)
            self.reads(f, t)
            self.dep(self.bwd_input[(j, m)], t, reads=(j, m) in self.act_fetched)
            self.bwd_input[(j + 1, m)] = t

    def after_routing(self, f: Task | None, i: int, mbs: Iterable[int]) -> None:
        """Where layer i skips idle experts (``skip_idle_experts``), its backward-side fetch ``f`` follows
        the forwards of the micro-batches it serves: their routing says which experts to copy."""
        if f is not None and i in self.spec.skip_idle_experts:
            for m in mbs:
                self.dep(self.fwd_input[(i + 1, m)], f)

    def fetch_back(self, i: int, m: int) -> None:
        """Where layer i's input was offloaded, the ``fetch_act`` that brings it back, placed
        just before the first backward task that reads it (after that layer's weight fetch on
        the h2d lane, so it is copied while the layer above runs its backward)."""
        if i in self.spec.offload and (i, m) not in self.act_fetched:
            t = self.node(FetchAct, unit="layer", layer=i, micro_batch=m)
            self.dep(self.act_offload[(i, m)], t)
            self.bwd_input[(i, m)] = t
            self.act_fetched.add((i, m))

    def layer_backward(self, i: int, mbs: Iterable[int], fetch_mb: int | None) -> None:
        """``backward`` of layer i: from its weights, its input and the gradient of its output,
        the gradient of its input (for layer i-1), added to layer i's gradient slot."""
        f = self.fetch("layer", i, "backward", fetch_mb)
        self.after_routing(f, i, mbs)
        z = self.zero_grad("adapter" if self.spec.lora else "layer", i)
        for m in mbs:
            self.fetch_back(i, m)
            t = self.node(Backward, unit="layer", layer=i, micro_batch=m, activations=self.layer_activations(i))
            self.reads(f, t)
            self.reads(z, t)
            self.dep(self.bwd_input[(i, m)], t, reads=(i, m) in self.act_fetched)
            self.dep(self.grad_out[(i, m)], t)
            self.grad_out[(i - 1, m)] = t

    def embed_backward(self, mbs: Iterable[int]) -> None:
        """``embed_backward``: the gradient of layer 0's input, added to the embedding's slot
        (none for a frozen embedding)."""
        if self.spec.is_frozen("embed"):
            return
        z = self.zero_grad("embed", None)
        for m in mbs:
            t = self.node(EmbedBackward, unit="embed", micro_batch=m)
            self.reads(z, t)
            self.dep(self.grad_out[(-1, m)], t)
            self.embed_grads.append(t)

    # ---- gradient hand-off ---------------------------------------------------------------
    def hand_off_head(self) -> None:
        """Hand the head's gradient (written by every ``loss``) to its optimizer. A tied head's
        Adam is queued later, by :meth:`hand_off_embed`: the matrix is the embedding's. A frozen
        head has none."""
        if self.spec.is_frozen("head"):
            return
        self.head_hand_off = self.hand_off_gradient("head", None, list(self.losses.values()))
        if not self.spec.tied:
            self.adam(self.head_hand_off, "head", None)

    def hand_off_layer(self, i: int) -> None:
        """Hand layer i's gradient (written by its ``backward`` of every micro-batch) to its
        optimizer (with LoRA, its adapters' gradient)."""
        writers = [self.grad_out[(i - 1, m)] for m in range(self.spec.micro_batches)]
        unit = "adapter" if self.spec.lora else "layer"
        self.adam(self.hand_off_gradient(unit, i, writers), unit, i)

    def hand_off_embed(self) -> None:
        """Hand the embedding's gradient to its optimizer, then, when tied, the head's (neither
        when frozen)."""
        if self.spec.is_frozen("embed"):
            return
        self.adam(self.hand_off_gradient("embed", None, self.embed_grads), "embed", None)
        if self.spec.tied:
            self.adam(self.head_hand_off, "head", None)

    def hand_off_gradient(self, unit: str, layer: int | None, readers: list[Task]) -> list[Task]:
        """What hands a unit's finished gradient to its optimizer: ``offload_grad`` tasks of a
        streamed unit (one per staging chunk), or, for a resident unit, its last gradient
        writers themselves (plus a ``grad_sq_norm`` when clipping needs the norm first); data
        parallel, after the ``reduce_grad`` that sums it over the processes."""
        if self.spec.reduce:  # summed over the processes first; what follows waits for it
            total = self.node(ReduceGrad, unit=unit, layer=layer)
            self.reads(self.grad_slot.get((unit, layer)), total)  # a resident unit has no slot
            for r in readers:
                self.dep(r, total)
            readers = [total]
        if self.spec.is_resident(unit, layer):
            self.resident_done.extend(readers)
            if self.spec.grad_clip:
                t = self.node(GradSqNorm, unit=unit, layer=layer)
                for r in readers:
                    self.dep(r, t)
                self.hand_offs.append(t)
            return list(readers)
        slot = self.grad_slot[(unit, layer)]
        # adapters in host memory keep a whole host gradient of their own (a few MB a layer)
        staged = self.spec.staged and unit != "adapter"
        chunks = [None] if not staged else list(range(self.spec.chunks(unit, layer)))
        out = []
        for c in chunks:
            t = self.node(OffloadGrad, unit=unit, layer=layer, chunk=c)
            self.dep(slot, t, reads=True)
            for r in readers:
                self.dep(r, t)
            self.hand_offs.append(t)
            out.append(t)
        return out

    # ---- optimizer: cpu_adam / gpu_adam, grad_norm / found_inf gate, verify_step ----------
    def adam(self, offs: list[Task], unit: str, layer: int | None) -> None:
        """A unit's Adam on its handed-off gradient: placed now, or held back for the step's
        gate (:meth:`optimizer`) when clipping needs the global norm first or the unit is
        resident (a ``gpu_adam`` cannot be put back, so it must know the step is finite)."""
        if self.spec.grad_clip or self.spec.is_resident(unit, layer):
            self.held_back.append((offs, unit, layer))
            return
        self.adam_tasks(offs, unit, layer, norm=None)

    def optimizer(self) -> None:
        """Close the step: the gate (``grad_norm`` with clipping, else ``found_inf`` if any Adam
        was held back), the held-back Adam tasks after it, bottom-up so that the next step's
        forward can start as soon as possible, and, without clipping, ``verify_step``."""
        gate = None
        if self.spec.grad_clip:
            gate = self.after_all(GradNorm, self.hand_offs)
        elif self.held_back:
            gate = self.after_all(FoundInf, self.hand_offs + self.resident_done)
        order = {"embed": -1, "layer": 0, "adapter": 0, "head": self.spec.layers}
        for offs, unit, layer in sorted(self.held_back, key=lambda a: order[a[1]] + (a[2] or 0)):
            self.adam_tasks(offs, unit, layer, norm=gate)
        if not self.spec.grad_clip:
            self.verify_step(gate)
        if self.spec.share > 1:
            self.sync_step()

    def adam_tasks(self, offs: list[Task], unit: str, layer: int | None, norm: Task | None) -> None:
        """``gpu_adam`` of a resident unit after all its gradient writers; ``cpu_adam`` of a
        streamed one, per offloaded chunk (reading the chunk's staging slot when staged); each
        also after ``norm`` (the step's ``grad_norm`` or ``found_inf``) where there is one."""
        if self.spec.is_resident(unit, layer):
            t = self.node(GpuAdam, unit=unit, layer=layer)
            for off in offs:
                self.dep(off, t)
            after = [t]
        else:
            after = []
            for off in offs:
                read = (self.node(ReadState, unit=unit, layer=layer, chunk=off.chunk)
                        if self.spec.on_disk(unit, layer) else None)
                t = self.node(CpuAdam, unit=unit, layer=layer, chunk=off.chunk)
                self.dep(off, t, reads=off.takes is not None)
                if read is not None:  # the state comes from disk and goes back after the update
                    self.reads(read, t)
                    write = self.node(WriteState, unit=unit, layer=layer, chunk=off.chunk)
                    self.dep(t, write)
                    self.reads(read, write)
                after.append(t)
        for t in after:
            if norm is not None:
                self.dep(norm, t)
            if self.spec.tied and unit == "embed" and not self.spec.is_resident(unit, layer):
                for h in self.head_hand_off:
                    self.dep(h, t)  # the tied matrix also has the head's gradient

    def place_disk_reads(self) -> None:
        """Move each ``read_state`` to where the ``disk`` lane should issue it (module
        docstring): the first ``disk_ahead`` to the start of the step, each later one right
        after the ``write_state`` that frees the slot it takes. A read has no dependency inside
        the step, so the order stays topological."""
        if not self.spec.disk:
            return
        nodes = list(self.g.nodes)
        reads = [t for t in nodes if isinstance(t, ReadState)]  # in the order the Adam tasks come
        writes = [t for t in nodes if isinstance(t, WriteState)]
        ahead = self.spec.disk_ahead
        follows = {writes[i]: reads[i + ahead] for i in range(len(reads) - ahead)}
        order = reads[:ahead]
        for t in nodes:
            if not isinstance(t, ReadState):
                order.append(t)
                if t in follows:
                    order.append(follows[t])
        g = self.g.__class__(**self.g.graph)
        g.add_nodes_from(order)
        g.add_edges_from(self.g.edges(data=True))
        self.g = g

    def after_all(self, cls: type[Task], gradients: list[Task]) -> Task:
        """One task after every gradient of the step (each ``offload_grad``, or each resident
        unit's last writer), which every held-back Adam task then waits for: ``grad_norm`` (the global norm
        for clipping, on the host) or ``found_inf`` (whether any gradient or the loss is not
        finite, on the device, for the resident units' ``gpu_adam``)."""
        t = self.node(cls)
        for g in gradients:
            self.dep(g, t)
        return t

    def verify_step(self, found_inf: Task | None) -> None:
        """``verify_step`` once every check of the step's gradients is on the host: each
        offload's flags, ``found_inf`` (which covers the resident units' gradients) and, with a
        tied embedding, the embedding's ``cpu_adam``, which checks the summed gradient. It
        settles the step: if something was not finite it puts back what the Adam tasks before it
        changed, and the ones after it skip; if all was finite they update with no undo record.
        It does not wait for every ``cpu_adam``, so the next step's fetches of the units the CPU
        has already updated can start while it works on the rest. None without a ``cpu_adam``:
        resident units are only ever updated once the step is known finite."""
        adams = [t for t in self.g if isinstance(t, CpuAdam)]
        if not adams:
            return
        t = self.node(VerifyStep)
        checks: list[Task] = [o for o in self.hand_offs if isinstance(o, OffloadGrad)]
        if self.spec.tied:
            checks += [a for a in adams if a.unit == "embed"]
        for a in checks + ([found_inf] if found_inf is not None else []):
            self.dep(a, t)

    def sync_step(self) -> None:
        """``sync_step`` after every ``cpu_adam`` and ``verify_step`` of the step (in every
        process: the owners' updates are all in once each has passed it)."""
        t = self.node(SyncStep)
        for a in [t2 for t2 in self.g if isinstance(t2, (CpuAdam, VerifyStep))]:
            self.dep(a, t)
