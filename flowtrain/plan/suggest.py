"""What would make a run that does not fit fit: the line under a refusal's ``try:``.

A plan that does not fit answers with the one change that fits first, planned on the same
machine: the largest micro-batch that fits, then single changes in the order a user would rather
make them (what costs least speed or exactness first: offloading checkpoints, the lookahead
policy in place of double buffering, fewer micro-batches, sparser checkpoints, no residency, the
staged layout, no exact clipping, the sequential policy), and, where full training's state
cannot fit the host, LoRA adapters over a frozen base (``--lora-rank 16``). Where no single
change fits, the memory the run would take, the largest model the host would hold (its
arithmetic shown) and the GPU it would need::

    use --activations offload
    use --lora-rank 16 (LoRA adapters over the frozen base: host 30.2 GiB of 60.8 usable)
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
    if policy == "double_buffer":  # the same step with other slots: what the GPU keeps, the host need not
        out.append(("--policy lookahead", req, "lookahead"))
    for n in sorted({steps - 1, *(steps >> i for i in range(1, steps.bit_length()))} - {0}, reverse=True):
        # fewer micro-batches per step: fewer layer inputs kept for backward
        out.append((f"--batch-size {n * mbs}", replace(req, batch_size=n * mbs), policy))
    for k in (2, 4, 8):
        if k != req.checkpoint_every and req.activations not in ("keep", "attention"):  # these need every layer's input
            out.append((f"--activation-checkpoint-every {k}", replace(req, checkpoint_every=k), policy))
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
    if not plan.host_fits and not req.lora_rank:  # the whole model's state cannot fit: train adapters
        out.append((f"--lora-rank {LORA_RANK}", replace(req, lora_rank=LORA_RANK), policy))
    return out


#: The rank a suggestion of LoRA names (PEFT's examples' and most recipes' choice)
LORA_RANK = 16


def _largest_model(plan: Plan) -> str:
    """The size of model that the host budget would hold, in arithmetic a reader can check: the
    usable host memory less what the run needs besides the model's state (the process, staging,
    checkpoints waiting for their backward, as planned), divided by the plan's host bytes of
    state per parameter (:attr:`Plan.state_bytes_per_param`)."""
    assert plan.host_limit is not None
    per_param = plan.state_bytes_per_param
    fixed = plan.host_node_total - _state_bytes(plan)
    room = plan.host_limit - fixed
    usable = f"{plan.host_limit / GiB:.1f} GiB usable"
    if room <= 0:
        return (f"the rest of the run alone (staging, checkpoints, the process) needs {fixed / GiB:.1f} GiB of the "
                f"{usable}: no model fits until it shrinks")
    return (f"or a model of at most about {room / per_param / 1e9:.1f} B parameters ({usable} less "
            f"{fixed / GiB:.1f} GiB for the rest of the run leaves {room / GiB:.1f} GiB = {room / 1e9:.1f} GB, at "
            f"{round(per_param, 2):g} host bytes of state per parameter)")


def _state_bytes(plan: Plan) -> float:
    """Host bytes that grow with the model: its training state at :attr:`Plan.state_bytes_per_param`
    (LoRA: its base and adapters as planned)."""
    if plan.spec.lora:
        return plan.state_bytes_per_param * plan.params
    return sum(plan.host.get(k, 0) for k in ("master", "adam", "gradients", "streaming_copy"))


def suggest(plan: Plan, req: RunRequest, policy: Any, plan_under: Callable[[RunRequest, Any], Plan]) -> list[str]:
    """What would make a run that does not fit fit: the first change, in :func:`_changes`' order,
    that was planned (``plan_under(request, policy)``, on the same machine) and fits, not a guess;
    if no single change does, what memory it would take."""
    if plan.max_micro_batch is not None and plan.max_micro_batch < req.micro_batch_size:
        return [f"use --micro-batch-size {plan.max_micro_batch} (the largest that fits)"]
    for text, trial_req, trial_policy in _changes(plan, req, policy):
        trial = plan_under(trial_req, trial_policy)
        if trial.fits:
            if trial_req.lora_rank and not req.lora_rank:
                limit = "" if trial.host_limit is None else f" of {trial.host_limit / GiB:.1f} usable"
                return [f"use {text} (LoRA adapters over the frozen base instead of training every weight: host "
                        f"{trial.host_node_total / GiB:.1f} GiB{limit})"]
            return [f"use {text}"]
    out = []
    if not plan.host_fits:
        host = math.ceil(plan.host_node_total / GiB / HOST_FILL)
        out.append(f"run where about {host} GiB of host memory is free (--host-mem {host})")
        if not plan.disk:  # with state on disk the refusal names what host memory still holds instead
            out.append(_largest_model(plan))
    if not plan.gpu_fits:
        card = math.ceil(card_for(plan.gpu_total))
        out.append(f"a GPU of about {card} GiB (--gpu-mem {card})")
    return out
