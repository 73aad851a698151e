"""A mixture of experts as the step program sees it: the load-balancing loss and idle experts.

A part the step program is composed with. For a dense model (or a mixture trained without
either feature) every hook answers "nothing to do", so the task bodies run unchanged:

- the load-balancing loss (``output_router_logits``, :mod:`flowtrain.train.load_balance`): a
  forward's router tap counts each sparse layer's routing, the loss adds the weighted term,
  and the layer's backward differentiates its share along with its output;
- idle experts (``--skip-idle-experts``, :mod:`flowtrain.train.idle_experts`): an expert no
  real token of the step reached is neither fetched again for the backward, nor offloaded,
  nor updated (each expert keeps its own Adam step count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...graph.tasks import Task
from ...model.moe import RouterTap
from ..distributed import all_reduce_sum
from ..host_state import HostState
from ..idle_experts import IdleExperts, Range
from ..load_balance import LoadBalance


class Experts:
    """The load-balancing loss (``balance``, None without it) and the layers that skip idle
    experts (``idle``, empty without them)."""

    def __init__(self, state: HostState, device: torch.device) -> None:
        cfg = self.cfg = state.cfg
        #: a mixture of experts trained with its load-balancing loss (output_router_logits)
        self.balance = LoadBalance.of_model(cfg)
        #: the sparse layers that skip idle experts, and what each step's routing tells them
        self.idle = IdleExperts(state, device)

    def skipping(self, task: Task) -> int | None:
        """The layer a task of a sparse layer that skips idle experts works on; None for any other
        task (another unit's, or a layer's that updates every expert)."""
        return task.layer if task.unit == "layer" and task.layer in self.idle else None

    # ---- step boundaries
    def begin(self, step: int, targets: Sequence[torch.Tensor], device: torch.device, micro_batches: int) -> None:
        if self.balance is not None:  # each process's micro-batches are its share of the step's
            self.balance.begin(step, targets, device, micro_batches)

    def end(self, step: int) -> float | None:
        """Forget the step; the fraction of expert weights its fetches left in host memory."""
        if self.balance is not None:
            self.balance.end(step)
        return self.idle.end_step(step)

    # ---- forward, loss, backward
    def forward_tap(self, s: int, i: int, m: int, targets: torch.Tensor) -> RouterTap | None:
        """The router tap of layer ``i``'s forward in training: what the load-balancing loss
        counts, and where the layer skips idle experts, its real tokens per expert (None:
        neither)."""
        taps = []
        if self.balance is not None and i in self.balance.sparse:
            taps.append(self.balance.counting(s, i, m))
        if i in self.idle:
            taps.append(self.idle.tap(s, i, m, targets))
        if len(taps) < 2:
            return taps[0] if taps else None

        def both(probs: torch.Tensor, experts: torch.Tensor) -> None:
            for tap in taps:
                tap(probs, experts)
        return both

    def aux_loss(self, s: int, m: int) -> torch.Tensor | None:
        """Micro-batch ``m``'s weighted load-balancing term (None without the loss)."""
        return self.balance.loss(s, m) if self.balance is not None else None

    def balance_of(self, i: int) -> LoadBalance | None:
        """The load-balancing loss where layer ``i`` is sparse and trained with it."""
        return self.balance if self.balance is not None and i in self.balance.sparse else None

    # ---- gradients
    def offload_ranges(self, task: Task, micro_batches: int, lo: int, hi: int) -> list[Range]:
        """The ranges of ``[lo, hi)`` an offload copies: all of it, or the trained experts'."""
        if (i := self.skipping(task)) is None:
            return [(lo, hi)]
        return self.idle.trained_ranges(task.step, i, micro_batches, lo, hi)

    def sum_counts(self, task: Task, micro_batches: int) -> None:
        """Data parallel: the experts each process's routing reached, summed as the gradient is
        (an expert is idle only where no process's micro-batch reached it)."""
        if (i := self.skipping(task)) is not None:
            counts = self.idle.step_counts(task.step, i, range(micro_batches))
            all_reduce_sum(counts)
            self.idle.set_summed(task.step, i, counts)
