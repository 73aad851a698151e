"""LoRA adapters: which linear maps of a layer get one, their shapes, and PEFT's names (no torch).

A LoRA adapter adds a low-rank update to a frozen linear map ``W`` (out, in)::

    y = x W^T + (alpha / r) * (x A^T) B^T          # A (r, in), B (out, r)

``B`` starts at zero, so training starts from the base model. flowtrain keeps a layer's
adapters in one flat buffer of their own, cut by an *adapter layout* as a layer's weights are
cut by its unit layout (:mod:`flowtrain.model.layout`); entry ``q_proj.lora_A`` is the ``A`` of
the layer's ``q_proj``. The entries are named as PEFT saves them, so an adapter file reads and
writes with those names::

    spec = LoraSpec(rank=16, alpha=32)
    lays = adapter_layouts(cfg, spec)              # one per decoder layer
    lays[0].entry("q_proj.lora_A").name          # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

The targets are the layer's linear maps by their short names (``DEFAULT_TARGETS``: every linear
map of attention and of a dense MLP, PEFT's ``all-linear`` for these families). A
mixture-of-experts layer's experts are stacked weights, not linear maps, so they are not
targets; its attention is.
"""

from __future__ import annotations

import msgspec

from flowtrain.model.config import ModelConfig
from flowtrain.model.layout import UnitLayout, _pack, model_layouts

__all__ = ["DEFAULT_TARGETS", "LoraSpec", "adapter_layouts"]

#: every linear map of attention and of a dense MLP
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(msgspec.Struct, frozen=True):
    """What the adapters are: rank ``r``, ``alpha`` (the update is scaled by ``alpha / r``,
    PEFT's default scaling), the target maps, and the dropout on their input in training."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        """Raise ``ValueError`` naming what is wrong."""
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1 (got {self.rank})")
        if not self.targets:
            raise ValueError("LoRA needs at least one target")
        unknown = sorted(set(self.targets) - set(DEFAULT_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA target {', '.join(unknown)}; choose from {', '.join(DEFAULT_TARGETS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1) (got {self.dropout})")


def adapter_layouts(cfg: ModelConfig, spec: LoraSpec) -> list[UnitLayout]:
    """One adapter layout per decoder layer (unit ``"adapter"``, ``layer`` i): for each target
    the layer has, ``{target}.lora_A`` (rank, in) then ``{target}.lora_B`` (out, rank), each
    aligned as a unit's entries are, named as PEFT names them."""
    spec.validate()
    out = []
    for lay in model_layouts(cfg)[1:-1]:
        specs: list[tuple[str, str, tuple[int, ...]]] = []
        for base in lay.entries:
            if base.key in spec.targets:
                stem = "base_model.model." + base.name.removesuffix(".weight")
                n_out, n_in = base.shape
                specs += [(f"{base.key}.lora_A", f"{stem}.lora_A.weight", (spec.rank, n_in)),
                          (f"{base.key}.lora_B", f"{stem}.lora_B.weight", (n_out, spec.rank))]
        out.append(_pack("adapter", lay.layer, specs))
    return out
