"""Typed tasks: the nodes of a training step's DAG.

A task is a small frozen, tagged ``msgspec.Struct``. It is hashable, so the struct itself is
the networkx node, and it round-trips to JSON for free::

    >>> t = Forward(layer=3, micro_batch=1)
    >>> t.kind, t.lane
    ('forward', 'compute')
    >>> msgspec.json.decode(msgspec.json.encode(t), type=AnyTask) == t
    True

Every task carries the same fields (``None`` where they do not apply), so that every node of an
exported graph has ``kind``, ``layer``, ``micro_batch`` and ``lane``; each kind declares the
ones it needs as required and typed (a ``forward`` without ``micro_batch`` cannot be made, and
its ``layer`` is an ``int``; its ``unit`` is ``"layer"`` by default and can be nothing else):

- ``step``: which optimizer step the task belongs to (steps may overlap).
- ``unit``: which parameter unit it touches: ``"embed"``, ``"layer"`` or ``"head"`` (final norm
  and output projection), or with LoRA a layer's ``"adapter"`` (its gradient's reduction and
  its ``gpu_adam``).
- ``layer``: the decoder layer for per-layer tasks, ``None`` otherwise.
- ``micro_batch``: for per-micro-batch tasks, ``None`` otherwise.
- ``phase``: the pass of the step a task serves or belongs to: on a ``fetch``, the pass its
  weights are fetched for (``"forward"``, ``"recompute"``, ``"backward"``); ``"eval"`` on the
  ``fetch``, ``embed`` and ``forward`` tasks of a held-out loss graph, which keeps them apart
  from the training step's tasks of the same step.
- ``activations``: what a layer's ``forward`` and ``backward`` keep on the device for the
  backward: ``"keep"`` where the layer's activations stay (no recompute), ``"attn"`` where its
  attention output stays (its rebuild skips attention); ``None`` where it recomputes.
- ``chunk``: for ``offload_grad`` and ``cpu_adam`` under the staged gradient layout, which
  piece of the unit's gradient passes through one host staging slot (``None`` otherwise).

Each kind knows its **lane** (``h2d``, ``compute``, ``d2h``, ``cpu``, ``io`` for checkpoint
writes, ``disk`` for the optimizer state that lives on disk (``--state-dir``), ``net`` for
collectives between data-parallel processes, or ``sync`` for the
processes of a node that share one host copy of the state) and which buffer **pool** it takes a
slot from (``takes``). A task that takes a slot holds it until every task that *reads* the slot
(an edge marked ``reads=True`` in the graph) has been launched; the next task granted that slot
waits for them, on its own lane, through a fence.

This module is pure data: it imports neither torch nor asyncio.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal, Mapping, TypedDict, cast

import msgspec

Lane = Literal["h2d", "compute", "d2h", "cpu", "io", "disk", "net", "sync"]
#: ``"adapter"``: a decoder layer's LoRA adapters (``StepSpec.lora``), resident on the device
Unit = Literal["embed", "layer", "head", "adapter"]
#: ``phase`` is the pass of the step a task serves or belongs to, each value allowed on its
#: kinds only (``Task.phases``; a task with another is refused when it is made or decoded):
#: the pass a ``fetch`` serves ...
FetchPass = Literal["forward", "recompute", "backward"]
#: ... or the held-out loss graph a ``fetch``, ``embed`` or ``forward`` belongs to.
Eval = Literal["eval"]
Phase = FetchPass | Eval
FETCH_PASSES: frozenset[str] = frozenset(("forward", "recompute", "backward"))
EVAL: Final = "eval"
#: ``activations``: what a layer's ``forward`` and ``backward`` keep on the device for the
#: backward (``Task.activation_values``): everything (``"keep"``: no recompute) or its
#: attention output (``"attn"``: the rebuild skips attention).
KeptActivations = Literal["keep", "attn"]
KEPT_ACTIVATIONS: frozenset[str] = frozenset(("keep", "attn"))

#: what a kind's tasks name (``Task.scope``): one unit (``layer`` set for a decoder layer's),
#: one decoder layer and micro-batch, one micro-batch at the embedding or at the head, or the
#: whole step. :func:`check_shape` holds a task to its kind's.
Scope = Literal["unit", "layer_micro_batch", "embed_micro_batch", "head_micro_batch", "step"]

#: Lanes whose work can be fenced without the host: a task on one of these lanes may be
#: launched as soon as its producers on these lanes are *launched* (it waits for them on
#: the lane, like a CUDA stream waiting on an event). ``cpu`` work needs finished inputs.
#: ``net`` carries the collectives of data-parallel training (gradient all-reduce), on its own
#: stream on a GPU, so that they overlap the backward of the layers below.
DEVICE_LANES: frozenset[str] = frozenset({"h2d", "compute", "d2h", "net"})
#: ``sync`` is a host thread for the step's short bookkeeping that other work waits on: the
#: verdict on its finiteness (``verify_step``) and, where the processes of a node share the
#: host state, their barrier (``sync_step``). Neither queues behind a long ``cpu_adam``.
#: ``disk`` is a host thread that reads and writes the optimizer state kept on disk
#: (``read_state``, ``write_state``), apart from the ``io`` lane's checkpoint writes.
LANES: tuple[str, ...] = ("h2d", "compute", "d2h", "cpu", "io", "disk", "net", "sync")

#: Buffer pools. ``weights``: slots that hold one unit's streamed weights on the device.
#: ``grads``: device gradient accumulators, one unit each, held until offloaded.
#: ``host_grads``: pinned host staging slots that a staged ``offload_grad`` fills and the
#: ``cpu_adam`` of the same chunk reads (the 12-bytes-per-parameter layout keeps no
#: per-unit host gradient).
#: ``acts``: activation checkpoints brought back from host memory for backward (``fetch_act``),
#: each held until the backward task that first reads it has been launched.
#: ``host_state``: host staging slots that a ``read_state`` fills with one unit's (or one
#: chunk's) optimizer state read from disk, read by its ``cpu_adam`` and its ``write_state``.
WEIGHTS = "weights"
GRADS = "grads"
ACTS = "acts"
HOST_GRADS = "host_grads"
HOST_STATE = "host_state"
#: how a ``read_state`` or ``write_state`` moves its bytes: in requests of ``STATE_PIECE`` bytes,
#: ``STATE_QUEUE_DEPTH`` of them in flight (what the run does and the simulator costs)
STATE_PIECE = 8 << 20
STATE_QUEUE_DEPTH = 4


class Task(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every task kind. Subclasses set ``lane`` and, if they take a slot, ``takes``."""

    step: int = 0
    unit: str | None = None
    layer: int | None = None
    micro_batch: int | None = None
    phase: Phase | None = None
    activations: KeptActivations | None = None
    chunk: int | None = None

    lane: ClassVar[str] = "compute"
    takes: ClassVar[str | None] = None
    #: the values ``phase`` may take on this kind (None: none set)
    phases: ClassVar[frozenset[str | None]] = frozenset({None})
    #: the values ``activations`` may take on this kind (None: none set)
    activation_values: ClassVar[frozenset[str | None]] = frozenset({None})
    #: what the kind's tasks name (:data:`Scope`), checked by :func:`check_shape`
    scope: ClassVar[str] = "step"

    def __post_init__(self) -> None:
        if self.phase not in self.phases:
            allowed = ", ".join(sorted(repr(p) for p in self.phases))
            raise ValueError(f"a {self.kind} task's phase is one of {allowed} (got {self.phase!r})")
        if self.activations not in self.activation_values:
            allowed = ", ".join(sorted(repr(p) for p in self.activation_values))
            raise ValueError(f"a {self.kind} task's activations are one of {allowed} (got {self.activations!r})")

    @property
    def kind(self) -> str:
        """The tag string, e.g. ``"forward"``."""
        return cast(str, self.__struct_config__.tag)  # msgspec types a tag str | int; every kind's is a str

    @property
    def label(self) -> str:
        """A short human name such as ``forward L3 m1 (keep)`` or ``fetch head (backward)``."""
        parts = [self.kind]
        if self.unit in ("embed", "head", "adapter") and self.unit != self.kind:
            parts.append(self.unit)
        if self.layer is not None:
            parts.append(f"L{self.layer}")
        if self.micro_batch is not None:
            parts.append(f"m{self.micro_batch}")
        if self.chunk is not None:
            parts.append(f"c{self.chunk}")
        if self.phase is not None:
            parts.append(f"({self.phase})")
        if self.activations is not None:
            parts.append(f"({self.activations})")
        if self.step:
            parts.append(f"s{self.step}")
        return " ".join(parts)

    def __str__(self) -> str:
        return self.label


class TaskFields(TypedDict, total=False):
    """A task's fields but ``step``, as keyword arguments: what a graph builder names when it
    makes a task of some kind (``builder.node(Forward, layer=3, micro_batch=0)``), checked
    against the fields' types. The kind itself then holds them to its own (a ``forward``'s
    ``layer`` must be set)."""

    unit: str | None
    layer: int | None
    micro_batch: int | None
    phase: Phase | None
    activations: KeptActivations | None
    chunk: int | None


class Fetch(Task, frozen=True, kw_only=True, tag="fetch"):
    """Copy one unit's weights from host memory into a free weight slot."""

    unit: Unit

    scope: ClassVar[str] = "unit"
    phases: ClassVar[frozenset[str | None]] = frozenset({None, EVAL} | FETCH_PASSES)  # None: made by hand (check_shape asks for one)

    lane: ClassVar[str] = "h2d"
    takes: ClassVar[str | None] = WEIGHTS


class Embed(Task, frozen=True, kw_only=True, tag="embed"):
    """Look up token embeddings for one micro-batch (reads the embedding's slot)."""

    unit: Literal["embed"] = "embed"
    micro_batch: int

    scope: ClassVar[str] = "embed_micro_batch"
    phases: ClassVar[frozenset[str | None]] = frozenset({None, EVAL})


class Forward(Task, frozen=True, kw_only=True, tag="forward"):
    """Run decoder layer ``layer`` on micro-batch ``micro_batch`` with the slot's weights."""

    unit: Literal["layer"] = "layer"
    layer: int
    micro_batch: int

    scope: ClassVar[str] = "layer_micro_batch"
    phases: ClassVar[frozenset[str | None]] = frozenset({None, EVAL})
    activation_values: ClassVar[frozenset[str | None]] = frozenset({None} | KEPT_ACTIVATIONS)


class Loss(Task, frozen=True, kw_only=True, tag="loss"):
    """Final norm, output projection and chunked cross-entropy for one micro-batch, forward and
    backward at once: yields the loss, the gradient of the last hidden state and the head's
    weight gradient (accumulated into the head's gradient slot)."""

    unit: Literal["head"] = "head"
    micro_batch: int

    scope: ClassVar[str] = "head_micro_batch"


class Recompute(Task, frozen=True, kw_only=True, tag="recompute"):
    """Rebuild the output of ``layer`` for ``micro_batch`` from the nearest checkpoint, so that
    the layer above has its input during backward."""

    unit: Literal["layer"] = "layer"
    layer: int
    micro_batch: int

    scope: ClassVar[str] = "layer_micro_batch"


class Backward(Task, frozen=True, kw_only=True, tag="backward"):
    """Gradients of ``layer`` for ``micro_batch`` w.r.t. its input and its flat weights; the
    weight gradient accumulates into the layer's gradient slot."""

    unit: Literal["layer"] = "layer"
    layer: int
    micro_batch: int

    scope: ClassVar[str] = "layer_micro_batch"
    activation_values: ClassVar[frozenset[str | None]] = frozenset({None} | KEPT_ACTIVATIONS)


class EmbedBackward(Task, frozen=True, kw_only=True, tag="embed_backward"):
    """Scatter one micro-batch's input gradient into the embedding's gradient slot."""

    unit: Literal["embed"] = "embed"
    micro_batch: int

    scope: ClassVar[str] = "embed_micro_batch"


class ZeroGrad(Task, frozen=True, kw_only=True, tag="zero_grad"):
    """Take a gradient slot for one unit and zero it before its first backward."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    takes: ClassVar[str | None] = GRADS


class OffloadGrad(Task, frozen=True, kw_only=True, tag="offload_grad"):
    """Copy one unit's accumulated gradient to its host gradient buffer, or (staged layout,
    ``chunk`` set) one chunk of it into a host staging slot."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    lane: ClassVar[str] = "d2h"

    @property
    def takes(self) -> str | None:  # type: ignore[override]  # by instance: a chunk takes a staging slot
        return HOST_GRADS if self.chunk is not None else None


class OffloadAct(Task, frozen=True, kw_only=True, tag="offload_act"):
    """Copy the input of ``layer`` for ``micro_batch`` (its activation checkpoint) to pinned
    host memory once the layer's forward has read it, and free it on the device:
    ``--activations offload``, for checkpoints that would otherwise wait on the GPU through the
    rest of the forward and most of the backward."""

    unit: Literal["layer"] = "layer"
    layer: int
    micro_batch: int

    scope: ClassVar[str] = "layer_micro_batch"

    lane: ClassVar[str] = "d2h"


class FetchAct(Task, frozen=True, kw_only=True, tag="fetch_act"):
    """Bring an offloaded checkpoint back from host memory before the backward task that first
    reads it (the layer's ``recompute`` or ``backward``); it takes an ``acts`` slot, so only as
    many checkpoints as the budget allows are back on the device ahead of their backward."""

    unit: Literal["layer"] = "layer"
    layer: int
    micro_batch: int

    scope: ClassVar[str] = "layer_micro_batch"

    lane: ClassVar[str] = "h2d"
    takes: ClassVar[str | None] = ACTS


class ReduceGrad(Task, frozen=True, kw_only=True, tag="reduce_grad"):
    """Sum one unit's gradient slot over every data-parallel process (all-reduce), once all of
    this process's micro-batches have added to it and before it is offloaded: each process
    then holds the same gradient, and the unit's owner (or, resident, every process) updates
    the unit with it."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    lane: ClassVar[str] = "net"


class GradSqNorm(Task, frozen=True, kw_only=True, tag="grad_sq_norm"):
    """Squared norm of a device-resident unit's gradient, for exact clipping."""

    unit: Unit

    scope: ClassVar[str] = "unit"


class GradNorm(Task, frozen=True, tag="grad_norm"):
    """Combine per-unit gradient norms into the global norm (only when clipping)."""

    lane: ClassVar[str] = "cpu"


class CpuAdam(Task, frozen=True, kw_only=True, tag="cpu_adam"):
    """AdamW on one unit's fp32 master weights (or one chunk of them) from its host gradient."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    lane: ClassVar[str] = "cpu"


class ReadState(Task, frozen=True, kw_only=True, tag="read_state"):
    """Read one unit's optimizer state kept on disk (``--state-dir``: its Adam moments, and
    its fp32 master where that lives there too; with ``chunk``, one staging chunk's) into a
    host staging slot, for its ``cpu_adam``. It takes the slot early in the step, so the read
    runs while the layers below still compute."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    lane: ClassVar[str] = "disk"
    takes: ClassVar[str | None] = HOST_STATE


class WriteState(Task, frozen=True, kw_only=True, tag="write_state"):
    """Write back what a ``read_state`` brought in, once the unit's (or chunk's) ``cpu_adam``
    has updated it in the staging slot; the slot is free again when it is done."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    lane: ClassVar[str] = "disk"


class GpuAdam(Task, frozen=True, kw_only=True, tag="gpu_adam"):
    """AdamW on a device-resident unit: its fp32 master and Adam state live in GPU memory, so
    the update runs there; it then refreshes the unit's compute-dtype copy and zeroes its
    gradient accumulator for the next step."""

    unit: Unit

    scope: ClassVar[str] = "unit"


class FoundInf(Task, frozen=True, tag="found_inf"):
    """Whether this step's loss or any of its gradients is not finite, as one flag on the
    device (only where some unit is resident): every ``gpu_adam`` of the step waits for it and
    hands it to the fused kernel, which then leaves the unit untouched. No host sync."""


class VerifyStep(Task, frozen=True, tag="verify_step"):
    """Once every finiteness check of the step's gradients is on the host: if the loss or a
    gradient turned out not finite after some units' Adam had run, put those units back from
    the step's undo record (the ``cpu_adam`` tasks after it then skip). The next step's fetches
    wait for it, so they never read an update that is then undone."""

    lane: ClassVar[str] = "sync"


class SyncStep(Task, frozen=True, tag="sync_step"):
    """Data parallel with the host state shared by the processes of a node, each unit's Adam
    run by one of them (its owner): a barrier of the node's processes once this process's
    ``cpu_adam`` tasks (and ``verify_step``) are done, so once every owner's are. The next
    step's fetches wait for it, and so do the step's checkpoint writes: they read units that
    another process updated."""

    lane: ClassVar[str] = "sync"


class EvalLoss(Task, frozen=True, kw_only=True, tag="eval_loss"):
    """Final norm, output projection and the summed cross-entropy of one held-out micro-batch,
    forward only (reads the head's weight slot; no gradient, no backward, no Adam): the last
    task of an evaluation graph (:mod:`flowtrain.graph.evaluation`)."""

    unit: Literal["head"] = "head"
    micro_batch: int

    scope: ClassVar[str] = "head_micro_batch"


class SaveUnit(Task, frozen=True, kw_only=True, tag="save"):
    """Write one unit's state after this step's Adam (fp32 master, Adam m, v and step count)
    into the step's checkpoint. It runs on the ``io`` lane while the next step computes; the
    next step's Adam of the unit waits for it, so the checkpoint holds exactly this step."""

    unit: Unit

    scope: ClassVar[str] = "unit"

    lane: ClassVar[str] = "io"


AnyTask = (
    Fetch
    | Embed
    | Forward
    | Loss
    | Recompute
    | Backward
    | EmbedBackward
    | ZeroGrad
    | OffloadGrad
    | GradSqNorm
    | GradNorm
    | CpuAdam
    | GpuAdam
    | FoundInf
    | OffloadAct
    | FetchAct
    | ReduceGrad
    | VerifyStep
    | SyncStep
    | EvalLoss
    | SaveUnit
    | ReadState
    | WriteState
)

#: Every task class by its ``kind`` string.
KINDS: dict[str, type[Task]] = {
    cast(str, cls.__struct_config__.tag): cls
    for cls in (
        Fetch,
        Embed,
        Forward,
        Loss,
        Recompute,
        Backward,
        EmbedBackward,
        ZeroGrad,
        OffloadGrad,
        OffloadAct,
        FetchAct,
        ReduceGrad,
        GradSqNorm,
        GradNorm,
        CpuAdam,
        GpuAdam,
        FoundInf,
        VerifyStep,
        SyncStep,
        EvalLoss,
        SaveUnit,
        ReadState,
        WriteState,
    )
}

#: Kinds whose work reads a unit's weights: the tasks of a device-resident unit that the next
#: step (or an evaluation graph) must hold back until that unit's ``gpu_adam`` has updated them.
WEIGHT_READERS: tuple[type[Task], ...] = (Embed, Forward, Loss, Recompute, Backward, EvalLoss)


#: the fields each :data:`Scope` sets (the rest stay None); ``chunk`` only where a kind allows it
_SCOPE_FIELDS: dict[str, tuple[str, ...]] = {
    "unit": ("unit",),
    "layer_micro_batch": ("unit", "layer", "micro_batch"),
    "embed_micro_batch": ("unit", "micro_batch"),
    "head_micro_batch": ("unit", "micro_batch"),
    "step": (),
}
#: kinds whose tasks may name one chunk of a unit's gradient (the staged layout)
_CHUNKED = frozenset(("offload_grad", "cpu_adam", "read_state", "write_state"))
#: the kinds that name a LoRA adapter unit: it is resident and only trained
#: what names an adapter: a resident one's reduction, norm, Adam and save; streamed (in host
#: memory), also its gradient slot, offload and CPU Adam (its weights come with its layer's fetch)
_ADAPTER_KINDS = frozenset(("reduce_grad", "grad_sq_norm", "gpu_adam", "save", "zero_grad", "offload_grad", "cpu_adam"))


def check_shape(task: Task) -> None:
    """Raise ``ValueError`` unless ``task`` names what its kind does (:data:`Scope`): a unit's
    tasks a unit (and a decoder layer's its layer), a layer's per-micro-batch tasks the layer
    and the micro-batch, the embedding's and the head's per-micro-batch tasks their unit and the
    micro-batch, step-wide tasks none of them; a fetch names its pass (and, each micro-batch
    through the model, the micro-batch it serves); only a gradient's offload and Adam a chunk.
    The step compiler checks every task it makes; a hand-built graph may skip it."""
    scope, kind = task.scope, task.kind
    unit = {"layer_micro_batch": "layer", "embed_micro_batch": "embed", "head_micro_batch": "head"}.get(scope)
    wrong = []
    if unit is not None and task.unit != unit:
        wrong.append(f"unit {task.unit!r} (its unit is {unit!r})")
    if scope == "unit" and task.unit not in ("embed", "layer", "head", "adapter"):
        wrong.append(f"unit {task.unit!r} (a unit: 'embed', 'layer', 'head' or 'adapter')")
    if task.unit == "adapter" and kind not in _ADAPTER_KINDS:
        wrong.append("unit 'adapter' (an adapter's weights come with its layer: only its gradient's and "
                     "optimizer's tasks name it)")
    if scope == "step" and task.unit is not None:
        wrong.append(f"unit {task.unit!r} (a step-wide task names none)")
    needs_layer = task.unit in ("layer", "adapter") and scope != "step"
    if (task.layer is not None) != needs_layer:
        wrong.append(f"layer {task.layer!r}" + (" (missing)" if needs_layer else " (only a decoder layer's tasks name one)"))
    may_mb = scope.endswith("micro_batch") or kind == "fetch"
    if scope.endswith("micro_batch") and task.micro_batch is None:
        wrong.append("no micro_batch")
    if not may_mb and task.micro_batch is not None:
        wrong.append(f"micro_batch {task.micro_batch!r} (its kind names none)")
    if kind == "fetch" and task.phase is None:
        wrong.append("no phase (the pass it serves)")
    if task.chunk is not None and kind not in _CHUNKED:
        wrong.append(f"chunk {task.chunk!r} (only offload_grad, cpu_adam, read_state and write_state name one)")
    if wrong:
        raise ValueError(f"task {task.label}: " + "; ".join(wrong))


def pool_of(task: Task) -> str:
    """The buffer pool ``task`` takes a slot of; for the engine's slot bookkeeping, which only
    asks tasks that take one (a ``ValueError`` otherwise)."""
    pool = task.takes
    if pool is None:
        raise ValueError(f"task {task.label} takes no slot")
    return pool


def task_to_dict(task: Task) -> dict[str, Any]:
    """The task as plain JSON-able data, with ``kind`` and ``lane`` included."""
    data: dict[str, Any] = msgspec.to_builtins(task)
    data["lane"] = task.lane
    data["takes"] = task.takes
    return data


def task_from_dict(data: Mapping[str, Any]) -> Task:
    """Inverse of :func:`task_to_dict` (extra keys such as ``lane`` are ignored). The fields are
    checked against the kind's types: a missing required field, or a value of the wrong type
    (a ``forward`` whose ``unit`` is not ``"layer"``), raises ``msgspec.ValidationError``.
    Data written before ``activations`` was a field of its own (its values then were a
    ``forward``'s or ``backward``'s ``phase``) reads as it is written now."""
    fields: dict[str, Any] = {k: data[k] for k in _FIELDS if data.get(k) is not None}
    cls = KINDS[data["kind"]]
    fields.update(legacy_activations(cls, fields.get("phase"), fields.get("activations")))
    return msgspec.convert(fields, type=cls)


def legacy_activations(cls: type[Task], phase: object, activations: object) -> dict[str, Any]:
    """``phase`` and ``activations`` of a ``cls`` task as data written before ``activations``
    was a field of its own reads today: a ``phase`` of ``"keep"`` or ``"attn"`` on a kind that
    allows it as ``activations`` moves there. Traces and graph files of older runs still load."""
    if activations is None and phase in KEPT_ACTIVATIONS and phase in cls.activation_values:
        return {"phase": None, "activations": phase}
    return {}


_FIELDS = ("step", "unit", "layer", "micro_batch", "phase", "activations", "chunk")
