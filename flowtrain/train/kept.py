"""Kept activations: a layer's forward graph held for its backward, weights referred to by place.

By default a layer's backward runs its forward again under autograd (recompute), because the
forward's weights sat in a streaming slot that other layers' fetches have overwritten since.
A *kept* layer runs its forward under autograd once and keeps the graph, so backward only runs
the backward half (a third less compute per layer). Its saved tensors are of two kinds:

* activations (normed inputs, q, k, v, attention output, MLP intermediates): kept as they are;
* the weights themselves (views of the slot the forward read): *not* kept -- a saved-tensor
  hook records where in the unit's flat buffer each view sat (offset, shape, strides), and the
  backward's own fetch of the same weights (same values: Adam runs after the step's backward)
  provides them again::

      y, kept = forward_kept(layer, x, flat, layout)     # y detached; kept holds the graph
      ...                                                # the slot is reused meanwhile
      dx = backward_kept(kept, flat_now, dy, grads)      # flat_now: the backward's fetch

The weight gradients go straight into the unit's fp32 gradient ``grads``, one weight at a
time (:mod:`flowtrain.train.weight_grads`).

So a kept layer costs GPU memory for its activations only, and the gradients are the same
computation as a recompute would do (bit-identical in fp32 where the math is the same: both
run the same ops on the same values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowtrain.model.flat_map import FlatMap

from .weight_grads import backward_into, weight_leaves

__all__ = ["Kept", "backward_kept", "forward_kept", "saved_bytes"]


@dataclass(frozen=True)
class _WeightRef:
    """Where a saved weight view sat in the unit's flat buffer."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Kept:
    """One layer's kept forward: its input and weight leaves (and the layout they follow), its
    output, and the buffer its saved weight views are read from (set by :func:`backward_kept`)."""

    __slots__ = ("x", "leaves", "flat_map", "y", "weights", "bytes", "_seen")

    def __init__(self, layout: FlatMap, count: bool = False) -> None:
        self.x: Tensor | None = None
        self.leaves: dict[str, Tensor] | None = None
        self.flat_map = layout
        self.y: Tensor | None = None
        self.weights: Tensor | None = None  # the flat buffer the backward reads weights from
        self.bytes = 0  # device bytes of the kept activations, when counted (saved_bytes)
        self._seen: set[int] | None = set() if count else None  # their storages, each once

    def _pack(self, flat: Tensor) -> Callable[[Tensor], object]:
        storage = flat.untyped_storage().data_ptr()
        base = int(flat.storage_offset())

        def pack(t: Tensor) -> object:
            ptr = t.untyped_storage().data_ptr()
            if ptr == storage and t.device == flat.device:
                return _WeightRef(int(t.storage_offset()) - base, tuple(t.size()), tuple(t.stride()))
            if self._seen is not None and ptr not in self._seen:
                self._seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
            return t

        return pack

    def _unpack(self, saved: object) -> Tensor:
        if isinstance(saved, _WeightRef):
            w = self.weights
            assert w is not None, "backward_kept sets the weights before autograd reads them"
            return w.as_strided(saved.size, saved.stride, w.storage_offset() + saved.offset)
        return saved  # type: ignore[return-value]


def forward_kept(layer: Callable[[Tensor, dict[str, Tensor]], Tensor], x: Tensor, flat: Tensor,
                 layout: FlatMap, count: bool = False,
                 trained: tuple[Tensor, FlatMap] | None = None) -> tuple[Tensor, Kept]:
    """Run ``layer(x_leaf, weight_leaves)`` under autograd, keeping its graph; ``flat`` is the
    unit's weights in their slot, ``layout`` where each weight sits in it. Returns the detached
    output and the :class:`Kept` record (with ``count``, its :attr:`Kept.bytes` adds up the
    activations kept). ``trained``: the flat buffer and layout of what takes the gradient
    instead of ``flat`` (LoRA's adapters, whose leaves ``layer`` then receives; it reads the
    frozen weights of ``flat`` itself, and those are kept by place all the same)."""
    kept = Kept(trained[1] if trained is not None else layout, count)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(kept._pack(flat), kept._unpack):
        kept.x = x.detach().requires_grad_(True)
        kept.leaves = weight_leaves(*(trained if trained is not None else (flat, layout)))
        kept.y = layer(kept.x, kept.leaves)
    return kept.y.detach(), kept


def backward_kept(kept: Kept, weights: Tensor, dy: Tensor, grads: Tensor, extra: Tensor | None = None,
                  first: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """The input gradient of a kept layer for output gradient ``dy``, reading the saved weight
    views from ``weights`` (the same values the forward read, wherever they are now) and adding
    the weight gradients into ``grads`` (:func:`flowtrain.train.weight_grads.backward_into`,
    ``first`` as there). ``extra``: a scalar of the same forward's graph differentiated along
    with the output (a mixture of experts' load-balancing term, :mod:`flowtrain.train.load_balance`)."""
    kept.weights = weights
    assert kept.y is not None and kept.x is not None and kept.leaves is not None
    outputs, grad_outputs = ((kept.y, dy) if extra is None
                             else ((kept.y, extra), (dy, torch.ones_like(extra))))
    dx = backward_into(outputs, grad_outputs, kept.x, kept.leaves, kept.flat_map, grads, first)
    kept.x = kept.leaves = kept.y = kept.weights = None
    return dx


def saved_bytes(layer: Callable[[Tensor, dict[str, Tensor]], Tensor], x: Tensor, flat: Tensor,
                layout: FlatMap) -> int:
    """Device bytes a kept forward of ``layer`` holds for these shapes (weights excluded)."""
    _, kept = forward_kept(layer, x, flat, layout, count=True)
    return kept.bytes
