"""A layer's weight gradients added into its fp32 gradient buffer one weight at a time.

A unit's weights sit in one flat buffer and a layer reads them as views of it
(:func:`flowtrain.model.flat_map.bind`). Differentiating with respect to the flat buffer makes
autograd turn each view's gradient into a gradient of the whole buffer (a zero-filled copy of
the unit's size per weight) and sum those: up to three unit-sized tensors in the compute
dtype at once. For a dense 8B layer that is about 1.3 GB; for a mixture-of-experts layer,
whose unit holds every expert (Qwen3-30B-A3B's: 625 M parameters), 3.5 GiB, more than a
10 GB card has to spare.

Here each view is a leaf of its own instead. As soon as autograd has a weight's gradient, a
hook adds it into the unit's fp32 gradient (the slot the step accumulates in, or a resident
unit's own) and drops it, so at most the gradients autograd is still working on are alive::

    leaves = weight_leaves(flat, layout)         # {name: leaf view of flat}
    y = layer(x_leaf, leaves)
    dx = backward_into(y, dy, x_leaf, leaves, layout, grads)

The sums are the same as before, element for element: each weight's gradient is computed in
the compute dtype as autograd computes it, then added to the fp32 buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flowtrain.model.flat_map import FlatMap, bind

__all__ = ["backward_into", "weight_leaves"]


def weight_leaves(flat: Tensor, layout: FlatMap) -> dict[str, Tensor]:
    """Each weight of ``layout`` as a leaf that needs a gradient, sharing ``flat``'s memory."""
    return {key: view.detach().requires_grad_(True) for key, view in bind(flat, layout).items()}


def backward_into(
    outputs: Tensor | Sequence[Tensor],
    grad_outputs: Tensor | Sequence[Tensor],
    x: Tensor,
    leaves: dict[str, Tensor],
    layout: FlatMap,
    grads: Tensor,
    first: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Differentiate ``outputs`` (with ``grad_outputs``) and return the gradient of the input
    leaf ``x``; every weight leaf's gradient is added into ``grads`` (1-D fp32, at least
    ``layout.numel`` elements) at its place in the layout as soon as it is ready, then freed.

    ``first``: applied to the gradient of the weight at offset 0 before it is added (the
    non-finite test hook writes into it, as it wrote into the first element of the unit's)."""
    targets = bind(grads, layout)  # each weight's place in the fp32 gradient
    at_zero = next(e.key for e in layout.entries if e.offset == 0)
    handles = []
    for key, leaf in leaves.items():
        change = first if key == at_zero else None
        handles.append(leaf.register_post_accumulate_grad_hook(_adder(targets[key], change)))
    try:
        torch.autograd.backward(outputs, grad_outputs, inputs=[x, *leaves.values()])
    finally:
        for handle in handles:
            handle.remove()
    dx = x.grad
    assert dx is not None, "the layer's output depends on its input"
    x.grad = None
    return dx


def _adder(target: Tensor, change: Callable[[Tensor], Tensor] | None) -> Callable[[Tensor], None]:
    def add(leaf: Tensor) -> None:
        g = leaf.grad
        assert g is not None
        target.add_(change(g) if change is not None else g)
        leaf.grad = None

    return add
