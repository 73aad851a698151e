"""A layer's weight gradients go into the fp32 gradient buffer one weight at a time.

The same sums as differentiating with respect to the unit's flat buffer, element for element,
without the unit-sized gradient copies that way makes (what ran a mixture-of-experts layer
out of memory on a 10 GB card).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flowtrain.model import bind, decoder_layer, model_flat_maps, rope_tables
from flowtrain.train.kept import backward_kept, forward_kept
from flowtrain.train.weight_grads import backward_into, weight_leaves

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import small_cfg

CFG = small_cfg(hidden_size=64, intermediate_size=176, num_layers=2)


def _layer_case(dtype, tokens=24, seed=0):
    lay = model_flat_maps(CFG)[1]
    gen = torch.Generator().manual_seed(seed)
    flat = (torch.randn(lay.numel, generator=gen) * 0.05).to(dtype)
    x = torch.randn(2, tokens, CFG.hidden_size, generator=gen).to(dtype)
    dy = torch.randn(2, tokens, CFG.hidden_size, generator=gen).to(dtype)
    cos, sin = rope_tables(CFG, tokens, dtype=dtype)
    layer = lambda x, w: decoder_layer(x, w, cos, sin, CFG, None, None)  # noqa: E731
    return lay, flat, x, dy, layer


def _through_flat(lay, flat, x, dy, layer):
    """The old way: gradients with respect to the whole flat buffer."""
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        fl = flat.detach().requires_grad_(True)
        dx, dw = torch.autograd.grad(layer(xl, bind(fl, lay)), (xl, fl), dy)
    return dx, dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradients_are_those_of_the_flat_buffer_added_to_what_was_there(dtype):
    lay, flat, x, dy, layer = _layer_case(dtype)
    dx_ref, dw_ref = _through_flat(lay, flat, x, dy, layer)
    before = torch.randn(lay.numel + 5, generator=torch.Generator().manual_seed(3))
    grads = before.clone()
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        leaves = weight_leaves(flat, lay)
        dx = backward_into(layer(xl, leaves), dy, xl, leaves, lay, grads)
    assert torch.equal(dx, dx_ref)
    expected = before.clone()
    expected[: lay.numel].add_(dw_ref)
    assert torch.equal(grads, expected)  # the padding past the layout is left alone
    assert all(leaf.grad is None for leaf in leaves.values())  # nothing left behind


def test_a_kept_layer_adds_the_same_gradients():
    lay, flat, x, dy, layer = _layer_case(torch.float32, seed=1)
    dx_ref, dw_ref = _through_flat(lay, flat, x, dy, layer)
    y, kept = forward_kept(layer, x, flat, lay)
    slot = flat.clone()  # the backward's own fetch: the same values, another buffer
    flat.zero_()  # the forward's slot overwritten meanwhile
    grads = torch.zeros(lay.numel)
    dx = backward_kept(kept, slot, dy, grads)
    assert torch.equal(dx, dx_ref) and torch.equal(grads, dw_ref)


def test_first_changes_only_the_weight_at_offset_zero():
    lay, flat, x, dy, layer = _layer_case(torch.float32, seed=2)
    _, dw_ref = _through_flat(lay, flat, x, dy, layer)
    seen = []

    def first(g):
        seen.append(g.shape)
        g.view(-1)[0] = float("nan")
        return g

    grads = torch.zeros(lay.numel)
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        leaves = weight_leaves(flat, lay)
        backward_into(layer(xl, leaves), dy, xl, leaves, lay, grads, first)
    head = next(e for e in lay.entries if e.offset == 0)
    assert seen == [torch.Size(head.shape)]
    assert torch.isnan(grads[0]) and torch.equal(grads[1:], dw_ref[1:])


class _Allocations(TorchDispatchMode):
    """The element count of every new tensor storage an op makes while active (a view of a
    tensor in ``existing`` makes none)."""

    def __init__(self, existing):
        super().__init__()
        self.numels: list[int] = []
        self._live: set[int] = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self._live and st.nbytes():
                    self._live.add(st.data_ptr())
                    weakref.finalize(st, self._live.discard, st.data_ptr())
                    self.numels.append(st.nbytes() // t.element_size())
        return out


def test_no_gradient_as_large_as_the_unit_is_made():
    lay, flat, x, dy, layer = _layer_case(torch.float32, seed=4)
    largest = max(e.numel for e in lay.entries)
    assert largest < lay.numel / 3  # the layer has many weights, none near the unit's size

    grads = torch.zeros(lay.numel)

    def biggest_made(run):
        with _Allocations([flat, x, dy, grads]) as seen:
            run()
        return max(seen.numels)

    assert biggest_made(lambda: _through_flat(lay, flat, x, dy, layer)) >= lay.numel  # the old way does

    def ours():
        with torch.enable_grad():
            xl = x.detach().requires_grad_(True)
            leaves = weight_leaves(flat, lay)
            backward_into(layer(xl, leaves), dy, xl, leaves, lay, grads)

    activations = 2 * 24 * max(CFG.intermediate_size, CFG.hidden_size * 3)
    assert biggest_made(ours) <= max(largest, activations)


class _LiveStacks(TorchDispatchMode):
    """The most storages of at least ``numel`` elements alive at once among those an op made
    while active (tensors in ``existing`` excluded)."""

    def __init__(self, existing, numel: int):
        super().__init__()
        self.numel, self.most = numel, 0
        self._known = {t.untyped_storage().data_ptr() for t in existing}
        self._live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st, ptr = t.untyped_storage(), t.untyped_storage().data_ptr()
                if ptr not in self._known and ptr not in self._live and st.nbytes() // t.element_size() >= self.numel:
                    self._live.add(ptr)
                    weakref.finalize(st, self._live.discard, ptr)
        self.most = max(self.most, len(self._live))
        return out


@pytest.mark.parametrize("experts", [4, 16])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_a_sparse_layers_expert_gradients_alive_at_once(monkeypatch, experts, grouped):
    """What the planner counts of a sparse layer's weight gradients (``_moe_mlp_work`` in
    flowtrain/plan/memory.py): the grouped experts make one stacked weight's gradient at a time;
    the loop, differentiating each expert's slice into a zero-filled gradient of the whole
    stack, holds more, at most ``LOOP_GRADIENT_STACKS`` of them. No other tensor of the layer
    is as large as a stack here (few tokens), so every one counted is a gradient."""
    import msgspec

    from flowtrain.model import moe, preset
    from flowtrain.plan.memory import LOOP_GRADIENT_STACKS

    monkeypatch.setattr(moe, "grouped_available", lambda x: grouped)  # torch runs _grouped_mm on the CPU too
    cfg = msgspec.structs.replace(preset("qwen3-moe-12l"), hidden_size=64, moe_intermediate_size=32,
                                  num_experts=experts, num_experts_per_tok=2, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16, vocab_size=128)
    lay = model_flat_maps(cfg)[1]
    stack = max(e.numel for e in lay.entries)
    assert stack == experts * 32 * 64 and sum(e.numel == stack for e in lay.entries) == 3
    gen = torch.Generator().manual_seed(experts)
    flat = (torch.randn(lay.numel, generator=gen) * 0.05).to(torch.bfloat16)
    x, dy = (torch.randn(2, 24, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    cos, sin = rope_tables(cfg, 24, dtype=torch.bfloat16)
    grads = torch.zeros(lay.numel)
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        leaves = weight_leaves(flat, lay)
        y = decoder_layer(xl, leaves, cos, sin, cfg, None, None)
        assert 2 * 24 * 2 * 64 < stack  # T k rows of hidden, the largest activation, are smaller
        with _LiveStacks([flat, x, dy, grads], stack) as seen:
            backward_into(y, dy, xl, leaves, lay, grads)
    assert grads[-stack:].abs().sum() > 0  # the last stack's gradient arrived
    if grouped:
        assert seen.most == 1
    else:
        assert 1 < seen.most <= LOOP_GRADIENT_STACKS
