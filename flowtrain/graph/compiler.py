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
the layer's weights: the kept tensors refer to the weights by place, not by copy). A layer in
``save_attention`` recomputes, but its forward keeps its attention output on the device and the
rebuild before its backward skips attention: phase ``"attn"`` on both tasks, the same graph.

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

Idle experts (``routed``): a sparse layer named there leaves alone the experts that no token of
the step was routed to, as ``torch.optim.AdamW`` skips a parameter without a gradient. Which
experts those are is known once its forwards have run, so the layer's ``recompute`` and
``backward`` fetches follow its ``forward`` of every micro-batch they serve (an edge from each)
and copy only the experts that routing reached; nothing else of the graph changes. (A resident
layer has no fetch: its ``gpu_adam`` leaves the idle experts alone on the device.)

Micro-batch order: ``"layer"`` (layer-major) runs every micro-batch through a layer before the
next layer, so each unit is fetched once per pass; ``"micro"`` (micro-batch-major) runs each
micro-batch through the whole model and fetches weights per micro-batch.

Phases: :func:`compile_step` is a short list of calls to ``_StepBuilder``, one method per phase,
in the order the tasks are inserted: forward (``embed``, each layer's ``forward``, ``loss``),
backward (per checkpoint segment from the top, ``recompute`` then ``backward``; last
``embed_backward``), gradient hand-off (``offload_grad``, or a resident unit's last gradient
writers) and the optimizer (a streamed unit's ``cpu_adam`` as soon as its gradient is handed
off; the ``grad_norm`` / ``found_inf`` gate and the Adam held back for it; ``verify_step``).
"""

from __future__ import annotations

from typing import Iterable, Unpack

import msgspec
import networkx as nx

from ..errors import ConfigError
from .tasks import (
    WEIGHT_READERS,
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    Fetch,
    FetchAct,
    FetchPass,
    Forward,
    FoundInf,
    GpuAdam,
    GradNorm,
    GradSqNorm,
    Loss,
    OffloadAct,
    OffloadGrad,
    Placement,
    Recompute,
    ReduceGrad,
    SyncStep,
    Task,
    TaskFields,
    Unit,
    VerifyStep,
    ZeroGrad,
    check_shape,
)


def checkpoint_layers(layers: int, checkpoint_every: int) -> frozenset[int]:
    """The layers whose input the forward keeps for the backward, each the start of a segment
    the backward rebuilds from: every ``checkpoint_every``-th layer from layer 0. The compiler's
    segments and the step program's bookkeeping both ask here."""
    return frozenset(range(0, layers, checkpoint_every))


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
    #: layers whose input (a checkpoint: a segment start, not kept) goes to host memory after
    #: the layer's forward has read it (``offload_act``) and comes back before its backward
    #: (``fetch_act``): activation placement ``offload``.
    offload: tuple[int, ...] = ()
    #: layers (not kept) whose forward keeps its attention output and log-sum-exp on the device
    #: for the rebuild before its backward, which then runs no attention forward (activation
    #: placement ``attention``): their ``forward`` and ``backward`` tasks carry phase ``"attn"``.
    save_attention: tuple[int, ...] = ()
    #: data parallel: every unit's gradient is summed over the processes (``reduce_grad``)
    #: once this process's micro-batches are in, before it is handed off (offloaded, or, for
    #: a resident unit, normed and checked for the step's gate).
    reduce: bool = False
    #: data parallel with this many processes of a node sharing one host copy of the state:
    #: each streamed unit's ``cpu_adam`` updates it only in its owner process (:meth:`owner`),
    #: and a ``sync_step`` barrier ends the step. 1: every process keeps its own copy.
    share: int = 1
    #: LoRA: the base model is frozen; only each decoder layer's adapters (``adapter.i``,
    #: resident) are trained (see the module docstring).
    lora: bool = False
    #: with ``lora``: the adapters live in host memory instead, streamed: each layer's
    #: ``fetch`` brings its adapters with its weights, and their gradient has its own
    #: ``zero_grad``, ``offload_grad`` (whole, never staged) and ``cpu_adam``.
    host_adapters: bool = False
    #: sparse layers whose idle experts (those no token of the step was routed to) are left
    #: alone: the fetch before such a layer's recompute or backward follows its forwards (of
    #: the micro-batches it serves), whose routing says which experts to copy; the layer's
    #: gradient and Adam skip the idle ones. See the module docstring.
    routed: tuple[int, ...] = ()

    @property
    def offload_lag(self) -> int:
        """How many layers the forward of a micro-batch may run past an offloaded checkpoint
        before that checkpoint's ``offload_act`` has been issued. Layer-major with several
        micro-batches, one: the copy of layer i's input runs while the other micro-batches
        pass through layer i, long before layer i+1 needs the edge. With each micro-batch
        alone through the model (micro-batch order, or one micro-batch), two: the copy of
        layer i's input overlaps layer i+1's forward instead of delaying it."""
        return 1 if self.order == "layer" and self.micro_batches > 1 else 2

    def unit_key(self, unit: str, layer: int | None) -> str:
        return f"{unit}.{layer}" if layer is not None else unit

    def is_resident(self, unit: str, layer: int | None) -> bool:
        return (unit == "adapter" and not self.host_adapters) or self.unit_key(unit, layer) in self.resident

    def is_frozen(self, unit: str) -> bool:
        """Whether a unit takes no gradient: with LoRA, every unit of the base model."""
        return self.lora and unit != "adapter"

    def chunks(self, unit: str, layer: int | None) -> int:
        return self.grad_chunks.get(self.unit_key(unit, layer), 1)

    def owner(self, unit: str, layer: int | None) -> int:
        """Which of the ``share`` processes of a node runs the Adam of a streamed unit: the
        streamed units in model order, dealt round-robin, so each process updates about
        ``1 / share`` of the model."""
        return self._streamed().index((unit, layer)) % self.share

    def owned_by(self, local_rank: int) -> frozenset[str] | None:
        """The keys of the streamed units process ``local_rank`` of a node updates (see
        :meth:`owner`); None where the processes do not share the state (each updates all)."""
        if self.share < 2:
            return None
        return frozenset(self.unit_key(*u) for i, u in enumerate(self._streamed()) if i % self.share == local_rank)

    def _streamed(self) -> list[tuple[str, int | None]]:
        return [u for u in trained_units(self) if not self.is_resident(*u)]

    def validate(self) -> "StepSpec":
        """Refuse a spec that cannot be compiled. Errors name fields in braces (see
        :class:`~flowtrain.errors.ConfigError`): ``flowtrain graph`` spells them as its flags,
        ``flowtrain train`` as the settings that lead to them."""
        for name in ("layers", "micro_batches", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{{{name}}} must be at least 1 (got {getattr(self, name)})", named=True)
        if self.order not in ("layer", "micro"):
            raise ConfigError(f"{{order}} must be 'layer' or 'micro' (got {self.order!r})", named=True)
        valid = {"embed", "head", *(f"layer.{i}" for i in range(self.layers))}
        unknown = sorted(set(self.resident) - valid)
        if unknown:
            raise ConfigError(f"{{resident}} units {unknown} are not units of this model "
                              f"(embed, layer.0..layer.{self.layers - 1}, head)", named=True)
        if self.tied and ("embed" in self.resident) != ("head" in self.resident):
            raise ConfigError("a tied embedding is read by the head: keep embed and head both resident or both streamed")
        if self.staged and self.grad_clip:
            raise ConfigError(
                "{grad_clip} needs every gradient before any update, so it keeps a whole host gradient, 16 bytes "
                "per parameter: use {full_layout}", named=True
            )
        if self.keep and self.checkpoint_every != 1:
            raise ConfigError(
                "kept activations ({keep}) need a checkpoint at every layer: use {checkpoint_every} 1 with them "
                "(a segment recomputes all of its layers)", named=True
            )
        bad = sorted(i for i in self.keep if not 0 <= i < self.layers)
        if bad or len(set(self.keep)) != len(self.keep):
            raise ConfigError(f"kept layers ({{keep}}) {list(self.keep)} must be distinct layers of "
                              f"0..{self.layers - 1}", named=True)
        bad = sorted(i for i in self.offload if not 0 <= i < self.layers or i % self.checkpoint_every or i in self.keep)
        if bad or len(set(self.offload)) != len(self.offload):
            raise ConfigError(f"offloaded layers ({{offload}}) {bad or list(self.offload)} must be distinct layers "
                              f"whose input is a checkpoint: multiples of {{checkpoint_every}}, not kept", named=True)
        if self.save_attention and self.checkpoint_every != 1:
            raise ConfigError(
                "saved attention outputs ({save_attention}) need a checkpoint at every layer: use {checkpoint_every} "
                "1 with them (a segment's recompute tasks would run attention again)", named=True
            )
        bad = sorted(i for i in self.save_attention if not 0 <= i < self.layers or i in self.keep)
        if bad or len(set(self.save_attention)) != len(self.save_attention):
            raise ConfigError(f"layers saving attention ({{save_attention}}) {bad or list(self.save_attention)} must "
                              f"be distinct layers of 0..{self.layers - 1}, not kept", named=True)
        if self.share < 1 or (self.share > 1 and not self.reduce):
            raise ConfigError(f"{{share}} must be 1, or the processes of a node with reduce (got {self.share})",
                              named=True)
        if any(c < 1 for c in self.grad_chunks.values()):
            raise ConfigError(f"{{grad_chunks}} must be at least 1 (got {self.grad_chunks})", named=True)
        self._validate_routed()
        if self.host_adapters and not self.lora:
            raise ConfigError("adapters in host memory ({host_adapters}) are LoRA's: give {lora} with them", named=True)
        resident_layers = [u for u in self.resident if u.startswith("layer.")]
        if self.host_adapters and resident_layers:  # a layer's fetch is what brings its adapters
            raise ConfigError(f"adapters in host memory ({{host_adapters}}) come with their layer's fetch: leave "
                              f"{', '.join(resident_layers)} out of {{resident}}", named=True)
        return self

    def _validate_routed(self) -> None:
        bad = sorted(i for i in self.routed if not 0 <= i < self.layers)
        if bad or len(set(self.routed)) != len(self.routed):
            raise ConfigError(f"layers skipping idle experts ({{routed}}) {bad or list(self.routed)} must be distinct "
                              f"layers of 0..{self.layers - 1}", named=True)
        if self.routed and self.lora:
            raise ConfigError("skipping idle experts ({routed}) is for training the whole model, not LoRA", named=True)


def units(spec: StepSpec) -> list[tuple[Unit, int | None]]:
    """The parameter units of the model, bottom to top: embed, layers, head."""
    return [("embed", None), *(("layer", i) for i in range(spec.layers)), ("head", None)]


def trained_units(spec: StepSpec) -> list[tuple[Unit, int | None]]:
    """The units an optimizer updates, bottom to top: the model's, or with LoRA the layers'
    adapters."""
    if spec.lora:
        return [("adapter", i) for i in range(spec.layers)]
    return units(spec)


class _Builder:
    """Adds nodes in serial order and edges with a ``reads`` flag."""

    def __init__(self, spec: StepSpec, step: int) -> None:
        self.g = nx.DiGraph(spec=msgspec.to_builtins(spec))
        self.step = step

    def node(self, cls: type[Task], **fields: Unpack[TaskFields]) -> Task:
        task = cls(step=self.step, **fields)
        check_shape(task)  # each kind names what it should, nothing else
        assert task not in self.g, f"duplicate task {task}"
        self.g.add_node(task)
        return task

    def dep(self, producer: Task, consumer: Task, *, reads: bool = False) -> None:
        if self.g.has_edge(producer, consumer):
            self.g.edges[producer, consumer]["reads"] |= reads
        else:
            self.g.add_edge(producer, consumer, reads=reads)


def compile_step(spec: StepSpec, step: int = 0) -> nx.DiGraph:
    """Build the task graph of one optimizer step (``step`` is stamped on every task).

    The phases are called in serial order, which is the order the nodes are inserted in.
    Layer-major, all micro-batches go through each phase together, and each layer's gradient is
    handed off as soon as its backward is done. Micro-batch-major, each micro-batch runs forward
    and backward alone, and the gradients are handed off once every micro-batch has added to them.
    """
    spec.validate()
    s = _StepBuilder(spec, step)
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
    return s.g


class _StepBuilder(_Builder):
    """One step's graph under construction: one method per phase, called by :func:`compile_step`.

    Phases pass tasks to each other through the tables below, keyed by ``(layer, micro_batch)``.
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
        self.head_offload: list[Task] = []
        self.offloads: list[Task] = []  # every gradient hand-off, for grad_norm / found_inf
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

    def layer_phase(self, i: int) -> Placement | None:
        """The phase of layer i's forward and backward: ``"keep"`` where its activations stay,
        ``"attn"`` where its attention output does."""
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
            t = self.node(Forward, unit="layer", layer=i, micro_batch=m, phase=self.layer_phase(i))
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
        """Where layer i skips idle experts (``routed``), its backward-side fetch ``f`` follows
        the forwards of the micro-batches it serves: their routing says which experts to copy."""
        if f is not None and i in self.spec.routed:
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
            t = self.node(Backward, unit="layer", layer=i, micro_batch=m, phase=self.layer_phase(i))
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
        self.head_offload = self.offload("head", None, list(self.losses.values()))
        if not self.spec.tied:
            self.adam(self.head_offload, "head", None)

    def hand_off_layer(self, i: int) -> None:
        """Hand layer i's gradient (written by its ``backward`` of every micro-batch) to its
        optimizer (with LoRA, its adapters' gradient)."""
        writers = [self.grad_out[(i - 1, m)] for m in range(self.spec.micro_batches)]
        unit = "adapter" if self.spec.lora else "layer"
        self.adam(self.offload(unit, i, writers), unit, i)

    def hand_off_embed(self) -> None:
        """Hand the embedding's gradient to its optimizer, then, when tied, the head's (neither
        when frozen)."""
        if self.spec.is_frozen("embed"):
            return
        self.adam(self.offload("embed", None, self.embed_grads), "embed", None)
        if self.spec.tied:
            self.adam(self.head_offload, "head", None)

    def offload(self, unit: str, layer: int | None, readers: list[Task]) -> list[Task]:
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
                self.offloads.append(t)
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
            self.offloads.append(t)
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
            gate = self.after_all(GradNorm, self.offloads)
        elif self.held_back:
            gate = self.after_all(FoundInf, self.offloads + self.resident_done)
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
                t = self.node(CpuAdam, unit=unit, layer=layer, chunk=off.chunk)
                self.dep(off, t, reads=off.takes is not None)
                after.append(t)
        for t in after:
            if norm is not None:
                self.dep(norm, t)
            if self.spec.tied and unit == "embed" and not self.spec.is_resident(unit, layer):
                for h in self.head_offload:
                    self.dep(h, t)  # the tied matrix also has the head's gradient

    def after_all(self, cls: type[Task], gradients: list[Task]) -> Task:
        """One task after every gradient of the step (each offload, or each resident unit's last
        writer), which every held-back Adam task then waits for: ``grad_norm`` (the global norm
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
        checks: list[Task] = [o for o in self.offloads if isinstance(o, OffloadGrad)]
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


def cross_step_edges(earlier: Iterable[Task], later: Iterable[Task], spec: StepSpec) -> list[tuple[Task, Task]]:
    """The edges from one step's Adam of each unit (every chunk's ``cpu_adam``, or its
    ``gpu_adam``) to what reads that unit's weights in a later step: every ``fetch`` of a
    streamed unit, every weight-reading task of a resident one. With tied embeddings the head
    also reads the embedding matrix, so it waits for both. Every ``fetch`` also waits for the
    step's ``verify_step``, which may put streamed units back, and its ``sync_step`` where the
    processes share the state (another process may have updated the unit). Executors that
    receive steps one at a time add these themselves. With LoRA, every task that runs layer i
    also reads its adapters: it waits for their ``gpu_adam``."""
    adams: dict[tuple[str | None, int | None], list[Task]] = {}
    verify = []
    for t in earlier:
        if isinstance(t, (CpuAdam, GpuAdam)):
            adams.setdefault((t.unit, t.layer), []).append(t)
        elif isinstance(t, (VerifyStep, SyncStep)):
            verify.append(t)
    edges = []
    for t in later:
        reads_resident = isinstance(t, WEIGHT_READERS) and t.unit is not None and spec.is_resident(t.unit, t.layer)
        if isinstance(t, Fetch) or reads_resident:  # a frozen unit has no Adam
            edges += [(a, t) for a in adams.get((t.unit, t.layer), [])]
            if spec.tied and t.unit == "head":
                edges += [(a, t) for a in adams.get(("embed", None), [])]
        if spec.lora and isinstance(t, WEIGHT_READERS + (Fetch,)) and t.unit == "layer":  # its adapters too
            edges += [(a, t) for a in adams.get(("adapter", t.layer), [])]
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

