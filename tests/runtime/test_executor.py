"""The asyncio engine on CPU lanes: records, instruments, overlap, failure, bad plans, deadlock.

Order is asserted with the sequence numbers a :class:`Recorder` stamps at run time, overlap
with events between fake tasks; timeouts are hang guards only.
"""

from __future__ import annotations

import asyncio
import threading

import networkx as nx
import pytest
import uvloop
from runtime_helpers import HANG_GUARD_S, Budget, Recorder, check_slots, check_topological, guarded, lane_order_ok

from flowtrain.errors import DeadlockError, ScheduleError, SlotError, StepFailed
from flowtrain.graph import (
    GRADS,
    WEIGHTS,
    Backward,
    CpuAdam,
    Fetch,
    Forward,
    OffloadGrad,
    StepSpec,
    VerifyStep,
    compile_step,
    compile_steps,
    cross_step_edges,
)
from flowtrain.policy import Proposal, natural_order, resolve_policy
from flowtrain.runtime import Engine, Instrument, TraceRecorder, chrome_trace, run_graph

POLICIES = ["sequential", "double_buffer", "lookahead"]


def lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("flowtrain-")]


class Events(Instrument):
    def __init__(self) -> None:
        self.launched: list = []
        self.recorded: list = []
        self.errors: list = []
        self.on_error_hook = None

    def on_launch(self, task, lane):
        assert lane == task.lane
        self.launched.append(task)

    def on_record(self, record):
        self.recorded.append(record)

    def on_error(self, task, error):
        self.errors.append((task, error))
        if self.on_error_hook:
            self.on_error_hook()


@pytest.mark.parametrize("policy", POLICIES)
async def test_run_records_every_task_once_in_a_valid_order(policy):
    graph = compile_step(StepSpec(layers=3, micro_batches=2, checkpoint_every=2))
    rec, events, trace = Recorder(), Events(), TraceRecorder()
    proposal = resolve_policy(policy).propose(graph)
    records = await guarded(run_graph(graph, rec, policy, instruments=[events, trace]))
    check_topological(graph, rec)
    check_slots(graph, rec, proposal.budgets)
    assert sorted(events.launched, key=str) == sorted(graph, key=str)
    assert [r.task for r in records] == list(graph) == [r.task for r in trace.records] == [r.task for r in events.recorded]
    for r in records:
        assert r.lane == r.task.lane and 0 <= r.start <= r.end
        assert r.slot == rec.slot[r.task] and r.reads == rec.reads[r.task]
        assert r.deps == list(graph.predecessors(r.task))
        for d in r.deps:  # causal, not a timing bound: a lane starts a job after its fences are set
            assert r.start >= records[list(graph).index(d)].end
    lane_order_ok(records, proposal.order)
    assert not lane_threads()

    doc = chrome_trace(records, meta={"policy": policy})
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(graph)
    assert doc["otherData"]["flowtrain"]["policy"] == policy


async def test_program_return_value_is_the_bytes_moved():
    graph = compile_step(StepSpec(layers=1))
    records = await guarded(run_graph(graph, lambda t, ctx: 100 if isinstance(t, Fetch) else None))
    assert {r.task.kind: r.bytes for r in records}["fetch"] == 100
    assert sum(r.bytes for r in records) == 100 * sum(isinstance(t, Fetch) for t in graph)


@pytest.mark.parametrize("policy", ["double_buffer", "lookahead"])
async def test_double_buffer_overlaps_the_next_fetch_with_compute(policy):
    """Forward of layer i (and backward of layer i) blocks until the fetch of the next layer
    it will need has *started*: that only finishes if the fetch overlaps the compute."""
    L = 4
    graph = compile_step(StepSpec(layers=L, micro_batches=2))
    started = {(p, i): threading.Event() for p in ("forward", "backward") for i in range(L)}
    saw: dict = {}

    def fetch_hook(task, ctx):
        started[(task.phase, task.layer)].set()

    gave_up = threading.Event()  # after one probe times out, the rest fail fast

    def probe(nxt):
        def hook(task, ctx):
            saw[task] = started[nxt].wait(0 if gave_up.is_set() else 10.0)
            if not saw[task]:
                gave_up.set()
        return hook

    hooks = {t: fetch_hook for t in graph if isinstance(t, Fetch) and t.unit == "layer"}
    for i in range(L):
        if i + 1 < L:
            hooks[Forward(unit="layer", layer=i, micro_batch=0)] = probe(("forward", i + 1))
        if i > 0:
            hooks[Backward(unit="layer", layer=i, micro_batch=0)] = probe(("backward", i - 1))
    rec = Recorder(hooks)
    await guarded(run_graph(graph, rec, policy))
    assert len(saw) == 2 * (L - 1) and all(saw.values())
    for i in range(L - 1):
        fwd = Forward(unit="layer", layer=i, micro_batch=0)
        nxt = Fetch(unit="layer", layer=i + 1, phase="forward")
        assert rec.start[nxt] < rec.end[fwd]  # the copy of layer i+1 began before compute of layer i ended


async def test_sequential_fetches_the_next_layer_only_after_the_last_reader():
    """The same probe under ``sequential``: the next fetch never starts while a forward waits
    for it, and starts only after every forward of the layer before has finished."""
    L = 4
    graph = compile_step(StepSpec(layers=L, micro_batches=2))
    started = {i: threading.Event() for i in range(L)}
    saw: dict = {}
    hooks = {t: (lambda t, c: started[t.layer].set()) for t in graph
             if isinstance(t, Fetch) and t.unit == "layer" and t.phase == "forward"}
    for i in range(L - 1):
        hooks[Forward(unit="layer", layer=i, micro_batch=0)] = (
            lambda t, c: saw.__setitem__(t, started[t.layer + 1].wait(0.05))
        )
    rec = Recorder(hooks)
    await guarded(run_graph(graph, rec, "sequential"))
    assert len(saw) == L - 1 and not any(saw.values())
    for i in range(L - 1):
        nxt = Fetch(unit="layer", layer=i + 1, phase="forward")
        assert rec.start[nxt] > max(rec.end[Forward(unit="layer", layer=i, micro_batch=m)] for m in range(2))


async def test_cpu_pool_runs_host_work_concurrently():
    """Two independent Adam steps meet at a barrier: only a pool of two gets them both there."""
    a, b = CpuAdam(unit="layer", layer=0), CpuAdam(unit="layer", layer=1)
    graph = nx.DiGraph()
    graph.add_nodes_from([a, b])

    def meet(barrier):
        return Recorder({a: lambda t, c: barrier.wait(), b: lambda t, c: barrier.wait()})

    await guarded(run_graph(graph, meet(threading.Barrier(2, timeout=HANG_GUARD_S)), cpu_workers=2))
    with pytest.raises(StepFailed) as err:
        await guarded(run_graph(graph, meet(threading.Barrier(2, timeout=0.05)), cpu_workers=1))
    assert isinstance(err.value.__cause__, threading.BrokenBarrierError)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("failing", [Forward(unit="layer", layer=1, micro_batch=0), CpuAdam(unit="layer", layer=2)])
async def test_a_failing_task_fails_the_step_and_nothing_runs_on(policy, failing):
    graph = compile_step(StepSpec(layers=4, micro_batches=2))

    def boom(task, ctx):
        raise ValueError("bad weights")

    rec, events = Recorder({failing: boom}), Events()
    with pytest.raises(StepFailed) as err:
        await guarded(run_graph(graph, rec, policy, instruments=[events]))
    assert err.value.task == failing
    assert str(err.value) == f"task {failing} failed: ValueError: bad weights"
    assert isinstance(err.value.__cause__, ValueError)
    assert events.errors == [(failing, err.value.__cause__)]
    assert failing in rec.ran
    assert not rec.ran & nx.descendants(graph, failing)
    assert rec.active == 0 and set(rec.end) == rec.ran and not lane_threads()


async def test_a_failure_cancels_queued_work_that_does_not_depend_on_it():
    """::

        forward L0 (fails) -> forward L1           d2h lane: offload_grad L0, then offload_grad L1

    The forward fails only once the first copy has started, and that copy is held until the
    engine has seen the failure; the second copy, queued behind it and independent of the
    failing task, must then be skipped. The engine returns only after the held copy finished.
    """
    f0, f1 = Forward(unit="layer", layer=0, micro_batch=0), Forward(unit="layer", layer=1, micro_batch=0)
    y, x = OffloadGrad(unit="layer", layer=0), OffloadGrad(unit="layer", layer=1)
    graph = nx.DiGraph()
    graph.add_nodes_from([f0, f1, y, x])
    graph.add_edge(f0, f1, reads=False)
    copying, seen = threading.Event(), threading.Event()
    events = Events()
    events.on_error_hook = seen.set

    def boom(task, ctx):
        copying.wait(HANG_GUARD_S)
        raise RuntimeError("nan loss")

    def hold(task, ctx):
        copying.set()
        seen.wait(HANG_GUARD_S)

    rec = Recorder({f0: boom, y: hold})
    with pytest.raises(StepFailed, match="forward L0 m0 failed: RuntimeError: nan loss"):
        await guarded(run_graph(graph, rec, instruments=[events]))
    assert rec.ran == {f0, y} and set(rec.end) == {f0, y}
    assert not lane_threads()


@pytest.mark.parametrize(
    "propose, error, match",
    [
        (lambda g: Proposal(list(reversed(natural_order(g))), {WEIGHTS: 2, GRADS: 2}), ScheduleError, "before its dependency"),
        (lambda g: Proposal(natural_order(g)[1:], {WEIGHTS: 2, GRADS: 2}), ScheduleError, "exactly once"),
        (lambda g: Proposal(natural_order(g), {WEIGHTS: 2}), SlotError, "pool 'grads', which has no budget"),
        (lambda g: Proposal(natural_order(g), {WEIGHTS: 0, GRADS: 1}), SlotError, "at least 1"),
    ],
)
async def test_a_user_policy_with_a_bad_plan_is_refused_before_anything_runs(propose, error, match):
    class Bad:
        pass

    Bad.propose = staticmethod(propose)
    rec = Recorder()
    with pytest.raises(error, match=match):
        await guarded(run_graph(compile_step(StepSpec(layers=2)), rec, Bad()))
    assert not rec.ran and not lane_threads()


@pytest.mark.parametrize(
    "graph, budgets",
    [
        # micro-batch-major: every unit accumulates until the last micro-batch
        (compile_step(StepSpec(layers=2, micro_batches=2, order="micro")), {WEIGHTS: 2, GRADS: 1}),
        # fetch L0 ==> forward L0 m0 <== fetch L1: one task reads two weight slots
        (nx.DiGraph([(Fetch(unit="layer", layer=0), Forward(layer=0, micro_batch=0), {"reads": True}),
                     (Fetch(unit="layer", layer=1), Forward(layer=0, micro_batch=0), {"reads": True})]), {WEIGHTS: 1}),
    ],
    ids=["micro-one-accumulator", "two-slot-reader"],
)
async def test_a_too_small_budget_is_a_deadlock_error_not_a_hang(graph, budgets):
    rec = Recorder()
    with pytest.raises(DeadlockError, match="no task can start"):
        await guarded(run_graph(graph, rec, Budget(**budgets)))
    assert rec.active == 0 and not lane_threads()


async def test_steps_overlap_through_cross_step_edges():
    spec = StepSpec(layers=3, micro_batches=2)
    step0, step1 = compile_step(spec, 0), compile_step(spec, 1)
    edges = cross_step_edges(step0, step1, spec)
    rec = Recorder()
    async with Engine(rec, "double_buffer") as engine:
        engine.add(step0)
        engine.add(step1, after=edges)
        first = await guarded(engine.wait(step0))
        second = await guarded(engine.wait(step1))
    both = nx.compose(step0, step1)
    check_topological(both, rec, extra_edges=edges)
    check_slots(both, rec, {WEIGHTS: 2, GRADS: 2})
    assert [r.task for r in first] == list(step0) and [r.task for r in second] == list(step1)
    by_task = {r.task: r for r in second}
    assert set(by_task[Fetch(unit="layer", layer=2, phase="forward", step=1)].deps) == {
        CpuAdam(unit="layer", layer=2, step=0), VerifyStep(step=0)
    }


async def test_a_long_run_keeps_no_bookkeeping_of_finished_steps():
    """Step after step, as the trainer feeds them (the next added before this one is waited
    for): once a step is waited for, the engine holds nothing of it, and later steps that wait
    on its tasks (cross-step edges, slot fences) still run in a valid order."""
    spec = StepSpec(layers=2, micro_batches=2, staged=True)
    rec = Recorder()
    graphs = [compile_step(spec, s) for s in range(5)]
    async with Engine(rec, "double_buffer") as engine:
        engine.add(graphs[0])
        for s in range(1, 5):
            engine.add(graphs[s], after=cross_step_edges(graphs[s - 1], graphs[s], spec))
            await guarded(engine.wait(graphs[s - 1]))
            assert len(engine._fences) <= graphs[s].number_of_nodes()
        await guarded(engine.wait(graphs[4]))
        assert not engine._fences and not engine._launches
    edges = [e for s in range(1, 5) for e in cross_step_edges(graphs[s - 1], graphs[s], spec)]
    check_topological(nx.compose_all(graphs), rec, extra_edges=edges)


async def test_budgets_may_not_change_between_graphs():
    class Growing:
        calls = 0

        def propose(self, graph):
            self.calls += 1
            return Proposal(natural_order(graph), {WEIGHTS: self.calls, GRADS: 1})

    spec = StepSpec(layers=1)
    async with Engine(Recorder(), Growing()) as engine:
        engine.add(compile_step(spec, 0))
        with pytest.raises(ScheduleError, match="slot budgets changed"):
            engine.add(compile_step(spec, 1))
        await guarded(engine.wait(compile_step(spec, 0)))


async def test_task_context_read_wants_exactly_one_slot():
    graph = nx.DiGraph([(Fetch(unit="layer", layer=0), Forward(layer=0, micro_batch=0), {"reads": True}),
                        (Fetch(unit="layer", layer=1), Forward(layer=0, micro_batch=0), {"reads": True})])

    def program(task, ctx):
        if isinstance(task, Forward):
            assert sorted(ctx.reads[WEIGHTS]) == [0, 1]
            ctx.read(WEIGHTS)

    with pytest.raises(StepFailed, match="reads 2 slots of 'weights', expected one"):
        await guarded(run_graph(graph, program, Budget(weights=2)))


def test_runs_under_uvloop():
    graph = compile_steps(StepSpec(layers=2, micro_batches=2, tied=True), 2)
    rec = Recorder()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(guarded(run_graph(graph, rec, "lookahead")))
    check_topological(graph, rec)
    check_slots(graph, rec, resolve_policy("lookahead").propose(graph).budgets)


async def test_after_a_failure_the_engine_still_says_which_graphs_finished_whole():
    """Step 1 starts only once every task of step 0 has finished, and its first task fails: the
    engine then raises from any wait, but says step 0 finished and step 1 did not (the training
    loop completes a finished step's checkpoint so)."""
    spec = StepSpec(layers=2, micro_batches=2)
    step0, step1 = compile_step(spec, 0), compile_step(spec, 1)
    sources = [t for t in step1 if step1.in_degree(t) == 0]
    after = [(t, s) for t in step0 for s in sources]

    def boom(task, ctx):
        raise RuntimeError("out of memory")

    rec = Recorder({sources[0]: boom})
    with pytest.raises(StepFailed, match="out of memory"):
        async with Engine(rec, "double_buffer") as engine:
            engine.add(step0)
            engine.add(step1, after=after)
            await guarded(engine.wait(step1))
    assert engine.finished(step0) and set(step0) <= rec.ran
    assert not engine.finished(step1)
