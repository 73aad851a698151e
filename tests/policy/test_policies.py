"""Policies: the protocol, the registry, the built-ins' plans and the natural order."""

from __future__ import annotations

import networkx as nx
import pytest

from flowtrain.errors import ConfigError, CycleError
from flowtrain.graph import GRADS, WEIGHTS, Forward, StepSpec, compile_step, compile_steps
from flowtrain.policy import (
    POLICIES,
    DoubleBuffer,
    Lookahead,
    Policy,
    Proposal,
    Sequential,
    natural_order,
    register_policy,
    resolve_policy,
)

BUILTINS = {"sequential": Sequential, "double_buffer": DoubleBuffer, "lookahead": Lookahead}


def test_builtins_are_registered_by_name():
    for name, cls in BUILTINS.items():
        assert POLICIES[name] is cls
        policy = resolve_policy(name)
        assert type(policy) is cls and isinstance(policy, Policy) and policy.name == name


@pytest.mark.parametrize(
    "policy, weights, grads",
    [(Sequential(), 1, 1), (DoubleBuffer(), 2, 2), (Lookahead(), 3, 2), (resolve_policy("lookahead", k=5), 5, 2)],
)
def test_builtin_budgets(policy, weights, grads):
    graph = compile_step(StepSpec(layers=3, micro_batches=2))
    proposal = policy.propose(graph)
    assert proposal.budgets == {WEIGHTS: weights, GRADS: grads}
    assert proposal.order == list(graph.nodes)  # the compiler's serial order


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_micro_batch_major_needs_an_accumulator_per_unit(name):
    """Every unit accumulates until the last micro-batch, so fewer accumulators would deadlock."""
    spec = StepSpec(layers=3, micro_batches=2, order="micro")
    graph = compile_steps(spec, 2)
    assert resolve_policy(name).propose(graph).budgets[GRADS] == 3 + 2
    one_mb = compile_step(StepSpec(layers=3, micro_batches=1, order="micro"))
    assert resolve_policy(name).propose(one_mb).budgets[GRADS] <= 2


def test_lookahead_needs_a_slot():
    with pytest.raises(ConfigError, match="k=0"):
        Lookahead(k=0)


def test_unknown_names_and_non_policies_are_config_errors():
    with pytest.raises(ConfigError, match="unknown policy 'fastest'; choose one of: ") as err:
        resolve_policy("fastest")
    assert "double_buffer, lookahead, sequential" in str(err.value)
    with pytest.raises(ConfigError, match="propose"):
        resolve_policy(object())


def test_a_user_class_goes_through_the_same_door():
    @register_policy("test_wide")
    class Wide:
        def __init__(self, slots: int = 4) -> None:
            self.slots = slots

        def propose(self, graph: nx.DiGraph) -> Proposal:
            return Proposal(natural_order(graph), {WEIGHTS: self.slots, GRADS: 2})

    try:
        by_name = resolve_policy("test_wide", slots=6)
        assert isinstance(by_name, Wide) and by_name.slots == 6 and Wide.name == "test_wide"
        obj = Wide()
        assert resolve_policy(obj) is obj
        assert "test_wide" in str(pytest.raises(ConfigError, resolve_policy, "nope").value)
    finally:
        del POLICIES["test_wide"]


def test_natural_order_keeps_insertion_order_when_it_is_topological():
    g = compile_steps(StepSpec(layers=4, micro_batches=3, checkpoint_every=2, tied=True, grad_clip=True), 2)
    assert natural_order(g) == list(g.nodes)


def test_natural_order_stays_close_to_insertion_order_otherwise():
    """Inserted x, y, z with edges z -> x and y -> w (w inserted last): x must wait for z,
    and the earliest-inserted ready task always goes first::

        z -> x        y -> w
    """
    x, y, z, w = (Forward(layer=i, micro_batch=0) for i in range(4))
    g = nx.DiGraph()
    g.add_nodes_from([x, y, z, w])
    g.add_edges_from([(z, x), (y, w)])
    assert natural_order(g) == [y, z, x, w]
    g.add_edge(x, z)
    with pytest.raises(CycleError, match="cycle"):
        natural_order(g)


def test_with_budgets_keeps_the_order_and_replaces_the_budgets():
    from flowtrain.policy import WithBudgets

    g = compile_step(StepSpec(layers=3, micro_batches=2))
    inner = resolve_policy("double_buffer").propose(g)
    wrapped = WithBudgets(resolve_policy("double_buffer"), {"grads": 1}).propose(g)
    assert wrapped.order == inner.order
    assert wrapped.budgets == {**inner.budgets, "grads": 1}
