"""Handlers of a layer's compute: ``embed``, ``forward``, ``recompute``, ``backward``, ``embed_backward``.

A decoder layer is a pure function of its input, its weights (views of a slot, or its own
copy), and what every call shares (the rotary tables, the config; on the generic path the
stem's arguments): the run's :class:`~.layer_runner.LayerRunner`, native or generic, holds it.
Activations pass between tasks through the program's
:class:`~flowtrain.train.activations.ActivationStore`, keyed ``(step, layer, micro_batch)``:
the input of layer ``i`` is kept from the forward pass where it starts a checkpoint segment
(:func:`~flowtrain.graph.compiler.checkpoint_layers`) and rebuilt by ``recompute`` otherwise.
A forward and backward with activations ``"keep"`` keep the layer's autograd graph for the
backward (:mod:`flowtrain.train.kept`); with activations ``"attn"`` the layer's attention output and
log-sum-exp wait for its rebuild, which then runs no attention forward
(:mod:`flowtrain.model.saved_attention`).

A layer's backward re-runs it under autograd from its saved input and takes the gradient with
respect to the input and to the *flat* weight leaf (or, with LoRA, the adapters': the
:mod:`.training` part decides), one contiguous tensor ready to be accumulated and offloaded in
a single copy. Held-out evaluation (phase ``"eval"``) runs the same forward with nothing kept
for a backward and no dropout.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ...graph.tasks import Backward, Embed, EmbedBackward, Forward, Recompute
from ...model import bind
from ...model.saved_attention import AttentionRecord, recording, replaying
from ...runtime.engine import TaskContext
from ..kept import backward_kept
from ..weight_grads import backward_into
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("embed")
def run_embed(p: StepProgram, task: Embed, ctx: TaskContext) -> None:
    """Token embeddings of one micro-batch, into the store as layer 0's input."""
    s, m = task.step, task.micro_batch
    evaluating = task.phase == "eval"
    data = p.evals[s] if evaluating else p.steps[s]
    ids = data.ids[m].to(p.device, non_blocking=p.slots.non_blocking)
    embed_state = p.state.embed
    w = bind(p.slots.weights(embed_state, ctx), embed_state.flat_map)
    inputs = p.store.eval_inputs if evaluating else p.store.inputs
    inputs.put((s, 0, m), p.layers.embed("eval" if evaluating else "train", s, m, ids, data.docs[m], w))


@HANDLERS.register("forward", "recompute")
@torch.no_grad()
def run_forward(p: StepProgram, task: Forward | Recompute, ctx: TaskContext) -> None:
    """A layer's forward pass; as ``recompute`` (in backward) its input is always kept."""
    s, i, m = task.step, task.layer, task.micro_batch
    if task.phase == "eval":  # nothing is kept for a backward, and no dropout
        # a reference pass (DPO) under LoRA reads the base without its adapters
        w = p.training.base_weights(i, ctx) if p.evals[s].reference else p.training.layer_weights(i, ctx)
        x = p.store.eval_inputs.take((s, i, m))
        p.store.eval_inputs.put((s, i + 1, m), p.layers.run("eval", s, i, m, x, w))
        return
    if task.activations == "keep":  # the graph stays for the backward: see flowtrain.train.kept
        x = p.store.inputs.take((s, i, m))
        tap = p.experts.forward_tap(s, i, m, p.steps[s].targets[m])
        y, kept = p.training.forward_kept(lambda x, w: p.layers.run("train", s, i, m, x, w, tap), x, i, ctx,
                                          (s, m, tuple(x.shape[:-1])))
        p.store.kept.put((s, i, m), kept)
        p.store.inputs.put((s, i + 1, m), y)
        return
    keep = isinstance(task, Recompute) or i in p.checkpointed  # a checkpoint stays for the backward
    x = p.store.inputs.peek((s, i, m)) if keep else p.store.inputs.take((s, i, m))
    record = None
    if task.activations == "attn":  # its attention output waits for the rebuild: saved_attention
        record = AttentionRecord()
        p.store.attention.put((s, i, m), record)
    tap = None if isinstance(task, Recompute) else p.experts.forward_tap(s, i, m, p.steps[s].targets[m])
    w = p.training.layer_weights(i, ctx, dropout=(s, m, tuple(x.shape[:-1])))
    with recording(record):
        p.store.inputs.put((s, i + 1, m), p.layers.run("train", s, i, m, x, w, tap))


@HANDLERS.register("backward")
def run_backward(p: StepProgram, task: Backward, ctx: TaskContext) -> None:
    """Layer ``i``'s gradients for one micro-batch: its input's, handed to the layer below,
    and its weights' (or adapters'), added into its gradient accumulator."""
    s, i, m = task.step, task.layer, task.micro_batch
    dy = p.store.grads.take((s, i, m))
    balance = p.experts.balance_of(i)  # the load-balancing loss, if any
    grads = p.slots.grads(p.training.trained(i), ctx)
    first = functools.partial(p.finite.poison, step=s, where=f"layer.{i}", micro_batch=m)
    if task.activations == "keep":
        extra = balance.kept_term(s, i, m) if balance is not None else None
        dx = backward_kept(p.store.kept.take((s, i, m)), p.training.flat(i, ctx), dy, grads, extra, first)
    else:
        x = p.store.inputs.take((s, i, m))
        record = p.store.attention.take((s, i, m)) if task.activations == "attn" else None
        terms: list[torch.Tensor] = []  # the load-balancing loss's share of this layer
        tap = balance.gradient(s, m, terms) if balance is not None else None
        with torch.enable_grad(), replaying(record):
            x = x.detach().requires_grad_(True)
            leaves, w = p.training.backward_weights(i, ctx, (s, m, tuple(x.shape[:-1])))
            y = p.layers.run("train", s, i, m, x, w, tap)
            outputs, grad_outputs = ((y, terms[0]), (dy, torch.ones_like(terms[0]))) if terms else (y, dy)
            dx = backward_into(outputs, grad_outputs, x, leaves, p.training.trained(i).flat_map, grads, first)
    if p.training.hands_input_grad(i):
        p.store.grads.put((s, i - 1, m), dx)
    elif i == 0:  # no embedding backward follows (LoRA): what the micro-batch left for its layers goes now
        p.layers.forget("train", s, m)


@HANDLERS.register("embed_backward")
def run_embed_backward(p: StepProgram, task: EmbedBackward, ctx: TaskContext) -> None:
    """Scatter one micro-batch's input gradient into the embedding's gradient."""
    s, m = task.step, task.micro_batch
    dx = p.store.grads.take((s, -1, m))
    emb = p.state.embed
    g = bind(p.slots.grads(emb, ctx), emb.flat_map)
    p.layers.embed_backward(s, m, dx, g)
    for grad in g.values():
        p.finite.poison(grad, s, "embed", m)
