"""Handlers of offloaded activation checkpoints: ``offload_act`` and ``fetch_act``.

Where the plan offloads a layer's checkpoint (``--activations offload``), its input waits in a
pinned host buffer kept per ``(layer, micro_batch)`` and reused every step, between the forward
that made it and the backward that needs it; ``fetch_act`` brings it back into one of
``budgets["acts"]`` device buffers (a slot: the engine makes the next copy into it wait for
the backward tasks that read it), so no copy back allocates device memory. Both sets of
buffers are the program's :class:`~.slots.OffloadedActivations`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...graph.tasks import FetchAct, OffloadAct
from ...runtime.engine import TaskContext
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("offload_act")
def run_offload_act(p: StepProgram, task: OffloadAct, ctx: TaskContext) -> int:
    """An offloaded checkpoint to its pinned host buffer, on the d2h lane (after the layer's
    forward has read it); the device copy is freed once the copy has run."""
    acts = p.acts
    key = (task.step, task.layer, task.micro_batch)
    x = p.store.inputs.take(key)
    buf = acts.host.get(key[1:])
    if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:  # not reserved ahead
        buf = acts.host[key[1:]] = acts.buffer(x.shape, x.dtype)
    buf.copy_(x, non_blocking=p.slots.non_blocking)
    if p.device.type == "cuda":
        x.record_stream(torch.cuda.current_stream(p.device))
    return buf.numel() * buf.element_size()


@HANDLERS.register("fetch_act")
def run_fetch_act(p: StepProgram, task: FetchAct, ctx: TaskContext) -> int:
    """An offloaded checkpoint back onto the device, on the h2d lane, before its backward.
    The next step's ``offload_act`` of the same checkpoint cannot overwrite the host buffer
    before this copy has run: it follows that step's forward of the layer, which follows
    (through the layer's Adam) this step's backward of it, which waits for this copy."""
    acts = p.acts
    key = (task.step, task.layer, task.micro_batch)
    buf = acts.host[key[1:]]
    slot: int = ctx.slot  # type: ignore[assignment]
    x = acts.slots.get(slot)
    if x is None or x.shape != buf.shape:
        x = acts.slots[slot] = torch.empty(buf.shape, dtype=buf.dtype, device=p.device)
    x.copy_(buf, non_blocking=p.slots.non_blocking)
    p.store.inputs.put(key, x)
    return buf.numel() * buf.element_size()
