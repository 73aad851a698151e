"""Handlers of the head: ``loss`` (training) and ``eval_loss`` (held-out).

The loss never materialises full logits: the final norm, the output projection and the
cross-entropy run chunk by chunk (``chunk_tokens``), forward and backward at once, yielding the
loss sum, the gradient of the last hidden state and, where the head trains, its weights'
gradients (added into the head's accumulator, laid out by the :mod:`.tied` part). Each loss also
copies the step's running loss to pinned host memory on its own lane, where ``cpu_adam`` reads
it to know whether the step is finite (:mod:`flowtrain.train.nonfinite`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...graph.tasks import EvalLoss, Loss
from ...model.functional import IGNORE_INDEX
from ..objectives import dpo_step_loss, loss_and_grad, policy_step_loss
from ...runtime.engine import TaskContext
from .registry import HANDLERS

if TYPE_CHECKING:
    from .core import StepProgram


@HANDLERS.register("loss")
def run_loss(p: StepProgram, task: Loss, ctx: TaskContext) -> None:
    """One micro-batch's loss and the head's backward; the last hidden state's gradient goes to
    the top layer's backward."""
    s, m = task.step, task.micro_batch
    data = p.steps[s]
    L = p.cfg.num_layers
    h = p.store.inputs.take((s, L, m))
    targets = data.targets[m].to(p.device, non_blocking=p.slots.non_blocking)
    trains = p.training.head_trains  # with LoRA the head takes no gradient: only the hidden state's
    norm_w, head_w = p.head.weights(ctx)
    if data.reference is not None or data.policy is not None:  # a loss of the tokens' log-probabilities
        pick = _preference if data.reference is not None else _policy
        loss_sum, scale = pick(p, data, m, h, norm_w, head_w, targets)
        _, d_h, d_norm, d_head = p.layers.head_loss_and_grads(
            h, norm_w, head_w, targets, scale, p.chunk_tokens, weight_grads=trains)
    else:
        loss_sum, d_h, d_norm, d_head = p.layers.head_loss_and_grads(
            h, norm_w, head_w, targets, 1.0 / data.n_targets, p.chunk_tokens, weight_grads=trains)
    loss_sum = p.finite.poison(loss_sum, s, "loss", m)
    if trains:
        assert d_norm is not None and d_head is not None
        norm_g, head_g = p.head.grads(ctx)
        norm_g.add_(p.finite.poison(d_norm, s, "head", m))
        head_g.add_(d_head)
    aux = p.experts.aux_loss(s, m)
    with p.lock:
        data.loss = loss_sum if data.loss is None else data.loss + loss_sum
        data.check.loss_host = p.slots.host_copy(data.loss)  # read by cpu_adam, on the host
        if aux is not None:
            data.aux_loss = aux if data.aux_loss is None else data.aux_loss + aux
    p.store.grads.put((s, L - 1, m), d_h)


def _preference(p: StepProgram, data, m: int, h, norm_w, head_w, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's summed DPO loss and each token's weight on its cross-entropy (the
    loss's gradient with respect to the token's log-probability, negated, over the step's
    pairs): :mod:`flowtrain.train.objectives`."""
    assert data.reference is not None and p.preference is not None
    beta, loss_type = p.preference
    logp = p.layers.head_token_logprobs(h, norm_w, head_w, targets, p.chunk_tokens)
    mask = (targets != IGNORE_INDEX).float()
    ref = data.reference[m].to(p.device, non_blocking=p.slots.non_blocking)
    rewards = torch.zeros(4, dtype=torch.float32, device=p.device)
    loss_sum, g = loss_and_grad(lambda lp: dpo_step_loss(lp, mask, ref, beta, loss_type, rewards), logp)
    with p.lock:
        data.rewards = rewards if data.rewards is None else data.rewards + rewards
    return loss_sum, g.mul_(-1.0 / data.n_targets)  # n_targets: the step's pairs


def _policy(p: StepProgram, data, m: int, h, norm_w, head_w, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's share of a policy step's loss (GRPO's, per token, weighed by each
    token's share of the step) and each token's weight on its cross-entropy; the tokens'
    log-probabilities are kept for the caller."""
    assert data.policy is not None
    beta, eps_low, eps_high = p.policy_loss
    batch = data.policy[m].to(p.device, non_blocking=p.slots.non_blocking)
    logp = p.layers.head_token_logprobs(h, norm_w, head_w, targets, p.chunk_tokens)
    mask = targets != IGNORE_INDEX
    sums = torch.zeros(2, dtype=torch.float32, device=p.device)
    loss_sum, g = loss_and_grad(lambda lp: policy_step_loss(
        lp, mask, batch.weights, batch.advantages, batch.old_logps, batch.ref_logps, beta=beta, epsilon_low=eps_low,
        epsilon_high=eps_high, sums=sums), logp)
    with p.lock:
        data.policy_sums = sums if data.policy_sums is None else data.policy_sums + sums
        data.logps[m] = logp.cpu()
    return loss_sum, g.neg_()


@HANDLERS.register("eval_loss")
def run_eval_loss(p: StepProgram, task: EvalLoss, ctx: TaskContext) -> None:
    """Forward only: final norm, head and the summed CE of one held-out micro-batch (fp32);
    in a reference pass (DPO), each row's summed target log-probability instead, or each
    target token's (a policy's log-probabilities)."""
    s, m = task.step, task.micro_batch
    data = p.evals[s]
    h = p.store.eval_inputs.take((s, p.cfg.num_layers, m))
    targets = data.targets[m].to(p.device, non_blocking=p.slots.non_blocking)
    norm_w, head_w = p.head.weights(ctx)
    if data.per_token:
        loss_sum = p.layers.head_token_logprobs(h, norm_w, head_w, targets, p.chunk_tokens)
    elif data.reference:
        loss_sum = p.layers.head_token_logprobs(h, norm_w, head_w, targets, p.chunk_tokens).sum(-1)
    else:
        loss_sum = p.layers.head_loss(h, norm_w, head_w, targets, p.chunk_tokens)
    p.layers.forget("eval", s, m)
    with p.lock:
        data.sums[m] = loss_sum
