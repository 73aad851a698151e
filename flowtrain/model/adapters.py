"""LoRA adapters: which linear maps of a layer get one, their shapes, and PEFT's names (no torch).

A LoRA adapter adds a low-rank update to a frozen linear map ``W`` (out, in)::

    y = x W^T + (alpha / r) * (x A^T) B^T          # A (r, in), B (out, r)

``B`` starts at zero, so training starts from the base model. flowtrain keeps a layer's
adapters in one flat buffer of their own, cut by the adapters' *flat map* as a layer's weights
are cut by its own (:mod:`flowtrain.model.flat_map`); entry ``q_proj.lora_A`` is the ``A`` of
the layer's ``q_proj``. The entries are named as PEFT saves them, so an adapter file reads and
writes with those names::

    spec = LoraSpec(rank=16, alpha=32)
    lays = adapter_flat_maps(cfg, spec)              # one per decoder layer
    lays[0].entry("q_proj.lora_A").name          # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

The targets are the layer's linear maps by their short names (``DEFAULT_TARGETS``: every linear
map of attention and of the MLP, and a mixture of experts' router: PEFT's ``all-linear``).

In a mixture of experts the MLP's names mean the experts' stacked weights, as PEFT reads them
over transformers 5 (its ``target_parameters``): ``gate_proj`` and ``up_proj`` together adapt the
stacked ``gate_up_proj`` (both or neither), ``down_proj`` the stacked ``down_proj``, ``router`` the
router (PEFT's ``gate``). A stacked weight of E experts has one adapter per expert, kept as PEFT
keeps them: ``A`` (E r, in), expert by expert, and ``B`` (out, r E), its columns rank-major, so
expert e's pair is ``A.view(E, r, in)[e]`` and ``B.view(out, r, E)[:, :, e]``. The gate-and-up
adapter has rank ``LoraSpec.fused_rank`` (PEFT: twice the rank, with twice the alpha, the same
scale). Such a model's dense layers get no MLP adapters, since PEFT up to 0.21 reads those names
as the experts' only: what flowtrain trains is what PEFT loads. (PEFT 0.22's ``all-linear`` adapts
the dense layers' MLP too; docs/lora.md, "PEFT versions".)
"""

from __future__ import annotations

import math

import msgspec

from flowtrain.model.config import ModelConfig
from flowtrain.model.flat_map import FlatMap, _pack, model_flat_maps

__all__ = ["DEFAULT_TARGETS", "SPARSE_TARGETS", "LoraSpec", "adapter_flat_maps", "linear_maps"]

#: every linear map of attention and of the MLP, and a mixture of experts' router
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "router")

#: targets that, in a layer with experts, adapt its router and stacked experts (PEFT's target_parameters)
SPARSE_TARGETS = ("gate_proj", "up_proj", "down_proj", "router")


class LoraSpec(msgspec.Struct, frozen=True):
    """What the adapters are: rank ``r``, ``alpha`` (the update is scaled by ``alpha / r``,
    PEFT's default scaling, or with ``rslora`` by ``alpha / sqrt(r)``, PEFT's ``use_rslora``),
    the target maps, and the dropout on their input in training."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    #: rank of a mixture of experts' gate-and-up adapter (None: twice ``rank``, as PEFT makes it
    #: from ``gate_proj`` and ``up_proj``; its alpha scales with it, so the scale is the same)
    fused_rank: int | None = None
    #: rank-stabilised scaling (rsLoRA): the update is scaled by ``alpha / sqrt(r)``
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.scale_at(self.rank, self.alpha)

    def scale_at(self, rank: int, alpha: float) -> float:
        """The scale an adapter of ``rank`` and ``alpha`` has under this spec's scaling rule."""
        return alpha / (math.sqrt(rank) if self.rslora else rank)

    @property
    def gate_up_rank(self) -> int:
        return self.fused_rank if self.fused_rank is not None else 2 * self.rank

    def validate(self) -> None:
        """Raise ``ValueError`` naming what is wrong."""
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1 (got {self.rank})")
        if not self.targets:
            raise ValueError("LoRA needs at least one target")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1) (got {self.dropout})")
        if self.fused_rank is not None and self.fused_rank < 1:
            raise ValueError(f"LoRA rank of the experts' gate_up_proj must be at least 1 (got {self.fused_rank})")

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` where the targets cannot adapt ``cfg`` as PEFT would: half of a
        mixture of experts' stacked gate-and-up weight (``gate_proj`` and ``up_proj`` go
        together), dropout on a router or stacked experts (PEFT does not run it), and targets
        that reach no weight of the model (a dense model's router alone). On the generic layer
        path a target is any linear map of the layers by its module's name (``q_proj``,
        ``in_proj_qkvz``), as PEFT's ``target_modules`` matches it, without dropout."""
        if cfg.generic:
            return self._check_generic(cfg)
        self.check_known()
        if cfg.sparse_layers():
            if ("gate_proj" in self.targets) != ("up_proj" in self.targets):
                raise ValueError("LoRA targets gate_proj and up_proj are one stacked weight in a mixture of experts "
                                 "(gate_up_proj): adapt both or neither")
            if self.rslora and "gate_proj" in self.targets and self.gate_up_rank != self.rank:
                raise ValueError(f"rsLoRA scales each adapter by alpha / sqrt(rank), so the experts' gate-and-up "
                                 f"adapter at rank {self.gate_up_rank} would have a scale of its own; flowtrain "
                                 f"runs one: give the gate-and-up rank {self.rank}")
            if self.dropout and set(self.targets) & set(SPARSE_TARGETS):
                raise ValueError("LoRA dropout does not apply to a mixture of experts' router and stacked experts "
                                 "(PEFT refuses it too): leave out router, gate_proj, up_proj and down_proj, or the "
                                 "dropout")
        if not any(lay.entries for lay in adapter_flat_maps(cfg, self)):
            raise ValueError(f"LoRA targets {','.join(self.targets)}: nothing in this model to adapt (a router "
                             "needs layers with experts)")

    def check_rank(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` where a rank is larger than the smaller side of a linear map it
        adapts: the update ``B A`` of a map of (out, in) has rank at most ``min(out, in)``, so a
        larger rank only adds parameters that cannot change it (a stacked expert's map is one
        expert's). Asked of ranks a run's flags give (``--lora-rank``), not of an adapter file's:
        PEFT trains such adapters, and one must still load. A router is held to its input side alone: its output is one number per expert
        (8 in Mixtral), and PEFT's ``all-linear``, like flowtrain's default targets, adapts it at
        the run's rank. Names the rank, the map with the smallest bound, and its sides."""
        worst: dict[str, tuple[int, str, int | None, int, int]] = {}  # which rank -> its tightest map
        for lay in adapter_flat_maps(cfg, self):
            shapes = {e.key: e.shape for e in lay.entries}
            for key, (rows, n_in) in shapes.items():
                if not key.endswith(".lora_A"):
                    continue
                target = key.removesuffix(".lora_A")
                n_out = shapes[f"{target}.lora_B"][0]
                experts = cfg.num_experts if target.startswith("experts_") else 1
                bound = n_in if target == "router" else min(n_out, n_in)
                which = "LoRA gate-and-up rank" if target == "experts_gate_up" else "LoRA rank"
                if rows // experts > bound and (which not in worst or bound < worst[which][0]):
                    worst[which] = (bound, target, lay.layer, n_out, n_in)
        for which, (bound, target, layer, n_out, n_in) in worst.items():
            rank = self.gate_up_rank if which == "LoRA gate-and-up rank" else self.rank
            side = "input side" if target == "router" else "smaller side"
            stacked = {"experts_gate_up": ("each expert's gate_up_proj", "gate_proj and up_proj"),
                       "experts_down": ("each expert's down_proj", "down_proj")}
            shown, named = stacked.get(target, (target, target))
            raise ValueError(
                f"{which} {rank} is larger than the {side} of a linear map it adapts: {shown} of layer {layer} is "
                f"{n_out} x {n_in} (out x in), so its update has rank at most {bound}; give a rank of at most {bound}, "
                f"or leave {named} out of the LoRA targets")

    def check_known(self) -> None:
        """Raise ``ValueError`` for a target no native layer has."""
        unknown = sorted(set(self.targets) - set(DEFAULT_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA target {', '.join(unknown)}; choose from {', '.join(DEFAULT_TARGETS)}")

    def _check_generic(self, cfg: ModelConfig) -> None:
        names = sorted({m.rsplit(".", 1)[-1] for m in linear_maps(cfg)})
        missing = [t for t in self.targets if t not in names and t not in DEFAULT_TARGETS]
        if missing:
            raise ValueError(f"LoRA target {', '.join(missing)}: no linear map of {cfg.architecture}'s layers is called "
                             f"that; its maps are {', '.join(names)}")
        if self.dropout:
            raise ValueError("LoRA dropout is not run on the generic layer path: leave out the dropout")
        if not any(lay.entries for lay in adapter_flat_maps(cfg, self)):
            raise ValueError(f"LoRA targets {','.join(self.targets)}: nothing in {cfg.architecture}'s layers to adapt; "
                             f"its linear maps are {', '.join(names)}")


def linear_maps(cfg: ModelConfig) -> list[str]:
    """The full module names of every linear map in a generic model's layers
    (``model.layers.0.linear_attn.in_proj_qkv``), as PEFT matches ``target_modules`` against them."""
    return [_module(e.name) for lay in model_flat_maps(cfg)[1:-1] for e in lay.entries if _linear(e.key, e.shape)]


def _module(key: str) -> str:
    """The module a generic layer's parameter belongs to (``self_attn.q_proj.weight`` ->
    ``self_attn.q_proj``)."""
    return key.removesuffix(".weight")


def _linear(key: str, shape: tuple[int, ...]) -> bool:
    """Whether a generic layer's parameter is a linear map's weight (a matrix called weight)."""
    return key.endswith(".weight") and len(shape) == 2


def _generic_specs(cfg: ModelConfig, spec: LoraSpec, lay: FlatMap) -> list[tuple[str, str, tuple[int, ...]]]:
    """A generic layer's adapters: for each linear map whose module's name is a target,
    ``{module}.lora_A`` (rank, in) and ``{module}.lora_B`` (out, rank), named as PEFT saves them."""
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    for base in lay.entries:
        module = _module(base.key)
        if _linear(base.key, base.shape) and module.rsplit(".", 1)[-1] in spec.targets:
            stem = "base_model.model." + base.name.removesuffix(".weight")
            n_out, n_in = base.shape
            specs += [(f"{module}.lora_A", f"{stem}.lora_A.weight", (spec.rank, n_in)),
                      (f"{module}.lora_B", f"{stem}.lora_B.weight", (n_out, spec.rank))]
    return specs


def adapter_flat_maps(cfg: ModelConfig, spec: LoraSpec) -> list[FlatMap]:
    """One adapter flat map per decoder layer (unit ``"adapter"``, ``layer`` i): for each target
    the layer has, ``{target}.lora_A`` (rank, in) then ``{target}.lora_B`` (out, rank), each
    aligned as a unit's entries are, named as PEFT names them. A layer with experts has
    ``router``, ``experts_gate_up`` and ``experts_down`` adapters instead of the MLP's
    (:func:`_sparse_specs`)."""
    spec.validate()
    if cfg.generic:
        return [_pack("adapter", lay.layer, _generic_specs(cfg, spec, lay)) for lay in model_flat_maps(cfg)[1:-1]]
    spec.check_known()
    sparse_model = bool(cfg.sparse_layers())
    out = []
    for lay in model_flat_maps(cfg)[1:-1]:
        assert lay.layer is not None
        specs: list[tuple[str, str, tuple[int, ...]]] = []
        for base in lay.entries:
            if base.key in spec.targets and base.key != "router" and not (sparse_model and base.key in SPARSE_TARGETS):
                stem = "base_model.model." + base.name.removesuffix(".weight")
                n_out, n_in = base.shape
                specs += [(f"{base.key}.lora_A", f"{stem}.lora_A.weight", (spec.rank, n_in)),
                          (f"{base.key}.lora_B", f"{stem}.lora_B.weight", (n_out, spec.rank))]
        if cfg.layer_sparse(lay.layer):
            specs += _sparse_specs(cfg, spec, lay.layer)
        out.append(_pack("adapter", lay.layer, specs))
    return out


def _sparse_specs(cfg: ModelConfig, spec: LoraSpec, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A sparse layer's router and stacked-expert adapters, named as PEFT saves them over
    transformers 5: the router's as a linear map's (``mlp.gate``); each stacked weight's wrapped
    around the module holding it (``mlp.experts``), ``gate_up_proj`` first, so where both are
    adapted the gate-and-up adapter sits one ``base_layer`` deeper."""
    h, inter, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    mlp = f"base_model.model.model.layers.{layer}.mlp"
    out: list[tuple[str, str, tuple[int, ...]]] = []
    if "router" in spec.targets:
        out += [("router.lora_A", f"{mlp}.gate.lora_A.weight", (spec.rank, h)),
                ("router.lora_B", f"{mlp}.gate.lora_B.weight", (n, spec.rank))]
    down = "down_proj" in spec.targets
    if "gate_proj" in spec.targets and "up_proj" in spec.targets:
        stem, r = f"{mlp}.experts" + (".base_layer" if down else ""), spec.gate_up_rank
        out += [("experts_gate_up.lora_A", f"{stem}.lora_A.weight", (n * r, h)),
                ("experts_gate_up.lora_B", f"{stem}.lora_B.weight", (2 * inter, n * r))]
    if down:
        out += [("experts_down.lora_A", f"{mlp}.experts.lora_A.weight", (n * spec.rank, inter)),
                ("experts_down.lora_B", f"{mlp}.experts.lora_B.weight", (h, n * spec.rank))]
    return out

