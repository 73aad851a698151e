"""Losses over log-probabilities: DPO for preference pairs, and GRPO's per-token policy loss.

The head never builds a micro-batch's logits (:mod:`flowtrain.model.functional`), so a loss
other than cross-entropy enters in two passes over the head: the first gives each target
token's log-probability ``logp`` (``(rows, seq)`` fp32, no gradient), the loss below is taken
of it under autograd (a few thousand numbers: cheap), and its gradient ``g = dL/dlogp`` goes
back into the head's backward as one weight per token, ``-g`` on that token's cross-entropy
(``d(-logp) = -dlogp``). So each loss is written once, as a function of log-probabilities,
and the streamed model differentiates it exactly::

    logp = runner.head_token_logprobs(h, norm_w, head_w, targets, chunk)          # (rows, seq)
    loss, g = loss_and_grad(lambda lp: dpo_step_loss(lp, ...), logp)
    _, d_h, d_norm, d_head = runner.head_loss_and_grads(h, norm_w, head_w, targets, -g, chunk, True)

**DPO** (:func:`dpo_losses`), as TRL's ``DPOTrainer`` computes it: with ``pi`` and ``ref`` the
policy's and the reference's log-probability of each completion,
``margin = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)``:

- ``sigmoid``: ``-logsigmoid(beta * margin)``, log-probabilities *summed* over each
  completion's tokens;
- ``ipo``: ``(margin - 1 / (2 beta))^2``, log-probabilities *averaged* over each completion's
  tokens (TRL divides them by the completion's length for ``loss_type="ipo"``).

The step's loss is the mean over its pairs, however they are cut into micro-batches (each
pair's two rows sit in one micro-batch). The rewards TRL logs are ``beta * (pi - ref)`` of the
chosen and the rejected completion, their difference (the margin) and how often the chosen's
is larger (the accuracy), means over the step's pairs.

**GRPO** (:func:`grpo_token_loss`), the per-token loss of TRL's ``GRPOTrainer``: with the
ratio ``r = exp(logp - old_logp)`` and per-token advantages ``A``,
``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, plus ``beta`` times the k3 estimate of
the KL divergence to the reference, ``exp(ref - logp) - (ref - logp) - 1``. A step's loss
(:func:`policy_step_loss`) weighs each completion token's loss by its share of the step
(:func:`policy_token_weights`): ``dapo`` (TRL's default) divides by the step's completion
tokens, ``grpo`` averages each completion's tokens, then the completions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPO_LOSSES", "POLICY_LOSSES", "dpo_losses", "dpo_step_loss", "grpo_token_loss", "loss_and_grad",
           "policy_step_loss", "policy_token_weights", "sequence_logps"]

#: DPO losses flowtrain computes, as TRL names them (``loss_type``)
DPO_LOSSES = ("sigmoid", "ipo")
#: how a policy step's token losses are averaged, as TRL's ``GRPOConfig.loss_type`` names them
POLICY_LOSSES = ("dapo", "grpo")


def sequence_logps(logp: Tensor, mask: Tensor, loss_type: str) -> Tensor:
    """Each row's completion log-probability, ``(rows,)``: the sum of ``logp`` over the tokens
    ``mask`` marks, or (``ipo``) their mean."""
    total = (logp * mask).sum(-1)
    return total / mask.sum(-1).clamp_min(1) if loss_type == "ipo" else total


def dpo_losses(pi_chosen: Tensor, pi_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float,
               loss_type: str = "sigmoid") -> Tensor:
    """Each pair's DPO loss, ``(pairs,)`` (see the module)."""
    logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    raise ValueError(f"DPO loss must be one of {', '.join(DPO_LOSSES)} (got {loss_type!r})")


def dpo_step_loss(logp: Tensor, mask: Tensor, ref: Tensor, beta: float, loss_type: str,
                  rewards: Tensor | None = None) -> Tensor:
    """The summed DPO loss of one micro-batch's pairs. ``logp``, ``mask``: ``(rows, seq)``,
    rows ``2p`` and ``2p + 1`` pair ``p``'s chosen and rejected; ``ref``: ``(rows,)``, the
    reference's *summed* completion log-probabilities (averaged here for ``ipo``). ``rewards``,
    where given, ``(4,)``, gets the pairs' chosen and rejected rewards, margins and accuracies
    added (detached sums)."""
    pi = sequence_logps(logp, mask, loss_type)
    ref = ref / mask.sum(-1).clamp_min(1) if loss_type == "ipo" else ref
    losses = dpo_losses(pi[0::2], pi[1::2], ref[0::2], ref[1::2], beta, loss_type)
    if rewards is not None:
        with torch.no_grad():
            chosen, rejected = beta * (pi[0::2] - ref[0::2]), beta * (pi[1::2] - ref[1::2])
            rewards += torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                                    (chosen > rejected).float().sum()])
    return losses.sum()


def grpo_token_loss(logp: Tensor, advantages: Tensor, old_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                    *, beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None) -> Tensor:
    """GRPO's loss of each token, ``logp``'s shape (see the module). ``old_logp`` None: the
    policy that generated is this one (``old_logp = logp.detach()``, ratio 1, TRL's single
    update per generation); ``ref_logp`` None or ``beta`` 0: no KL term. ``epsilon_high``
    defaults to ``epsilon_low``."""
    old = logp.detach() if old_logp is None else old_logp
    high = epsilon_low if epsilon_high is None else epsilon_high
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0 and ref_logp is not None:
        delta = ref_logp - logp
        loss = loss + beta * (torch.exp(delta) - delta - 1)
    return loss


def policy_token_weights(mask: Tensor, loss_type: str = "dapo") -> Tensor:
    """Each token's share of a policy step's loss, ``mask``'s shape (0 where ``mask`` is 0):
    ``dapo`` one over the step's completion tokens (a token mean over the whole step, TRL's
    ``loss_type="dapo"``), ``grpo`` one over (rows x the row's completion tokens) (each
    completion's token mean, averaged over the completions)."""
    mask = mask.float()
    if loss_type == "dapo":
        return mask / mask.sum().clamp_min(1)
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp_min(1) * mask.shape[0])
    raise ValueError(f"the policy loss must be one of {', '.join(POLICY_LOSSES)} (got {loss_type!r})")


def policy_step_loss(logp: Tensor, mask: Tensor, weights: Tensor, advantages: Tensor, old_logp: Tensor | None = None,
                     ref_logp: Tensor | None = None, *, beta: float = 0.0, epsilon_low: float = 0.2,
                     epsilon_high: float | None = None, sums: Tensor | None = None) -> Tensor:
    """One micro-batch's share of a policy step's loss: :func:`grpo_token_loss` of each token
    weighed by ``weights`` (:func:`policy_token_weights` of the whole step). ``sums``, where
    given, ``(2,)``, gets the summed k3 KL over the tokens ``mask`` marks (0 without a
    reference) and how many of them the clip held (TRL's ``clip_ratio/region_mean``: the ratio
    below ``1 - eps_low`` with a negative advantage, or above ``1 + eps_high`` with a positive
    one) added."""
    per_token = grpo_token_loss(logp, advantages, old_logp, ref_logp, beta=beta, epsilon_low=epsilon_low,
                                epsilon_high=epsilon_high)
    if sums is not None:
        with torch.no_grad():
            m = mask.float()
            kl = torch.zeros((), device=logp.device)
            if ref_logp is not None:
                delta = ref_logp - logp
                kl = ((torch.exp(delta) - delta - 1) * m).sum()
            ratio = torch.exp(logp - (logp if old_logp is None else old_logp))
            high = epsilon_low if epsilon_high is None else epsilon_high
            clipped = ((ratio < 1 - epsilon_low) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
            sums += torch.stack([kl, (clipped.float() * m).sum()])
    return (per_token * weights).sum()


def loss_and_grad(loss: Callable[[Tensor], Tensor], logp: Tensor) -> tuple[Tensor, Tensor]:
    """``(loss(logp) detached, d loss / d logp)``: a scalar loss of the log-probabilities and
    its gradient, which the head's backward takes as each token's weight (negated)."""
    with torch.enable_grad():
        leaf = logp.detach().requires_grad_(True)
        value = loss(leaf)
        (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad
