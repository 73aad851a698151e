"""The reference executor, and the async engine checked against it on a numeric toy model.

:class:`ToyModel` does float64 arithmetic on buffers keyed by slot (weights fetched into weight
slots, gradients accumulated in gradient slots, SGD on host weights), so a task run too early, a
slot refilled while still read, or a missing cross-step edge changes the numbers. Both executors
must match the same model computed by plain loops, bit for bit.
"""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import Recorder, ToyModel, check_slots, check_topological, run_async, same_state, specs

from flowtrain.errors import StepFailed
from flowtrain.graph import GRADS, WEIGHTS, Fetch, Forward, StepSpec, compile_steps
from flowtrain.runtime import run_reference

POLICIES = ["sequential", "double_buffer", "lookahead"]



def engine_matches_reference(spec, steps, policy):
    """Run ``steps`` steps on the reference executor and on the engine; both must reach the
    toy's expected state. Returns the graph and the engine's records."""
    graph = compile_steps(spec, steps)
    expected = ToyModel(spec).expected(steps)
    ref = ToyModel(spec)
    run_reference(graph, ref)
    same_state(ref.state(), expected)
    toy = ToyModel(spec)
    records = run_async(graph, toy, policy)
    same_state(toy.state(), expected)
    return graph, records


def test_reference_runs_one_task_at_a_time_in_topological_order():
    graph = compile_steps(StepSpec(layers=3, micro_batches=2, checkpoint_every=2, tied=True), 2)
    rec = Recorder()
    records = run_reference(graph, rec)
    check_topological(graph, rec)
    order = [r.task for r in records]
    assert sorted(order, key=rec.start.__getitem__) == order
    assert all(rec.end[a] < rec.start[b] for a, b in zip(order, order[1:])), "never two at once"
    assert all(a.end <= b.start for a, b in zip(records, records[1:]))
    assert [r.deps for r in records] == [list(graph.predecessors(t)) for t in order]


def test_reference_recycles_slots_as_soon_as_their_readers_ran():
    graph = compile_steps(StepSpec(layers=4, micro_batches=2), 1)
    rec = Recorder()
    run_reference(graph, rec)
    # One task at a time: a weight slot is in use from its fetch to its last reader, and the
    # reference hands out the lowest free index, so it needs as many slots as uses overlap.
    widest = {pool: 1 + max(s for t, s in rec.slot.items() if t.takes == pool) for pool in (WEIGHTS, GRADS)}
    check_slots(graph, rec, widest)


def test_reference_failure_names_the_task_and_stops():
    graph = compile_steps(StepSpec(layers=2), 1)
    bad = Forward(unit="layer", layer=1, micro_batch=0)

    def boom(task, ctx):
        raise ZeroDivisionError("x")

    rec = Recorder({bad: boom})
    with pytest.raises(StepFailed, match="forward L1 m0 failed: ZeroDivisionError: x") as err:
        run_reference(graph, rec)
    assert err.value.task == bad
    assert not rec.ran & nx.descendants(graph, bad)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "spec",
    [
        StepSpec(layers=4, micro_batches=2),
        StepSpec(layers=5, micro_batches=3, checkpoint_every=2, order="micro", tied=True, grad_clip=True),
    ],
    ids=["plain", "everything"],
)
def test_engine_gives_the_reference_numbers(spec, policy):
    graph, records = engine_matches_reference(spec, 2, policy)
    assert {r.task: r.bytes for r in records if isinstance(r.task, Fetch)} == {
        t: 8 * (8 if t.unit == "head" else 4) for t in graph if isinstance(t, Fetch)
    }


def test_the_toy_notices_a_wrong_order():
    """The comparison can fail. Reverse one cross-step edge so that the next step fetches
    layer 1 *before* this step's Adam has updated it::

        cpu_adam L1 s0 -> fetch L1 (forward) s1     becomes     fetch L1 (forward) s1 -> cpu_adam L1 s0
    """
    spec = StepSpec(layers=2, micro_batches=2)
    graph = compile_steps(spec, 2)
    adam = next(t for t in graph if t.kind == "cpu_adam" and t.layer == 1 and t.step == 0)
    fetch = Fetch(unit="layer", layer=1, phase="forward", step=1)
    graph.remove_edge(adam, fetch)
    graph.remove_edge(next(t for t in graph if t.kind == "verify_step" and t.step == 0), fetch)  # after that Adam too
    graph.add_edge(fetch, adam, reads=False)
    toy = ToyModel(spec)
    run_reference(graph, toy)
    with pytest.raises(AssertionError):
        same_state(toy.state(), ToyModel(spec).expected(2))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, steps=st.integers(1, 2), policy=st.sampled_from(POLICIES))
def test_engine_and_reference_agree_on_random_steps(spec, steps, policy):
    engine_matches_reference(spec, steps, policy)
