"""What to compile: :class:`StepSpec`, the shape of one optimizer step, and the units it names.

A spec is a frozen ``msgspec.Struct``: how many decoder layers and micro-batches, how often the
forward keeps a checkpoint, which units live on the device, how gradients leave it, which layers
keep their activations, and so on. It is all the compiler reads, and a compiled graph carries it
as plain data (``graph.graph["spec"]``), so an exported graph says what it was compiled from::

    spec = StepSpec(layers=4, micro_batches=2, resident=("head",))
    spec.validate()                  # compile_step(spec) validates first, too
    spec.is_resident("head", None)   # True: no fetch or offload_grad, and a gpu_adam
    units(spec)                      # [("embed", None), ("layer", 0), ..., ("layer", 3), ("head", None)]

A *unit* is what is fetched, updated and saved as one: the embedding, each decoder layer, the
head (final norm and output projection), and with LoRA each layer's adapters. Its key is
``"embed"``, ``"layer.3"``, ``"head"`` or ``"adapter.3"`` (:meth:`StepSpec.unit_key`), the
spelling that ``resident`` and ``grad_chunks`` use.

:meth:`StepSpec.validate` refuses a spec that cannot be compiled. Its errors name fields in
braces (``{checkpoint_every}``), so that each front end spells them its own way: ``flowtrain
graph`` as its flags, ``flowtrain train`` as the settings that lead to them. What each field
does to the graph is told in :mod:`flowtrain.graph.step_builder`.
"""

from __future__ import annotations

import msgspec

from ..errors import ConfigError
from .tasks import Unit


#: The most layer passes (decoder layers x micro-batches) one graph may hold. Each pass is a
#: ``forward`` and a ``backward`` task, and up to six more (a ``recompute``, an activation's
#: ``offload_act`` and ``fetch_act``, and micro-batch-major three weight fetches). At the bound,
#: 32 layers x 4,096 micro-batches, a step measured 365,000 tasks, 0.6 GB and 15 s to build on one
#: core layer-major, and 700,000 tasks, 0.8 GB and 21 s micro-batch-major with offloaded
#: checkpoints; the planner builds one per candidate. Real runs stay below it (126 layers and
#: 1,024 micro-batches: 129,024 passes); ``--batch-size 1000000`` in micro-batches of 8 through
#: 2 layers (250,000 passes) was 11 GB and over ten minutes of building before this bound.
MAX_LAYER_PASSES = 1 << 17


def check_layer_passes(layers: int, micro_batches: int, steps: int = 1) -> None:
    """Refuse, by integer arithmetic before a task is built, a graph of more than
    :data:`MAX_LAYER_PASSES` layer passes a step (``steps`` steps: that many times as many).
    Names the fields in braces, as :meth:`StepSpec.validate` does."""
    passes = layers * micro_batches * steps
    if passes > MAX_LAYER_PASSES:
        many, fewer = ((f" x {steps:,} steps", "micro-batches, layers or steps") if steps > 1
                       else ("", "micro-batches or layers"))
        raise ConfigError(
            f"{{layers}} {layers:,} x {{micro_batches}} {micro_batches:,}{many} is {passes:,} layer passes (a forward "
            f"and a backward task each, and more), more than the {MAX_LAYER_PASSES:,} one graph may hold (at the bound "
            f"it takes about a gigabyte and half a minute to build): give fewer {fewer}", named=True)


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
    #: layers whose forward keeps what its backward needs on the device (``--activations
    #: keep``): their ``forward`` and ``backward`` tasks carry activations ``"keep"``, and their
    #: backward runs no forward again. The other layers recompute (``checkpoint_every``).
    keep: tuple[int, ...] = ()
    #: layers whose input (a checkpoint: a segment start, not kept) goes to host memory after
    #: the layer's forward has read it (``offload_act``) and comes back before its backward
    #: (``fetch_act``): ``--activations offload``.
    offload: tuple[int, ...] = ()
    #: layers (not kept) whose forward keeps its attention output and log-sum-exp on the device
    #: for the rebuild before its backward, which then runs no attention forward
    #: (``--activations attention``): their ``forward`` and ``backward`` tasks carry
    #: activations ``"attn"``.
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
    #: resident) are trained (see :mod:`flowtrain.graph.step_builder`).
    lora: bool = False
    #: with ``lora``: the adapters live in host memory instead, streamed: each layer's
    #: ``fetch`` brings its adapters with its weights, and their gradient has its own
    #: ``zero_grad``, ``offload_grad`` (whole, never staged) and ``cpu_adam``.
    host_adapters: bool = False
    #: sparse layers whose idle experts (those no token of the step was routed to) are left
    #: alone: the fetch before such a layer's recompute or backward follows its forwards (of
    #: the micro-batches it serves), whose routing says which experts to copy; the layer's
    #: gradient and Adam skip the idle ones. See :mod:`flowtrain.graph.step_builder`.
    skip_idle_experts: tuple[int, ...] = ()
    #: streamed units whose optimizer state lives on disk (``--state-dir``): each one's
    #: ``cpu_adam`` (each chunk's, staged) reads it from a ``read_state`` (a ``host_state``
    #: staging slot) and a ``write_state`` puts it back (see :mod:`flowtrain.graph.step_builder`).
    disk: tuple[str, ...] = ()
    #: how many of those reads run ahead of the Adam that needs them: the ``host_state``
    #: staging slots a policy must give (the compiler places the reads that far ahead on the
    #: ``disk`` lane, which issues in order).
    disk_ahead: int = 2

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
        check_layer_passes(self.layers, self.micro_batches)  # before anything is built per layer
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
        self._validate_skip_idle_experts()
        self._validate_disk()
        if self.host_adapters and not self.lora:
            raise ConfigError("adapters in host memory ({host_adapters}) are LoRA's: give {lora} with them", named=True)
        resident_layers = [u for u in self.resident if u.startswith("layer.")]
        if self.host_adapters and resident_layers:  # a layer's fetch is what brings its adapters
            raise ConfigError(f"adapters in host memory ({{host_adapters}}) come with their layer's fetch: leave "
                              f"{', '.join(resident_layers)} out of {{resident}}", named=True)
        return self

    def _validate_disk(self) -> None:
        if not self.disk:
            return
        if self.lora or self.share > 1:
            raise ConfigError("optimizer state on disk ({disk}) is for a whole model's training in one process per "
                              "node, not LoRA or processes sharing the host state", named=True)
        if self.disk_ahead < 1:
            raise ConfigError(f"{{disk_ahead}} must be at least 1 (got {self.disk_ahead})", named=True)
        valid = {"embed", "head", *(f"layer.{i}" for i in range(self.layers))}
        bad = sorted(set(self.disk) - valid) + sorted(k for k in self.disk if k in self.resident)
        if bad or len(set(self.disk)) != len(self.disk):
            raise ConfigError(f"units on disk ({{disk}}) {bad or list(self.disk)} must be distinct streamed units of "
                              f"this model (embed, layer.0..layer.{self.layers - 1}, head; not resident)", named=True)

    def on_disk(self, unit: str, layer: int | None) -> bool:
        """Whether a unit's optimizer state lives on disk (:attr:`disk`)."""
        return bool(self.disk) and self.unit_key(unit, layer) in self.disk

    def _validate_skip_idle_experts(self) -> None:
        bad = sorted(i for i in self.skip_idle_experts if not 0 <= i < self.layers)
        if bad or len(set(self.skip_idle_experts)) != len(self.skip_idle_experts):
            raise ConfigError(f"layers skipping idle experts ({{skip_idle_experts}}) "
                              f"{bad or list(self.skip_idle_experts)} must be distinct layers of 0..{self.layers - 1}",
                              named=True)
        if self.skip_idle_experts and self.lora:
            raise ConfigError("skipping idle experts ({skip_idle_experts}) is for training the whole model, not LoRA",
                              named=True)


def units(spec: StepSpec) -> list[tuple[Unit, int | None]]:
    """The parameter units of the model, bottom to top: embed, layers, head."""
    return [("embed", None), *(("layer", i) for i in range(spec.layers)), ("head", None)]


def trained_units(spec: StepSpec) -> list[tuple[Unit, int | None]]:
    """The units an optimizer updates, bottom to top: the model's, or with LoRA the layers'
    adapters."""
    if spec.lora:
        return [("adapter", i) for i in range(spec.layers)]
    return units(spec)
