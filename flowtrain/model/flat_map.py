"""Where each weight lives inside a unit's flat buffer: a unit's :class:`FlatMap`.

flowtrain keeps a model's parameters in a handful of 1-D host buffers, one per *unit*: the
embedding, each decoder layer, and the head. Moving a unit to the GPU is then one large
copy, and the optimizer sees one long vector per unit. A :class:`FlatMap` says how to
cut such a buffer back into named matrices; :func:`bind` does the cutting, as views::

    maps = model_flat_maps(cfg)                  # [embed, layer.0, ..., layer.L-1, head]
    flat = torch.empty(maps[1].numel)            # any dtype, any device
    w = bind(flat, maps[1])                      # {"q_proj": (q_out, hidden) view, ...}
    w["q_proj"].normal_()                        # writes into ``flat``

Every entry starts at a multiple of :data:`ALIGN` elements, so views stay aligned for
vectorised kernels whatever the dtype; the gaps are padding that stays zero.

A mixture-of-experts layer keeps each projection of all its experts as one *stacked* entry,
(experts, out, in), so the layer math can index an expert or hand the whole stack to a grouped
GEMM. The Hub stores one tensor per expert instead; a stacked entry's ``name`` has a ``{}``
where the expert's number goes, and :func:`hub_tensors` lists those names::

    e = maps[1].entry("experts_gate")           # shape (128, 768, 2048), stacked
    hub_tensors(e)[0]                           # ("model.layers.0.mlp.experts.0.gate_proj.weight", (768, 2048), 0)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from torch import Tensor

from flowtrain.model.config import ModelConfig

__all__ = ["ALIGN", "Entry", "FlatMap", "HubIndex", "bind", "hub_form", "hub_tensors", "model_flat_maps", "unit_numel_max",
           "unit_seed"]

ALIGN = 64  # elements; 128 bytes in bf16, 256 in fp32


class Entry(msgspec.Struct, frozen=True):
    """One tensor in a unit: ``key`` is the short name used by the layer math, ``name`` the
    Hugging Face checkpoint name; it occupies ``flat[offset : offset + numel]``."""

    key: str
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    #: one checkpoint tensor per index of the first dimension, named ``name.format(index)``
    stacked: bool = False
    #: the generic path's fused experts (transformers keeps ``experts.gate_up_proj`` (experts,
    #: 2 inter, hidden) where the Hub has ``experts.E.gate_proj.weight`` and ``up_proj``): expert
    #: ``e``'s rows ``[j n, (j + 1) n)`` of the second dimension are checkpoint tensor
    #: ``parts[j].format(e)``, n being that dimension over ``len(parts)``
    parts: tuple[str, ...] = ()


#: where a checkpoint tensor goes in its entry: all of it (None), one expert (its index), or
#: one part of one expert (the index and the rows of the second dimension)
HubIndex = int | tuple[int, slice] | None


def hub_form(entry: Entry, present: set[str]) -> list[tuple[str, tuple[int, ...], HubIndex]]:
    """:func:`hub_tensors` as the checkpoint whose tensor names are ``present`` holds them: a
    fused entry may be stored fused, under its own name (as transformers keeps it in memory)."""
    if entry.parts and entry.name in present and entry.parts[0].format(0) not in present:
        return [(entry.name, entry.shape, None)]
    return hub_tensors(entry)


def hub_tensors(entry: Entry) -> list[tuple[str, tuple[int, ...], HubIndex]]:
    """``(checkpoint name, shape, index)`` of each tensor a checkpoint stores for ``entry``:
    itself (index None), for a stacked entry one per expert (its index in the stack), for a
    fused entry one per expert and part (``entry.parts``)."""
    if entry.parts:
        n = entry.shape[1] // len(entry.parts)
        return [(part.format(e), (n, *entry.shape[2:]), (e, slice(j * n, (j + 1) * n)))
                for e in range(entry.shape[0]) for j, part in enumerate(entry.parts)]
    if not entry.stacked:
        return [(entry.name, entry.shape, None)]
    return [(entry.name.format(i), entry.shape[1:], i) for i in range(entry.shape[0])]


class FlatMap(msgspec.Struct, frozen=True):
    """Where each weight of one unit (``"embed"``, ``"layer"`` or ``"head"``) sits in its flat
    buffer: the unit's entries and its padded size."""

    unit: str
    layer: int | None
    entries: tuple[Entry, ...]
    numel: int

    @property
    def key(self) -> str:
        """``"embed"``, ``"layer.{i}"``, ``"head"`` (or a layer's adapters, ``"adapter.{i}"``): a
        stable name for this unit."""
        return self.unit if self.layer is None else f"{self.unit}.{self.layer}"

    def entry(self, key: str) -> Entry:
        """The entry called ``key``; ``KeyError`` listing the valid keys otherwise."""
        for e in self.entries:
            if e.key == key:
                return e
        raise KeyError(f"{self.key} has no entry {key!r}; it has {[e.key for e in self.entries]}")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_Spec = tuple[str, str, tuple[int, ...]]  # (key, checkpoint name, shape); "{}" in the name: stacked


def _pack(unit: str, layer: int | None, specs: Iterable[_Spec]) -> FlatMap:
    entries = []
    offset = 0
    for key, name, shape in specs:
        numel = 1
        for s in shape:
            numel *= s
        offset = _align(offset)
        entries.append(Entry(key=key, name=name, shape=shape, offset=offset, numel=numel,
                             stacked="{}" in name))
        offset += numel
    return FlatMap(unit=unit, layer=layer, entries=tuple(entries), numel=_align(offset))


def _layer_specs(cfg: ModelConfig, i: int) -> list[_Spec]:
    assert cfg.head_dim is not None
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    specs = [
        ("input_layernorm", f"model.layers.{i}.input_layernorm.weight", (h,)),
        ("q_proj", f"{attn}.q_proj.weight", (q_out, h)),
        ("k_proj", f"{attn}.k_proj.weight", (kv_out, h)),
        ("v_proj", f"{attn}.v_proj.weight", (kv_out, h)),
    ]
    if cfg.has_qkv_bias:
        specs += [
            ("q_bias", f"{attn}.q_proj.bias", (q_out,)),
            ("k_bias", f"{attn}.k_proj.bias", (kv_out,)),
            ("v_bias", f"{attn}.v_proj.bias", (kv_out,)),
        ]
    if cfg.attention_bias:
        specs.append(("o_bias", f"{attn}.o_proj.bias", (h,)))
    if cfg.qk_norm:
        specs += [
            ("q_norm", f"{attn}.q_norm.weight", (cfg.head_dim,)),
            ("k_norm", f"{attn}.k_norm.weight", (cfg.head_dim,)),
        ]
    specs += [
        ("o_proj", f"{attn}.o_proj.weight", (h, q_out)),
        ("post_attention_layernorm", f"model.layers.{i}.post_attention_layernorm.weight", (h,)),
    ]
    if cfg.family.gemma:  # Gemma 3 also norms the MLP's input and output
        specs += [
            ("pre_feedforward_layernorm", f"model.layers.{i}.pre_feedforward_layernorm.weight", (h,)),
            ("post_feedforward_layernorm", f"model.layers.{i}.post_feedforward_layernorm.weight", (h,)),
        ]
    if cfg.layer_sparse(i):
        return specs + _expert_specs(cfg, i)
    specs += [
        ("gate_proj", f"{mlp}.gate_proj.weight", (ffn, h)),
        ("up_proj", f"{mlp}.up_proj.weight", (ffn, h)),
        ("down_proj", f"{mlp}.down_proj.weight", (h, ffn)),
    ]
    return specs


#: The Hub's names of an expert's three projections, by family: (gate, up, down).
_EXPERT_NAMES = {"qwen3": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def _expert_specs(cfg: ModelConfig, i: int) -> list[_Spec]:
    """A sparse layer's router (experts, hidden) and its experts' stacked projections."""
    h, e, ffn = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    block, gate, up, down = _EXPERT_NAMES[cfg.family.moe]
    prefix = f"model.layers.{i}.{block}"
    return [
        ("router", f"{prefix}.gate.weight", (e, h)),
        ("experts_gate", f"{prefix}.experts.{{}}.{gate}.weight", (e, ffn, h)),
        ("experts_up", f"{prefix}.experts.{{}}.{up}.weight", (e, ffn, h)),
        ("experts_down", f"{prefix}.experts.{{}}.{down}.weight", (e, h, ffn)),
    ]


def model_flat_maps(cfg: ModelConfig) -> list[FlatMap]:
    """The flat maps of every unit, in execution order: embed, layers 0..L-1, head.

    A tied model's head holds only the final norm; it reuses the embedding matrix.
    """
    cfg.validate()
    if cfg.generic:  # the units transformers' model has (flowtrain.model.generic)
        units, parts = cfg.generic_units, dict(cfg.generic_parts)
        maps = [_pack("embed", None, units[0]),
                *(_pack("layer", i, spec) for i, spec in enumerate(units[1:-1])),
                _pack("head", None, units[-1])]
        if not parts:
            return maps
        return [msgspec.structs.replace(m, entries=tuple(msgspec.structs.replace(e, parts=parts.get(e.name, ()))
                                                         for e in m.entries)) for m in maps]
    h, v = cfg.hidden_size, cfg.vocab_size
    maps = [_pack("embed", None, [("embed_tokens", "model.embed_tokens.weight", (v, h))])]
    maps += [_pack("layer", i, _layer_specs(cfg, i)) for i in range(cfg.num_layers)]
    head: list[_Spec] = [("norm", "model.norm.weight", (h,))]
    if not cfg.tie_word_embeddings:
        head.append(("lm_head", "lm_head.weight", (v, h)))
    maps.append(_pack("head", None, head))
    return maps


def bind(flat: Tensor, flat_map: FlatMap) -> dict[str, Tensor]:
    """Views of ``flat`` (1-D, at least ``flat_map.numel`` elements) shaped per entry.

    No data is copied: writing to a view writes to ``flat``.
    """
    if flat.dim() != 1 or flat.numel() < flat_map.numel:
        raise ValueError(
            f"bind: unit {flat_map.key} needs a 1-D buffer of at least {flat_map.numel} elements, "
            f"got shape {tuple(flat.shape)}"
        )
    return {e.key: flat[e.offset : e.offset + e.numel].view(e.shape) for e in flat_map.entries}


def unit_seed(seed: int, layout: FlatMap) -> int:
    """A 63-bit generator seed mixing the run seed and the unit's key (stable across runs): each
    unit's fresh weights are drawn from their own generator (:mod:`flowtrain.model.init`)."""
    digest = hashlib.sha256(f"flowtrain:{seed}:{layout.key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def unit_numel_max(maps: Sequence[FlatMap]) -> int:
    """The largest unit's padded size: what one reusable staging buffer must hold."""
    return max(m.numel for m in maps)
