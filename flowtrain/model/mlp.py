"""The gated MLP of a decoder layer, in pieces along the sequence when a micro-batch is long.

``down(act(gate(h)) * up(h))`` holds three ``tokens x intermediate`` tensors, and under autograd
it saves them for the backward: at 262,144 tokens of an 8B Llama that is 7 GiB each, ~22 GiB for
one layer's backward. Above :data:`MLP_CHUNK_TOKENS` tokens per micro-batch the MLP runs in
pieces of that many tokens instead: the forward keeps only its input, and the backward rebuilds
one piece at a time (its ``gate`` and ``up`` once more) and takes that piece's gradients, adding
the weight gradients in fp32. Memory then holds one piece's intermediates, for a second run of
two thirds of the MLP's forward GEMMs, which at that length are small next to attention.

Shorter micro-batches take the plain path, unchanged (the compiled layer fuses it). The pieces
run outside ``torch.compile`` (a graph break in the layer, only at these lengths)::

    out = gated_mlp(h, gate_w, up_w, down_w, F.silu)       # Llama, Qwen, Mistral
    out = gated_mlp(h, gate_w, up_w, down_w, gelu_tanh)    # Gemma 3
    out = layer_mlp(h, w, F.silu)                          # from a layer's weights, adapters included

A layer whose MLP carries LoRA adapters (:mod:`flowtrain.model.lora`) takes the plain path at
any length: the pieces do not run adapters yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flowtrain.model.config import MLP_CHUNK_TOKENS  # the planner counts with it too
from flowtrain.model.lora import has_adapter, project


def gelu_tanh(x: Tensor) -> Tensor:
    """Gemma's activation: GELU with the tanh approximation."""
    return F.gelu(x, approximate="tanh")


def layer_mlp(h: Tensor, w: Mapping[str, Tensor], act: Callable[[Tensor], Tensor]) -> Tensor:
    """The gated MLP of a layer's weights ``w`` (``gate_proj``, ``up_proj``, ``down_proj``), each
    map with its LoRA adapter where ``w`` holds one."""
    if not has_adapter(w, "gate_proj", "up_proj", "down_proj"):
        return gated_mlp(h, w["gate_proj"], w["up_proj"], w["down_proj"], act)
    return project(act(project(h, w, "gate_proj")) * project(h, w, "up_proj"), w, "down_proj")


def gated_mlp(h: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """``down(act(gate(h)) * up(h))`` for ``h`` of shape (batch, seq, hidden)."""
    if h.shape[0] * h.shape[1] <= MLP_CHUNK_TOKENS:
        return _piece(h, gate_w, up_w, down_w, act)
    return _in_pieces(h, gate_w, up_w, down_w, act, MLP_CHUNK_TOKENS)


def _piece(h: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    return F.linear(act(F.linear(h, gate_w)) * F.linear(h, up_w), down_w)


@torch.compiler.disable
def _in_pieces(h: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, act: Callable[[Tensor], Tensor],
               chunk: int) -> Tensor:
    return _PiecewiseMLP.apply(h, gate_w, up_w, down_w, act, chunk)


class _PiecewiseMLP(torch.autograd.Function):
    """The gated MLP over ``chunk`` tokens at a time, saving only its inputs for the backward."""

    @staticmethod
    def forward(ctx, h, gate_w, up_w, down_w, act, chunk):
        flat = h.reshape(-1, h.shape[-1])
        out = flat.new_empty(flat.shape[0], down_w.shape[0])
        for lo in range(0, flat.shape[0], chunk):
            out[lo : lo + chunk] = _piece(flat[lo : lo + chunk], gate_w, up_w, down_w, act)
        ctx.save_for_backward(h, gate_w, up_w, down_w)
        ctx.act, ctx.chunk = act, chunk
        return out.view(*h.shape[:-1], down_w.shape[0])

    @staticmethod
    def backward(ctx, d_out):
        h, gate_w, up_w, down_w = ctx.saved_tensors
        flat, d_flat = h.reshape(-1, h.shape[-1]), d_out.reshape(-1, d_out.shape[-1])
        d_h = torch.empty_like(flat)
        d_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in (gate_w, up_w, down_w)]
        weights = [w.detach().requires_grad_(True) for w in (gate_w, up_w, down_w)]
        for lo in range(0, flat.shape[0], ctx.chunk):
            with torch.enable_grad():
                x = flat[lo : lo + ctx.chunk].detach().requires_grad_(True)
                y = _piece(x, *weights, ctx.act)
                grads = torch.autograd.grad(y, (x, *weights), d_flat[lo : lo + ctx.chunk])
            d_h[lo : lo + ctx.chunk] = grads[0]
            for acc, g in zip(d_w, grads[1:]):
                acc += g
        return (d_h.view_as(h), *(acc.to(w.dtype) for acc, w in zip(d_w, (gate_w, up_w, down_w))), None, None)
