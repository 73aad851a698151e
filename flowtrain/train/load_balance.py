"""The load-balancing loss of a mixture of experts, exact in a streamed step.

transformers adds ``router_aux_loss_coef * aux`` to a sparse model's loss when the config sets
``output_router_logits``, with, over every sparse layer l and every real (not padding) token t
of the batch, ``N`` such (layer, token) rows and E experts::

    f_e = (rows whose top-k experts include e) / N       # how often e is chosen (no gradient)
    P_e = (sum over rows of softmax(router logits)_e) / N  # how much probability e gets
    aux = E * sum_e f_e * P_e

That is one loss over all layers at once, not a sum of per-layer terms, which a step that runs
one layer at a time, and its backward only after the whole forward, can still compute exactly:

* forward: each sparse layer adds its rows' choices to ``count_e`` and their probabilities to
  ``mass_e`` (:meth:`LoadBalance.counting`; no gradient, a few numbers per expert);
* loss: after the last layer ``aux = E * sum_e (count_e / N) (mass_e / N)`` is known;
* backward: ``aux`` is linear in the probabilities once the counts are fixed, so each sparse
  layer's backward adds ``sum over its rows of g_e * P[row, e]`` with ``g_e = coef * E *
  count_e / N**2`` to what it differentiates (:meth:`LoadBalance.gradient`): its router gets
  exactly its share of the gradient.

transformers computes ``aux`` per forward call, so a step of several micro-batches (gradient
accumulation) gets each micro-batch's ``aux`` divided by their number: with one micro-batch per
step the loss is transformers' ``outputs.loss``. Padding is excluded as transformers'
``attention_mask`` excludes it: a row's real tokens run up to one past its last target.
Data parallel, each process tallies its own micro-batches and each term counts one over all of
the step's micro-batches, so the gradients summed over processes are the step's.

Evaluation (``--eval-data``) reports the cross-entropy alone, without this term.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..model.functional import IGNORE_INDEX
from ..model.moe import RouterTap

__all__ = ["LoadBalance", "real_tokens"]


def real_tokens(targets: Tensor) -> Tensor:
    """(rows, seq) targets -> (rows * seq,) fp32 1/0: the tokens up to one past each row's last
    target (the last real token predicts nothing), the padding after them 0."""
    seq = targets.shape[-1]
    pos = torch.arange(seq, device=targets.device)
    last = torch.where(targets != IGNORE_INDEX, pos, -2).amax(dim=-1, keepdim=True)
    return (pos <= last + 1).float().reshape(-1)


class _Tally:
    """One micro-batch's routing, summed over its sparse layers so far."""

    def __init__(self, mask: Tensor, experts: int) -> None:
        self.mask = mask  # (tokens,) fp32
        self.count = torch.zeros(experts, dtype=torch.float32, device=mask.device)
        self.mass = torch.zeros(experts, dtype=torch.float32, device=mask.device)


class LoadBalance:
    """Tallies, loss and backward weights of the load-balancing loss, per (step, micro-batch),
    over the sparse layers ``layers`` (:meth:`of_model`)."""

    def __init__(self, coef: float, experts: int, k: int, layers: Sequence[int]) -> None:
        self.coef = coef
        self.experts = experts
        self.k = k
        self.sparse = frozenset(layers)
        self.layers = len(self.sparse)
        self._tallies: dict[tuple[int, int], _Tally] = {}
        self._micro_batches: dict[int, int] = {}
        #: probabilities of kept forwards (their graph alive), for their backward
        self._kept: dict[tuple[int, int, int], Tensor] = {}

    @classmethod
    def of_model(cls, cfg: ModelConfig) -> "LoadBalance | None":
        """The loss ``cfg`` trains with (None: none): a native mixture of experts' where its
        config sets ``output_router_logits``, or what transformers adds on the generic path
        (:func:`flowtrain.model.generic.routing.load_balance_of`)."""
        if cfg.generic:
            from ..model.generic.routing import load_balance_of

            spec = load_balance_of(cfg.hf_json) if cfg.hf_json is not None else None
            return None if spec is None or not spec.layers else cls(spec.coef, spec.experts, spec.k, spec.layers)
        if cfg.moe and cfg.output_router_logits and cfg.sparse_layers():
            return cls(cfg.router_aux_loss_coef, cfg.num_experts, cfg.num_experts_per_tok, cfg.sparse_layers())
        return None

    def begin(self, step: int, targets: Sequence[Tensor], device: torch.device, micro_batches: int) -> None:
        """This process's micro-batches' targets (their real tokens are counted) and how many
        micro-batches the step has in all (over every data-parallel process)."""
        self._micro_batches[step] = micro_batches
        for m, t in enumerate(targets):
            self._tallies[(step, m)] = _Tally(real_tokens(t.to(device)), self.experts)

    def end(self, step: int) -> None:
        for tally in [k for k in self._tallies if k[0] == step]:
            del self._tallies[tally]
        for kept in [k for k in self._kept if k[0] == step]:
            del self._kept[kept]
        self._micro_batches.pop(step, None)

    def counting(self, step: int, layer: int, micro_batch: int) -> RouterTap:
        """The tap of a layer's forward: adds its choices and probabilities to the tally (and
        keeps the probabilities where the forward's graph is kept for its backward)."""
        tally = self._tallies[(step, micro_batch)]

        def tap(probs: Tensor, experts: Tensor) -> None:
            if probs.requires_grad:
                self._kept[(step, layer, micro_batch)] = probs
            p = probs.detach()
            tally.count.scatter_add_(0, experts.reshape(-1), tally.mask.repeat_interleave(experts.shape[1]))
            tally.mass += (p * tally.mask[:, None]).sum(0)
        return tap

    def _rows(self, tally: _Tally) -> Tensor:
        return tally.mask.sum() * self.layers

    def loss(self, step: int, micro_batch: int) -> Tensor:
        """``coef * aux`` of one micro-batch divided by the step's micro-batches (fp32 scalar),
        once all its layers' forwards are in."""
        tally = self._tallies[(step, micro_batch)]
        n = self._rows(tally)
        aux = self.experts * torch.dot(tally.count / n, tally.mass / n)
        return self.coef * aux / self._micro_batches[step]

    def _term(self, step: int, micro_batch: int, probs: Tensor) -> Tensor:
        """``sum(g_e * P[row, e])`` over the real rows of one layer's probabilities, ``g`` the
        loss's gradient with respect to each of them: differentiated, the layer's share."""
        tally = self._tallies[(step, micro_batch)]
        n = self._rows(tally)
        g = self.coef * self.experts * tally.count / (n * n) / self._micro_batches[step]
        return (probs * tally.mask[:, None] * g[None, :]).sum()

    def gradient(self, step: int, micro_batch: int, terms: list[Tensor]) -> RouterTap:
        """The tap of a layer's backward re-run: appends its :meth:`_term` to ``terms``, which
        the backward differentiates along with the layer's output."""
        def tap(probs: Tensor, experts: Tensor) -> None:
            terms.append(self._term(step, micro_batch, probs))
        return tap

    def kept_term(self, step: int, layer: int, micro_batch: int) -> Tensor | None:
        """The same term for a kept forward's probabilities (None: the layer has no router)."""
        probs = self._kept.pop((step, layer, micro_batch), None)
        return None if probs is None else self._term(step, micro_batch, probs)
