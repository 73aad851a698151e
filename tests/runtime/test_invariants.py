"""Invariants for random DAGs, random steps and every built-in policy (hypothesis).

- The executed order is topological: every task starts after all its dependencies *finished*
  (sequence numbers stamped at run time, so this is the real order on the lane threads).
- Slot budgets are never exceeded: two uses of one slot index never overlap, from the holder's
  start to its last reader's end, and no index reaches the budget.
- A plan deadlocks exactly when an independent oracle says the budget cannot carry it, and
  then the engine raises :class:`DeadlockError` instead of hanging; one weight slot never
  deadlocks on a compiled graph.
- A failing task fails the step, nothing that depends on it runs, and nothing is left running.
- A plan that is not a topological order is refused with :class:`ScheduleError`.
"""

from __future__ import annotations

import threading

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import Recorder, check_slots, check_topological, lane_order_ok, run_async, slots_suffice, specs

from flowtrain.errors import DeadlockError, ScheduleError, StepFailed
from flowtrain.graph import ACTS, GRADS, KINDS, WEIGHTS, compile_steps
from flowtrain.graph.tasks import HOST_STATE
from flowtrain.policy import Proposal, natural_order, resolve_policy
from flowtrain.runtime import Scheduler

POLICIES = ["sequential", "double_buffer", "lookahead"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Slot takers drawn more often than their share, so budgets are actually contested.
KIND_CHOICES = sorted(KINDS) + ["fetch", "fetch", "fetch", "zero_grad", "zero_grad"]


@st.composite
def random_dags(draw, max_tasks: int = 14) -> nx.DiGraph:
    """Tasks of random kinds (hence lanes and pools), inserted in a random order; edges only go
    from a lower to a higher task number; ``reads`` edges only from slot-taking tasks."""
    n = draw(st.integers(1, max_tasks))
    kinds = [KINDS[draw(st.sampled_from(KIND_CHOICES))] for _ in range(n)]
    # distinct by layer; each kind given what it requires (a unit, a micro-batch)
    tasks = [cls(layer=i, micro_batch=0, **({"unit": "layer"} if cls.scope == "unit" else {}))
             for i, cls in enumerate(kinds)]
    graph = nx.DiGraph()
    graph.add_nodes_from(tasks[i] for i in draw(st.permutations(range(n))))
    density = draw(st.sampled_from([0.1, 0.25, 0.5]))
    for v in range(n):
        for u in range(v):
            if draw(st.floats(0, 1)) < density:
                reads = tasks[u].takes is not None and draw(st.booleans())
                graph.add_edge(tasks[u], tasks[v], reads=reads)
    return graph




run = run_async


def lane_threads():
    return [t for t in threading.enumerate() if t.name.startswith("flowtrain-")]


class Budget:
    def __init__(self, **budgets: int) -> None:
        self.budgets = budgets

    def propose(self, graph):
        return Proposal(natural_order(graph), dict(self.budgets))


@SETTINGS
@given(graph=random_dags(), policy=st.sampled_from(POLICIES))
def test_random_dags_run_in_order_within_budget_or_deadlock_exactly_when_they_must(graph, policy):
    proposal = resolve_policy(policy).propose(graph)
    feasible = slots_suffice(proposal.order, graph, proposal.budgets)
    rec = Recorder()
    if not feasible:
        with pytest.raises(DeadlockError):
            run(graph, rec, policy)
        assert rec.active == 0 and not lane_threads()
        return
    records = run(graph, rec, policy)
    check_topological(graph, rec)
    check_slots(graph, rec, proposal.budgets)
    lane_order_ok(records, proposal.order)


@SETTINGS
@given(spec=specs, steps=st.integers(1, 2), policy=st.sampled_from(POLICIES))
def test_compiled_steps_run_in_order_within_budget(spec, steps, policy):
    """Every built-in policy, ``sequential``'s single weight slot included, carries every
    compiled graph to the end."""
    graph = compile_steps(spec, steps)
    proposal = resolve_policy(policy).propose(graph)
    assert slots_suffice(proposal.order, graph, proposal.budgets)
    rec = Recorder()
    records = run(graph, rec, policy)
    check_topological(graph, rec)
    check_slots(graph, rec, proposal.budgets)
    lane_order_ok(records, proposal.order)


@SETTINGS
@given(spec=specs, steps=st.integers(1, 2))
def test_one_weight_slot_never_deadlocks_a_compiled_graph(spec, steps):
    graph = compile_steps(spec, steps)
    grads = resolve_policy("sequential").propose(graph).budgets[GRADS]
    rec = Recorder()
    run(graph, rec, Budget(weights=1, grads=grads))
    check_slots(graph, rec, {WEIGHTS: 1, GRADS: grads})


@SETTINGS
@given(graph=random_dags(), data=st.data())
def test_a_failing_task_cancels_the_rest_and_leaves_nothing_running(graph, data):
    failing = data.draw(st.sampled_from(sorted(graph, key=lambda t: t.layer)))

    def boom(task, ctx):
        raise OSError("disk full")

    rec = Recorder({failing: boom})
    roomy = {WEIGHTS: len(graph), GRADS: len(graph), ACTS: len(graph), HOST_STATE: len(graph)}  # never short of slots
    with pytest.raises(StepFailed) as err:
        run(graph, rec, Budget(**roomy))
    assert err.value.task == failing and isinstance(err.value.__cause__, OSError)
    assert not rec.ran & nx.descendants(graph, failing)
    assert rec.active == 0 and set(rec.end) == rec.ran and not lane_threads()


@SETTINGS
@given(graph=random_dags(max_tasks=10), data=st.data())
def test_the_scheduler_refuses_exactly_the_non_topological_plans(graph, data):
    order = data.draw(st.permutations(list(graph)))
    position = {t: i for i, t in enumerate(order)}
    topological = all(position[u] < position[v] for u, v in graph.edges)
    sched = Scheduler({WEIGHTS: 2, GRADS: 1, ACTS: 1, HOST_STATE: 1})
    if not topological:
        with pytest.raises(ScheduleError, match="before its dependency"):
            sched.add(order, graph)
        return
    sched.add(order, graph)
    # Drive the pure core to the end, reporting completions oldest first.
    launched, pending = 0, []
    try:
        while launched < len(graph):
            batch = sched.poll()
            launched += len(batch)
            pending += [l.task for l in batch if sched.needs_completion(l.task)]
            if pending:
                sched.complete(pending.pop(0))
    except DeadlockError:
        assert not slots_suffice(order, graph, {WEIGHTS: 2, GRADS: 1, ACTS: 1, HOST_STATE: 1})
    else:
        assert slots_suffice(order, graph, {WEIGHTS: 2, GRADS: 1, ACTS: 1, HOST_STATE: 1})
