"""What would make a run that does not fit fit: the lines under a refusal's ``try:``.

A plan that does not fit says what would, and each suggestion was planned and fits on the same
machine: the largest micro-batch that fits, then single changes in the order a user would
rather make them (what costs least speed or exactness first: offloading checkpoints, fewer
micro-batches, sparser checkpoints, no residency, the staged layout, no exact clipping, the
sequential policy). Where no single change fits, the memory the run would take, and the
largest model the host would hold::

    use --activations offload
    use --batch-size 8
    run where about 140 GiB of host memory is free (--host-mem 140)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import msgspec

from .buffer_sizes import LAYOUT_STATE_BYTES
from .memory import HOST_FILL, GiB, Plan, card_for
from .request import RunRequest

__all__ = ["suggest"]


def _changes(plan: Plan, req: RunRequest, policy: Any) -> list[tuple[str, RunRequest, Any]]:
    """Single changes that can lower memory, in the order a user would rather make them (what
    costs least speed or exactness first); none is a setting already in use."""
    replace = msgspec.structs.replace
    out = []
    mbs, steps = req.micro_batch_size, req.batch_size // req.micro_batch_size
    if req.activations == "attention":  # as many saved outputs as fit, and the rest recompute
        out.append(("--activations auto", replace(req, activations="auto"), policy))
    if req.activations in ("keep", "recompute", "attention"):  # checkpoints to host memory: PCIe time, often hidden
        out.append(("--activations offload", replace(req, activations="offload"), policy))
    for n in sorted({steps - 1, *(steps >> i for i in range(1, steps.bit_length()))} - {0}, reverse=True):
        # fewer micro-batches per step: fewer layer inputs kept for backward
        out.append((f"--batch-size {n * mbs}", replace(req, batch_size=n * mbs), policy))
    for k in (2, 4, 8):
        if k != req.checkpoint_every and req.activations not in ("keep", "attention"):  # these need every layer's input
            out.append((f"--checkpoint-every {k}", replace(req, checkpoint_every=k), policy))
    if plan.spec.resident and req.resident != "none":
        out.append(("--resident none", replace(req, resident="none"), policy))
    if req.layout == "full" or (req.layout == "auto" and plan.layout == "full" and not req.grad_clip):
        out.append(("--layout staged", replace(req, layout="staged"), policy))
    if req.grad_clip:
        out.append((f"no --grad-clip (the staged layout: {LAYOUT_STATE_BYTES['staged']} host bytes per parameter "
                    f"instead of {LAYOUT_STATE_BYTES['full']})",
                    replace(req, grad_clip=False), policy))
    if policy != "sequential":
        out.append(("--policy sequential", req, "sequential"))
    return out


def _largest_model(plan: Plan) -> str:
    """The size of model that the host budget would hold: the plan's per-parameter state
    (master weights, Adam, gradient buffers, streaming copy) scaled, the rest (the process,
    staging, activations) as planned."""
    assert plan.host_limit is not None
    per_param = plan.state_bytes_per_param
    fixed = plan.host_node_total - per_param * plan.params
    most = max(0.0, (plan.host_limit - fixed) / per_param)
    what = "for LoRA's frozen base and adapters" if plan.spec.lora else f"in the {plan.layout} layout"
    return (f"or a model of at most about {most / 1e9:.1f} B parameters ({plan.host_limit / GiB:.0f} GiB usable, "
            f"{per_param:.0f} host bytes per parameter {what})")


def suggest(plan: Plan, req: RunRequest, policy: Any, plan_under: Callable[[RunRequest, Any], Plan]) -> list[str]:
    """What would make a run that does not fit fit: each suggestion is a change that was planned
    (``plan_under(request, policy)``, on the same machine) and fits (the largest micro-batch, the
    largest batch, ...), not a guess; if no single change does, what memory it would take."""
    out = []
    if plan.max_micro_batch is not None and plan.max_micro_batch < req.micro_batch_size:
        out.append(f"use --micro-batch-size {plan.max_micro_batch} (the largest that fits)")
    tried_batch = False
    for text, trial_req, trial_policy in _changes(plan, req, policy):
        if text.startswith("--batch-size") and tried_batch:
            continue
        trial = plan_under(trial_req, trial_policy)
        if trial.fits:
            tried_batch |= text.startswith("--batch-size")
            out.append(f"use {text}")
    if not out:
        if not plan.host_fits:
            host = math.ceil(plan.host_node_total / GiB / HOST_FILL)
            out.append(f"run where about {host} GiB of host memory is free (--host-mem {host})")
            out.append(_largest_model(plan))
        if not plan.gpu_fits:
            card = math.ceil(card_for(plan.gpu_total))
            out.append(f"a GPU of about {card} GiB (--gpu-mem {card})")
    return out
