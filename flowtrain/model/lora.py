"""LoRA's math: a linear map with its adapter, and an adapter's initial values.

A layer's weights reach the layer math as one mapping (:func:`flowtrain.model.flat_map.bind`).
With adapters, the mapping also holds the adapters' flat map's entries (``q_proj.lora_A``, ...,
:mod:`flowtrain.model.adapters`) and ``lora_scale``, a 0-d tensor holding ``alpha / r``;
:func:`adapted` builds it. Every linear map of the layer goes through :func:`project`, which adds
the low-rank update where the mapping holds one, so the same layer functions run a base model
and an adapted one::

    w = adapted(bind(base_flat, layer_layout), bind(adapter_flat, adapter_layout), spec.scale)
    y = decoder_layer(x, w, cos, sin, cfg)

The base weights take no gradient (they are not leaves that require one); the backward then
computes only the input gradients through them, and the adapters' own gradients.

Dropout on the adapters' input (``LoraSpec.dropout``, PEFT's ``lora_dropout``): the mapping
may hold, per adapted map, a keep mask ``{key}.lora_keep`` (1 where the input element is kept)
and ``lora_rescale`` (a 0-d tensor holding ``1 / (1 - p)``); :func:`dropout_masks` draws the
masks from a seed, so the recompute before a backward draws the same ones as the forward did. Without them (held-out loss,
or ``p`` 0) the adapted model runs as PEFT runs it in eval mode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from flowtrain.model.flat_map import FlatMap, bind

__all__ = ["adapted", "dropout_masks", "has_adapter", "init_adapter", "merge_adapter", "project"]


def project(x: Tensor, w: Mapping[str, Tensor], key: str, bias: Tensor | None = None) -> Tensor:
    """``x W^T + b`` for ``W = w[key]``, plus ``scale * (x A^T) B^T`` where ``w`` holds the
    adapter ``key.lora_A`` / ``key.lora_B`` (PEFT's unmerged form: the low-rank product is never
    formed as a full matrix). The update runs in the input's dtype, the fp32 adapters cast to it
    (bf16 on a GPU, as PEFT's adapters run under autocast; their gradients reach the fp32
    adapters): casting the input up instead would copy a layer's widest activation, the MLP's
    intermediate, to fp32 for the down projection's adapter."""
    y = F.linear(x, w[key], bias)
    a = w.get(f"{key}.lora_A")
    if a is None:
        return y
    dt = x.dtype
    keep = w.get(f"{key}.lora_keep")
    if keep is not None:  # dropout on the adapter's input only, as PEFT's lora_dropout
        x = x * keep * w["lora_rescale"].to(dt)
    return y + F.linear(F.linear(x, a.to(dt)), w[f"{key}.lora_B"].to(dt)) * w["lora_scale"].to(dt)


def has_adapter(w: Mapping[str, Tensor], *keys: str) -> bool:
    """Whether any of the linear maps ``keys`` carries an adapter in ``w``."""
    return any(f"{k}.lora_A" in w for k in keys)


def adapted(base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], scale: float | Tensor) -> dict[str, Tensor]:
    """One mapping of a layer's base weights and its adapters, with their scale: a number, or a
    0-d tensor on the adapters' device made once (making one from a number on a GPU copies it
    there and waits for the copy, at every call)."""
    if not isinstance(scale, Tensor):
        some = next(iter(adapter.values()), None)
        scale = torch.tensor(scale, device=some.device if some is not None else None,
                             dtype=some.dtype if some is not None else None)
    return {**base, **adapter, "lora_scale": scale}


def dropout_masks(adapter: Mapping[str, Tensor], rows: tuple[int, ...], p: float, seed: int,
                  device: torch.device) -> dict[str, Tensor]:
    """Keep masks of dropout ``p`` on the input of every adapted map of one layer (input
    ``rows + (in_features,)``, read from each ``A``), to join the layer's mapping with
    ``lora_rescale``. Each map's mask comes from its own generator, seeded by ``seed`` and the
    map's place, so the same seed draws the same masks (the forward's, again for the recompute)."""
    out: dict[str, Tensor] = {}
    for n, key in enumerate(sorted(k.removesuffix(".lora_A") for k in adapter if k.endswith(".lora_A"))):
        gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + n) & ((1 << 63) - 1))
        shape = (*rows, adapter[f"{key}.lora_A"].shape[1])
        out[f"{key}.lora_keep"] = torch.empty(shape, dtype=torch.uint8, device=device).bernoulli_(1.0 - p, generator=gen)
    return out


def merge_adapter(base: Tensor, base_layout: FlatMap, adapter: Tensor, adapter_layout: FlatMap,
                  scale: float) -> None:
    """``W += scale * B A`` for every adapted map of one layer, in place in ``base`` (whatever
    its dtype): the product and the sum in fp32, rounded once to the base's dtype, as PEFT's
    ``merge_and_unload`` does."""
    w, a = bind(base, base_layout), bind(adapter, adapter_layout)
    for key in (k.removesuffix(".lora_A") for k in a if k.endswith(".lora_A")):
        if key in _EXPERT_STACKS:
            _merge_experts(a[f"{key}.lora_A"], a[f"{key}.lora_B"], [w[t] for t in _EXPERT_STACKS[key]], scale)
        else:
            target = key if key in w else f"{key}.weight"  # the generic path's keys name the module
            delta = a[f"{key}.lora_B"].float() @ a[f"{key}.lora_A"].float()
            w[target].copy_(w[target].float() + scale * delta)


_EXPERT_STACKS = {"experts_gate_up": ("experts_gate", "experts_up"), "experts_down": ("experts_down",)}
"""The stacked experts' adapters, each with the stacked weights its update spans, in row order."""


def _merge_experts(lora_a: Tensor, lora_b: Tensor, stacks: list[Tensor], scale: float) -> None:
    """``W_e += scale * B_e A_e`` for each expert e of stacked weights, PEFT's layout of the
    pairs (:mod:`flowtrain.model.adapters`); a fused gate-and-up update's rows split over
    ``stacks`` in order. One expert at a time, so the update never spans the whole stack."""
    experts = stacks[0].shape[0]
    a = lora_a.float().view(experts, -1, lora_a.shape[-1])
    b = lora_b.float().view(lora_b.shape[0], -1, experts)
    for e in range(experts):
        delta = scale * (b[:, :, e] @ a[e])
        row = 0
        for w in stacks:
            rows = w.shape[1]
            w[e].copy_(w[e].float() + delta[row:row + rows])
            row += rows


def init_adapter(flat: Tensor, layout: FlatMap, seed: int) -> None:
    """PEFT's initial adapter, in place: each ``A`` uniform in ``±1 / sqrt(in)`` (Kaiming's
    uniform with ``a = sqrt(5)``, as ``nn.Linear`` and PEFT draw it), each ``B`` zero, so the
    adapted model starts as the base. Seeded per layer: the same seed gives the same adapters."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + (layout.layer or 0))
    flat.zero_()
    for key, view in bind(flat, layout).items():
        if key.endswith(".lora_A"):
            bound = 1.0 / math.sqrt(view.shape[1])
            view.copy_(torch.rand(view.shape, generator=gen) * (2 * bound) - bound)
