"""What a generic layer holds on the device, measured on the meta device.

The native layer's memory is counted from its formulas (:func:`flowtrain.plan.memory.layer_work_bytes`);
a layer transformers runs is whatever its module does. This module runs each kind of layer once,
forward under autograd and backward, on the meta device (shapes, no memory, no time) at a few
tokens, and counts two things:

- *saved*: the bytes of every tensor autograd saves for the backward (a view counted once, with
  its base): what a layer's forward leaves behind while later layers run;
- *work*: the most bytes alive at once over the layer's forward and backward, every tensor the
  ops create counted from its creation until its storage is freed (:class:`_PeakMeter`): what
  the layer needs while it runs, its transients (a state-space scan's chunks, the experts'
  gathered tokens, the gradients flowing back) included.

The head (final norm, output embedding, any logit soft-capping, cross-entropy, and their
backward) is measured the same way (:func:`head_bytes_per_token`): what one loss chunk holds.

Both grow with the tokens; :func:`layer_bytes_per_token` gives their slopes, measured between two
token counts so that what does not grow (a layer's own constants, its weight gradients) drops
out. On the meta device attention runs its reference form, which makes (tokens x tokens)
probabilities; a GPU's fused kernels make none (only a log-sum-exp per row), so those are left
out of both counts::

    layer_bytes_per_token(cfg, torch.bfloat16)[i].work     # bytes per token of layer i's kind
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import ModelConfig
from .calls import GenericCalls
from .skeleton import skeleton

__all__ = ["LayerBytes", "head_bytes_per_token", "layer_bytes_per_token"]

#: token counts of the two measurements (rows of one sequence): large enough that the bytes
#: growing with the tokens decide the peak at both (at a few tokens the weight gradients may)
_TOKENS = (1536, 3072)


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


class LayerBytes(NamedTuple):
    """A layer's device bytes per token: what its forward saves, and the most its forward and
    backward hold at once."""

    saved: float
    work: float


def _is_scores(t: Tensor, tokens: int) -> bool:
    """A (tokens x tokens) attention matrix, one per head: on a GPU fused attention makes none."""
    return t.dim() >= 3 and t.shape[-1] == t.shape[-2] == tokens


class _PeakMeter(TorchDispatchMode):
    """The most bytes alive at once among the storages the ops under it create: each is counted
    from the op that made it until its last tensor is gone (a weak reference to the storage)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and not _is_scores(t, self.tokens):
                storage = t.untyped_storage()
                known = self.live.get(storage._cdata)  # a freed storage's address may come back
                if known is None or known[0]() is None:
                    self.live[storage._cdata] = (weakref.ref(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _measure(calls: GenericCalls, stem: GenericCalls, i: int, tokens: int, hidden: int, dtype: torch.dtype,
             weights: dict[str, Tensor], embed: dict[str, Tensor]) -> tuple[int, int]:
    """Layer ``i`` at ``tokens`` tokens: the bytes its forward saves, and the most its forward
    and backward hold at once."""
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
        if id(base) not in held and not _is_scores(base, tokens):
            seen[id(base)] = base.numel() * base.element_size()
        return t

    meter = _PeakMeter(tokens)
    with meter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = calls.layer(i, x, weights, kwargs)
        saved = sum(seen.values())
        grads = torch.autograd.grad(out, [x, *weights.values()], torch.ones_like(out), allow_unused=True)
        del out, grads
    return saved, meter.peak


def _slope(calls: GenericCalls, stem: GenericCalls, i: int, unit: tuple, hidden: int, dtype: torch.dtype,
           embed: dict[str, Tensor]) -> LayerBytes:
    """Layer ``i``'s bytes per token in ``dtype``. Where a kernel takes only bf16 on the meta
    device (transformers' grouped experts), the bf16 counts, scaled to ``dtype``'s size."""
    try:
        w = {k: torch.empty(s, dtype=dtype, device="meta", requires_grad=True) for k, _, s in unit}
        low, high = (_measure(calls, stem, i, t, hidden, dtype, w, embed) for t in _TOKENS)
    except RuntimeError:
        if dtype == torch.bfloat16:
            raise
        bf16 = {k: v.to(torch.bfloat16) for k, v in embed.items()}
        scaled = _slope(calls, stem, i, unit, hidden, torch.bfloat16, bf16)
        return LayerBytes(*(b * dtype.itemsize / 2 for b in scaled))
    span = _TOKENS[1] - _TOKENS[0]
    return LayerBytes((high[0] - low[0]) / span, (high[1] - low[1]) / span)


@functools.lru_cache(maxsize=8)
def layer_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> dict[int, LayerBytes]:
    """Each layer kind's bytes per token (layers whose parameters have the same names and
    shapes and whose ``layer_types`` agree are one kind, measured once), by the index of every
    layer."""
    assert cfg.hf_json is not None
    sk = skeleton(cfg.hf_json)
    calls = GenericCalls(sk, torch.device("meta"))
    stem = GenericCalls(sk, torch.device("cpu"))
    embed = {k: torch.zeros((1, *shape[1:]), dtype=dtype) for k, _, shape in cfg.generic_units[0]}
    measured: dict[tuple, LayerBytes] = {}
    out = {}
    for i in range(cfg.num_layers):
        unit = cfg.generic_units[1 + i]
        kind = (tuple((k, s) for k, _, s in unit), cfg.layer_types[i] if cfg.layer_types else None)
        if kind not in measured:
            measured[kind] = _slope(calls, stem, i, unit, cfg.hidden_size, dtype, embed)
        out[i] = measured[kind]
    return out


@functools.lru_cache(maxsize=8)
def head_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> float:
    """The most bytes the head's loss and its backward hold at once, per token of a chunk
    (:meth:`~flowtrain.model.generic.calls.GenericCalls.head_loss_and_grads` over one chunk)."""
    assert cfg.hf_json is not None
    calls = GenericCalls(skeleton(cfg.hf_json), torch.device("meta"))
    norm_shape = next(shape for _, _, shape in cfg.generic_units[-1] if len(shape) == 1)  # the final norm
    norm_w = torch.empty(norm_shape, dtype=dtype, device="meta")
    head_w = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")  # its own, or the tied embedding
    peaks = []
    for tokens in _TOKENS:
        hidden = torch.empty(1, tokens, cfg.hidden_size, dtype=dtype, device="meta")
        targets = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        meter = _PeakMeter(tokens)
        with meter:
            calls.head_loss_and_grads(hidden, norm_w, head_w, targets, 1.0, tokens)
        peaks.append(meter.peak)
    return (peaks[1] - peaks[0]) / (_TOKENS[1] - _TOKENS[0])
