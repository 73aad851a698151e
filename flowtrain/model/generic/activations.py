"""What a generic layer's backward holds on the device, measured on the meta device.

The native layer's memory is counted from its formulas (:func:`flowtrain.plan.memory.layer_work_bytes`);
a layer transformers runs is whatever its module does. This module runs each kind of layer once,
forward under autograd, on the meta device (shapes, no memory, no time) at a few tokens, and counts
the bytes of every tensor autograd saves for the backward (a view counted once, with its base).
The count grows with the tokens; :func:`saved_bytes_per_token` is its slope, measured between two
token counts so that what does not grow (a layer's own constants) drops out. On the meta device
attention runs its reference form, which saves the (tokens x tokens) probabilities; a GPU's fused
kernels keep none (only a log-sum-exp per row), so those are left out of the count::

    saved_bytes_per_token(cfg, torch.bfloat16)     # {layer index: bytes per token}, per layer kind
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ..config import ModelConfig
from .calls import GenericCalls
from .skeleton import skeleton

__all__ = ["saved_bytes_per_token"]

#: token counts of the two measurements (rows of one sequence)
_TOKENS = (256, 512)


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _saved_bytes(calls: GenericCalls, stem: GenericCalls, i: int, tokens: int, hidden: int, dtype: torch.dtype,
                 weights: dict[str, Tensor], embed: dict[str, Tensor]) -> int:
    # the stem on the CPU, over a one-row embedding (every id 0): the layers' arguments at this
    # many tokens, for a few kilobytes; the layer itself on the meta device
    ids = torch.zeros(1, tokens, dtype=torch.long)
    kwargs = _to_meta(stem.stem(ids, None, embed).layer_kwargs[i])
    x = torch.empty(1, tokens, hidden, dtype=dtype, device="meta", requires_grad=True)
    # the layer's input and weights are held anyway (a checkpoint, the slot): not the layer's to save
    held = {id(x), *map(id, weights.values())}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Any:
        base = t._base if t._base is not None else t
        if base.dim() >= 2 and base.shape[-1] == base.shape[-2] == tokens:
            return t  # a (tokens x tokens) attention matrix: on a GPU fused attention keeps none
        if id(base) not in held:
            seen[id(base)] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        calls.layer(i, x, weights, kwargs)
    return sum(seen.values())


def _slope(calls: GenericCalls, stem: GenericCalls, i: int, unit: tuple, hidden: int, dtype: torch.dtype,
           embed: dict[str, Tensor]) -> float:
    """Layer ``i``'s saved bytes per token in ``dtype``. Where a kernel takes only bf16 on the
    meta device (transformers' grouped experts), the bf16 count, scaled to ``dtype``'s size."""
    try:
        w = {k: torch.empty(s, dtype=dtype, device="meta", requires_grad=True) for k, _, s in unit}
        low, high = (_saved_bytes(calls, stem, i, t, hidden, dtype, w, embed) for t in _TOKENS)
    except RuntimeError:
        if dtype == torch.bfloat16:
            raise
        bf16 = {k: v.to(torch.bfloat16) for k, v in embed.items()}
        return _slope(calls, stem, i, unit, hidden, torch.bfloat16, bf16) * dtype.itemsize / 2
    return (high - low) / (_TOKENS[1] - _TOKENS[0])


@functools.lru_cache(maxsize=8)
def saved_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> dict[int, float]:
    """Bytes autograd saves per token in each layer kind's forward (layers whose parameters
    have the same names and shapes and whose ``layer_types`` agree are one kind, measured once),
    by the index of every layer."""
    assert cfg.hf_json is not None
    sk = skeleton(cfg.hf_json)
    calls = GenericCalls(sk, torch.device("meta"))
    stem = GenericCalls(sk, torch.device("cpu"))
    embed = {k: torch.zeros((1, *shape[1:]), dtype=dtype) for k, _, shape in cfg.generic_units[0]}
    measured: dict[tuple, float] = {}
    out = {}
    for i in range(cfg.num_layers):
        unit = cfg.generic_units[1 + i]
        kind = (tuple((k, s) for k, _, s in unit), cfg.layer_types[i] if cfg.layer_types else None)
        if kind not in measured:
            measured[kind] = _slope(calls, stem, i, unit, cfg.hidden_size, dtype, embed)
        out[i] = measured[kind]
    return out
