"""The built-in policies: how far ahead weights are fetched.

All three issue tasks in the compiler's serial order; they differ in how many weight slots
the engine may fill, which is exactly how far the ``h2d`` lane may run ahead of compute. The two
overlapping ones also let the CPU run the optimizer in the order the next step needs it
(:func:`~flowtrain.policy.base.optimizer_urgency`) rather than the order gradients arrive in:

- ``sequential``: one slot. Layer i+1 is fetched only after the last task reading layer i
  has run: no overlap of copy and compute.
- ``double_buffer``: two slots. Layer i+1 is fetched while layer i computes.
- ``lookahead``: ``k`` slots (default 3): up to k-1 layers fetched ahead.
"""

from __future__ import annotations

import networkx as nx

from ..errors import ConfigError
from .base import Proposal, budgets, natural_order, optimizer_urgency, register_policy


@register_policy("sequential")
class Sequential:
    """One weight slot and one gradient accumulator: nothing overlaps on purpose."""

    def propose(self, graph: nx.DiGraph) -> Proposal:
        return Proposal(natural_order(graph), budgets(graph, weights=1, grads=1))


@register_policy("double_buffer")
class DoubleBuffer:
    """Two weight slots: fetch the next unit while the current one computes; two gradient
    accumulators, so offloading one unit's gradient overlaps the next unit's backward."""

    def propose(self, graph: nx.DiGraph) -> Proposal:
        return Proposal(natural_order(graph), budgets(graph, weights=2, grads=2), optimizer_urgency(graph))


@register_policy("lookahead")
class Lookahead:
    """``k`` weight slots: up to ``k - 1`` units fetched ahead of the one computing."""

    def __init__(self, k: int = 3) -> None:
        if k < 1:
            raise ConfigError(f"lookahead needs at least 1 slot (got k={k})")
        self.k = k

    def propose(self, graph: nx.DiGraph) -> Proposal:
        return Proposal(natural_order(graph), budgets(graph, weights=self.k, grads=2), optimizer_urgency(graph))
