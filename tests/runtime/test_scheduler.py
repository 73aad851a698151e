"""The scheduler's pure core, driven synchronously: feed events, assert the exact instructions.

``==>`` in the drawings is an edge whose consumer reads the producer's slot; ``->`` a plain
data dependency.
"""

from __future__ import annotations

import networkx as nx
import pytest

from flowtrain.errors import DeadlockError, ScheduleError, SlotError
from flowtrain.graph import (
    GRADS,
    WEIGHTS,
    Backward,
    CpuAdam,
    Fetch,
    Forward,
    GradNorm,
    OffloadGrad,
    StepSpec,
    ZeroGrad,
    compile_step,
)
from flowtrain.policy import resolve_policy
from flowtrain.runtime import Launch, Scheduler


def dag(*edges, nodes=()):
    """A graph from ``(u, v)`` (plain) and ``(u, v, True)`` (reads) edges, nodes in first-seen order."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    for u, v, *reads in edges:
        g.add_node(u)
        g.add_node(v)
        g.add_edge(u, v, reads=bool(reads and reads[0]))
    return g


def launched(launches):
    return [l.task for l in launches]


F0, F1, F2 = (Fetch(unit="layer", layer=i, phase="forward") for i in range(3))
A0, A1 = Forward(unit="layer", layer=0, micro_batch=0), Forward(unit="layer", layer=1, micro_batch=0)


def two_layers():
    """::

        fetch L0 ==> forward L0 m0 -> forward L1 m0
        fetch L1 ==> forward L1 m0
    """
    return dag((F0, A0, True), (A0, A1), (F1, A1, True), nodes=[F0, A0, F1, A1])


def test_one_slot_is_reused_and_fenced_by_its_last_reader():
    g = two_layers()
    s = Scheduler({WEIGHTS: 1})
    s.add([F0, A0, F1, A1], g)
    out = s.poll()
    # The forward that reads slot 0 is launched, so the slot is released at once: the next
    # fetch may be issued, but its lane must wait for that forward's fence.
    assert out == [
        Launch(F0, 0, {}, ()),
        Launch(A0, None, {WEIGHTS: [0]}, (F0,)),
        Launch(F1, 0, {}, (A0,)),
        Launch(A1, None, {WEIGHTS: [0]}, out[3].waits),
    ]
    assert set(out[3].waits) == {A0, F1}
    assert s.finished_launching
    assert not any(s.needs_completion(t) for t in g)
    assert s.poll() == []  # nothing left, and no deadlock either


def test_slot_is_held_until_every_reader_is_launched():
    """::

        fetch L0 ==> forward L0 m0
        fetch L0 ==> forward L0 m1          fetch L1 (next taker of the only slot)
    """
    m0, m1 = A0, Forward(unit="layer", layer=0, micro_batch=1)
    g = dag((F0, m0, True), (F0, m1, True), nodes=[F0, m0, m1, F1])
    s = Scheduler({WEIGHTS: 1})
    # Plan the second reader after the next fetch: that fetch must not overtake it.
    s.add([F0, m0, F1, m1], g)
    out = s.poll()
    assert launched(out) == [F0, m0, m1, F1]
    assert out[3] == Launch(F1, 0, {}, (m0, m1))


def test_two_slots_let_the_next_fetch_run_ahead():
    g = dag((F0, A0, True), (A0, A1), (F1, A1, True), nodes=[F0, A0, F1, A1, F2])
    s = Scheduler({WEIGHTS: 2})
    s.add([F0, A0, F1, A1, F2], g)
    out = s.poll()
    by_task = {l.task: l for l in out}
    assert [by_task[t].slot for t in (F0, F1, F2)] == [0, 1, 0]
    assert by_task[F1].waits == ()  # slot 1 was never used: no fence
    assert by_task[F2].waits == (A0,)  # slot 0's last reader


def test_a_slot_nobody_reads_is_free_at_once_and_fenced_by_its_holder():
    s = Scheduler({WEIGHTS: 1})
    s.add([F0, F1], dag(nodes=[F0, F1]))
    assert s.poll() == [Launch(F0, 0, {}, ()), Launch(F1, 0, {}, (F0,))]


def test_pool_hands_out_slots_in_plan_order():
    s = Scheduler({WEIGHTS: 1})
    s.add([F1, F0], dag(nodes=[F0, F1]))
    assert launched(s.poll()) == [F1, F0]


def test_host_lane_waits_for_completion_then_next_step_fetch_for_adam():
    """::

        fetch L0 =====> backward L0 m0 -> offload_grad L0 -> cpu_adam L0 -> (next step) fetch L0
        zero_grad L0 => backward L0 m0
        zero_grad L0 ===================> offload_grad L0
    """
    fetch, zero = Fetch(unit="layer", layer=0, phase="backward"), ZeroGrad(unit="layer", layer=0)
    bwd = Backward(unit="layer", layer=0, micro_batch=0)
    off, adam = OffloadGrad(unit="layer", layer=0), CpuAdam(unit="layer", layer=0)
    g = dag((fetch, bwd, True), (zero, bwd, True), (zero, off, True), (bwd, off), (off, adam),
            nodes=[fetch, zero, bwd, off, adam])
    s = Scheduler({WEIGHTS: 1, GRADS: 1})
    s.add([fetch, zero, bwd, off, adam], g)
    out = s.poll()
    assert launched(out) == [fetch, zero, bwd, off]
    assert out[2].reads == {WEIGHTS: [0], GRADS: [0]}
    assert set(out[2].waits) == {fetch, zero}
    assert out[3].reads == {GRADS: [0]} and set(out[3].waits) == {zero, bwd}
    # The d2h copy feeds the CPU: the host must see it finish. Device-only work need not report.
    assert s.needs_completion(off) and s.needs_completion(adam)
    assert not any(s.needs_completion(t) for t in (fetch, zero, bwd))
    assert s.poll() == []  # waiting for the copy: not a deadlock, something is running
    s.complete(off)
    assert s.poll() == [Launch(adam, None, {}, ())]

    nxt = Fetch(unit="layer", layer=0, phase="forward", step=1)
    s.add([nxt], dag(nodes=[nxt]), extra_edges=[(adam, nxt)])
    assert s.poll() == []  # the next step's fetch waits for this step's Adam on the host
    s.complete(adam)
    assert s.poll() == [Launch(nxt, 0, {}, (bwd,))]  # slot 0's last reader was the backward


def test_too_small_budget_is_a_deadlock_naming_the_stuck_tasks():
    """::

        fetch L0 ==> forward L0 m0 <== fetch L1      (one task reads two weight slots)

    The deadlock is reported by the very poll that launched ``fetch L0``: nothing is left that
    the host waits for, so no later event could unblock the rest (an engine would hang).
    """
    g = dag((F0, A0, True), (F1, A0, True), nodes=[F0, F1, A0])
    s = Scheduler({WEIGHTS: 1})
    s.add([F0, F1, A0], g)
    with pytest.raises(DeadlockError) as err:
        s.poll()
    msg = str(err.value)
    assert "fetch L1 (forward) (needs a weights slot)" in msg
    assert "forward L0 m0 (1 dependencies unmet)" in msg
    assert "<Slots weights 1/1, 1 waiting>" in msg

    ok = Scheduler({WEIGHTS: 2})
    ok.add([F0, F1, A0], g)
    out = ok.poll()
    assert out[-1] == Launch(A0, None, {WEIGHTS: [0, 1]}, out[-1].waits)


def test_pool_repr_counts_held_slots_and_waiting_takers():
    """::

        fetch L0 ==> forward L0 m0 <== fetch L1        fetch L2 (a third taker)
        grad_norm (cpu) -> forward L0 m0
    """
    norm = GradNorm()
    g = dag((F0, A0, True), (F1, A0, True), (norm, A0), nodes=[F0, F1, F2, norm, A0])
    s = Scheduler({WEIGHTS: 2})
    s.add([F0, F1, F2, norm, A0], g)
    pool = s.pools[WEIGHTS]
    assert repr(pool) == "<Slots weights 0/2, 3 waiting>"
    assert launched(s.poll()) == [F0, F1, norm]
    assert repr(pool) == "<Slots weights 2/2, 1 waiting>"
    s.complete(norm)
    assert launched(s.poll()) == [A0, F2]  # the forward frees both slots; F2 takes one
    assert repr(pool) == "<Slots weights 0/2, 0 waiting>"


@pytest.mark.parametrize(
    "order, match",
    [
        ([A0, F0, F1, A1], "runs forward L0 m0 before its dependency fetch L0"),
        ([F0, A0, F1], "exactly once"),
        ([F0, A0, F1, A1, F2], "exactly once"),
    ],
)
def test_bad_orders_are_schedule_errors(order, match):
    with pytest.raises(ScheduleError, match=match):
        Scheduler({WEIGHTS: 1}).add(order, two_layers())


def test_graph_errors():
    with pytest.raises(SlotError, match="at least 1"):
        Scheduler({WEIGHTS: 0})
    with pytest.raises(SlotError, match="pool 'weights', which has no budget"):
        Scheduler({GRADS: 1}).add([F0, A0, F1, A1], two_layers())
    with pytest.raises(SlotError, match="whose kind takes none"):
        Scheduler({WEIGHTS: 1}).add([A0, A1], dag((A0, A1, True)))
    s = Scheduler({WEIGHTS: 1})
    s.add([F0], dag(nodes=[F0]))
    with pytest.raises(ScheduleError, match="already added"):
        s.add([F0], dag(nodes=[F0]))
    with pytest.raises(ScheduleError, match="never added"):
        s.add([A1], dag(nodes=[A1]), extra_edges=[(A0, A1)])
    with pytest.raises(ScheduleError, match="not running"):
        s.complete(F0)


def test_cycle_is_rejected():
    g = dag((A0, A1), (A1, A0))
    with pytest.raises(ScheduleError):
        Scheduler({WEIGHTS: 1}).add([A0, A1], g)


@pytest.mark.parametrize("policy", ["sequential", "double_buffer", "lookahead"])
@pytest.mark.parametrize("order", ["layer", "micro"])
def test_compiled_step_runs_to_the_end_under_the_rules(policy, order):
    """Drive the core alone over a whole compiled step, completing host-visible tasks one at a
    time, and check every instruction against the rules in the module docstring."""
    graph = compile_step(StepSpec(layers=3, micro_batches=2, checkpoint_every=2, order=order))
    proposal = resolve_policy(policy).propose(graph)
    s = Scheduler(dict(proposal.budgets))
    s.add(proposal.order, graph)
    position = {t: i for i, t in enumerate(proposal.order)}
    launched_at: dict = {}
    completed: set = set()
    held: dict = {}  # (pool, slot) -> holder
    readers_left = {t: sum(1 for _, _, r in graph.out_edges(t, data="reads") if r) for t in graph}
    pending = []
    while len(launched_at) < len(graph):
        batch = s.poll()
        assert batch or pending, "no progress without a completion to wait for"
        for launch in batch:
            t = launch.task
            for p in graph.predecessors(t):
                assert p in launched_at
                if "cpu" in (p.lane, t.lane):
                    assert p in completed, f"{t} launched before the host saw {p} finish"
            if t.takes is not None:
                assert 0 <= launch.slot < proposal.budgets[t.takes]
                assert (t.takes, launch.slot) not in held, f"{t} got a slot still in use"
                held[(t.takes, launch.slot)] = t
            for h in (p for p, _, r in graph.in_edges(t, data="reads") if r):
                assert launch.reads[h.takes].count(launched_at[h].slot) == 1
                readers_left[h] -= 1
                if readers_left[h] == 0:
                    del held[(h.takes, launched_at[h].slot)]
            if t.takes is not None and readers_left[t] == 0:
                del held[(t.takes, launch.slot)]
            launched_at[t] = launch
            if s.needs_completion(t):
                pending.append(t)
        if pending:  # the host sees one task finish per round, oldest first
            t = pending.pop(0)
            s.complete(t)
            completed.add(t)
    for lane in ("h2d", "compute", "d2h", "cpu"):
        seq = [t for t in launched_at if t.lane == lane]
        assert seq == sorted(seq, key=position.__getitem__), f"{lane} lane issued out of plan order"


O2, O1 = (OffloadGrad(unit="layer", layer=i) for i in (2, 1))
U2, U1, U0 = (CpuAdam(unit="layer", layer=i) for i in (2, 1, 0))
NORM = GradNorm()


def queued_adams():
    """::

        offload L2 -> cpu_adam L2
        offload L1 -> cpu_adam L1
                      grad_norm (a barrier: no urgency) -> cpu_adam L0
    """
    return dag((O2, U2), (O1, U1), (NORM, U0), nodes=[O2, O1, U2, U1, NORM, U0])


def test_a_free_cpu_worker_takes_the_most_urgent_ready_task():
    s = Scheduler({}, workers={"cpu": 1})
    s.add([O2, O1, U2, U1, NORM, U0], queued_adams(), urgency={U2: 2, U1: 1, U0: 0})
    assert launched(s.poll()) == [O2, O1]
    s.complete(O2)
    s.complete(O1)
    assert launched(s.poll()) == [U1]  # both ready: the lower urgency first, out of plan order
    assert s.poll() == []  # the one worker is busy until the host sees it finish
    s.complete(U1)
    # then the rest in plan order: the barrier queues behind L2 on the lane, and L0, though
    # most urgent, never overtook it (nor is it launched before a worker is free again)
    assert launched(s.poll()) == [U2, NORM]
    s.complete(U2)
    assert s.poll() == []
    s.complete(NORM)
    assert launched(s.poll()) == [U0]


def test_urgency_is_ignored_where_the_lane_has_no_worker_count():
    s = Scheduler({})
    s.add([O2, O1, U2, U1, NORM, U0], queued_adams(), urgency={U2: 2, U1: 1, U0: 0})
    s.poll()
    s.complete(O2)
    s.complete(O1)
    assert launched(s.poll()) == [U2, U1, NORM]  # plan order, as many at once as are ready


def test_the_built_in_overlapping_policies_rank_adam_by_where_the_next_step_reads_it():
    graph = compile_step(StepSpec(layers=3, micro_batches=1, staged=True, grad_chunks={"embed": 2}))
    for name in ("double_buffer", "lookahead"):
        urgency = resolve_policy(name).propose(graph).urgency
        ranked = sorted(urgency, key=urgency.__getitem__)
        assert [(t.unit, t.layer) for t in ranked] == [("embed", None)] * 2 + [("layer", i) for i in range(3)] + [("head", None)]
    assert resolve_policy("sequential").propose(graph).urgency == {}
