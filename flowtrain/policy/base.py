"""Policies propose; the engine decides.

A policy looks at a compiled step graph and proposes a plan: an order in which each lane should
issue its tasks, and a slot budget per pool (how many weight slots, how many gradient
accumulators). The engine still enforces dependencies and budgets, checks that the order is
topological, and reports a deadlock if the budget is too small for the order.

Built-ins live in a registry keyed by name, so ``--policy double_buffer`` and a user's own
class go through the same door::

    @register_policy("my_policy")
    class MyPolicy:
        def propose(self, graph):
            return Proposal(order=natural_order(graph), budgets={"weights": 3, "grads": 2})

    resolve_policy("my_policy")      # or resolve_policy(MyPolicy())
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import msgspec
import networkx as nx

from ..errors import ConfigError, CycleError
from ..graph.tasks import ACTS, GRADS, HOST_GRADS, HOST_STATE, WEIGHTS, CpuAdam, Task


class Proposal(msgspec.Struct, frozen=True):
    """A plan: every task of the graph in issue order, a slot budget per pool, and optionally
    an urgency per host task (lower runs sooner), which lets the engine run urgent host work out
    of plan order as its inputs arrive (:mod:`flowtrain.runtime.scheduler`)."""

    order: list[Task]
    budgets: dict[str, int]
    urgency: dict[Task, float] = {}


@runtime_checkable
class Policy(Protocol):
    """Anything with ``propose(graph) -> Proposal``."""

    def propose(self, graph: nx.DiGraph) -> Proposal: ...


POLICIES: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy available by name (``--policy NAME``)."""

    def deco(cls: type) -> type:
        POLICIES[name] = cls
        setattr(cls, "name", name)  # a class attribute the built-ins' ``name`` reads
        return cls

    return deco


def resolve_policy(policy: "str | Policy", **options: object) -> Policy:
    """A policy instance from a registered name, from ``"module:Class"`` (a user's class,
    imported; both with constructor ``options``), or an object with ``propose``."""
    if isinstance(policy, str):
        if ":" in policy:
            return _import_policy(policy, options)
        try:
            factory = POLICIES[policy]
        except KeyError:
            names = ", ".join(sorted(POLICIES))
            raise ConfigError(f"unknown policy {policy!r}; choose one of: {names}, or module:Class") from None
        return factory(**options)
    if not isinstance(policy, Policy):
        raise ConfigError(f"{policy!r} is not a policy: it needs a propose(graph) method")
    return policy


def _import_policy(spec: str, options: dict[str, object]) -> Policy:
    """``--policy my_schedules:ZigZag``: the class ``ZigZag`` of the module ``my_schedules``,
    instantiated. The module is found as ``python -m`` finds one: in the working directory,
    then on ``PYTHONPATH``. Importing it runs its code, as any import does."""
    import importlib
    import os
    import sys

    module, _, name = spec.partition(":")
    if not module or not name.isidentifier():
        raise ConfigError(f"--policy {spec}: give module:Class, a module and the name of a class in it, "
                          "like my_schedules:ZigZag")
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        factory = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(f"--policy {spec}: cannot import module {module!r} ({exc}); put it in the working "
                          "directory or on PYTHONPATH") from None
    except AttributeError:
        raise ConfigError(f"--policy {spec}: module {module!r} has no {name!r}") from None
    finally:
        if added:
            sys.path.remove(here)
    if not isinstance(factory, type):  # a function, a constant: not a policy to instantiate
        raise ConfigError(f"--policy {spec}: {module}.{name} is a {type(factory).__name__}, not a class; "
                          "give a class with a propose(graph) method")
    try:
        made = factory(**options)
    except Exception as exc:  # the user's constructor: its failure is theirs to read, in one line
        raise ConfigError(f"--policy {spec}: {module}.{name}() failed: {type(exc).__name__}: {exc}") from None
    return resolve_policy(made)


def natural_order(graph: nx.DiGraph) -> list[Task]:
    """A topological order that stays as close as possible to the order in which the compiler
    inserted the tasks (its serial order: fetch, then the work that reads it, and so on)."""
    index = {t: i for i, t in enumerate(graph.nodes)}
    if all(index[u] < index[v] for u, v in graph.edges):
        return list(graph.nodes)  # already topological (the compiler's case): the same answer, faster
    try:
        return list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = " -> ".join(str(u) for u, _ in nx.find_cycle(graph))
        raise CycleError(f"the task graph has a cycle ({cycle}), so no order satisfies its dependencies") from None


def optimizer_urgency(graph: nx.DiGraph) -> dict[Task, float]:
    """Urgencies that have the CPU update first what the next step reads first.

    Gradients reach the host top layer first, but the next step's forward reads the embedding
    and the bottom layers first, so updating in arrival order leaves the bottom layers' Adam
    (the last to arrive) on the next step's critical path. Ranked instead by where the next
    step reads a unit, each ``cpu_adam`` that is ready runs in that order; the top layers'
    updates, whose next reads are furthest away, overlap the next step's forward."""
    layers = max((t.layer for t in graph if t.layer is not None), default=-1) + 1
    rank = {"embed": 0, "layer": 1, "head": layers + 1}
    return {t: rank.get(t.unit or "", layers + 2) + (t.layer or 0) for t in graph if isinstance(t, CpuAdam)}


def min_grad_slots(graph: nx.DiGraph) -> int:
    """Gradient accumulators the graph needs at once: one per unit when micro-batches run
    through the whole model one at a time (every unit accumulates until the last one)."""
    spec = graph.graph.get("spec", {})
    if spec.get("order") == "micro" and spec.get("micro_batches", 1) > 1:
        first = min(t.step for t in graph)
        return sum(1 for t in graph if t.takes == GRADS and t.step == first)
    return 1


def act_slots(order: str, checkpoint_every: int, micro_batches: int) -> int:
    """The built-in policies' ``acts`` budget: one more than the offloaded checkpoints that must
    be back on the device at once. A segment's checkpoint is read by its ``recompute`` and again
    by its ``backward``, so layer-major with segments of several layers every micro-batch's
    checkpoint is back before the first backward of the segment; otherwise one at a time. The
    planner counts the same (``flowtrain.plan.memory``)."""
    at_once = micro_batches if order == "layer" and checkpoint_every > 1 else 1
    return at_once + 1


def budgets(graph: nx.DiGraph, weights: int, grads: int, host_grads: int = 3) -> dict[str, int]:
    """Slot budgets for a built-in policy: ``weights`` slots and at least ``grads`` accumulators,
    plus ``host_grads`` host staging slots where the graph's gradients are staged (one chunk
    in flight to the host while the CPU runs Adam on the one before, and one spare), and where
    checkpoints are offloaded, one ``acts`` slot more than must be back at once (the next
    checkpoint is copied while the current one's backward runs); where optimizer state lives
    on disk, the ``host_state`` staging slots its reads run ahead by (``disk_ahead``)."""
    out = {WEIGHTS: weights, GRADS: max(grads, min_grad_slots(graph))}
    if any(t.takes == HOST_GRADS for t in graph):
        out[HOST_GRADS] = host_grads
    if any(t.takes == ACTS for t in graph):
        spec = graph.graph.get("spec", {})
        out[ACTS] = act_slots(spec.get("order", "layer"), spec.get("checkpoint_every", 1), spec.get("micro_batches", 1))
    if any(t.takes == HOST_STATE for t in graph):
        out[HOST_STATE] = graph.graph.get("spec", {}).get("disk_ahead", 2)
    return out


class WithBudgets:
    """A policy's order with other slot budgets: how a memory plan that shrank or grew the
    policy's budgets (``flowtrain.plan.planner``) hands them to the engine::

        engine = Engine(program, WithBudgets(resolve_policy("double_buffer"), {"weights": 2, "grads": 1}))
    """

    def __init__(self, policy: Policy, budgets: dict[str, int]) -> None:
        self.policy = policy
        self.budgets = dict(budgets)

    def propose(self, graph: nx.DiGraph) -> Proposal:
        inner = self.policy.propose(graph)
        # a pool the plan gives no slot (LoRA's gradients: no task takes one) is no pool at all
        budgets = {pool: n for pool, n in {**inner.budgets, **self.budgets}.items() if self.budgets.get(pool) != 0}
        return Proposal(inner.order, budgets, inner.urgency)
