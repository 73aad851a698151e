"""Scheduling policies: a protocol, a registry and the built-ins."""

from . import builtin as _builtin  # noqa: F401  (registers the built-ins)
from .base import POLICIES, Policy, Proposal, WithBudgets, natural_order, optimizer_urgency, register_policy, resolve_policy
from .builtin import DoubleBuffer, Lookahead, Sequential

__all__ = [
    "POLICIES",
    "Policy",
    "Proposal",
    "WithBudgets",
    "natural_order",
    "optimizer_urgency",
    "register_policy",
    "resolve_policy",
    "Sequential",
    "DoubleBuffer",
    "Lookahead",
]
