"""The virtual clock runs the real scheduler: exact times on a small DAG, the engine's order and
slots for the same durations, and the engine's rules (dependencies, lanes, slot budgets) on
random durations for every policy."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from flowtrain.graph import StepSpec, compile_step
from flowtrain.policy import POLICIES, resolve_policy
from flowtrain.runtime import run_graph
from flowtrain.sim import VirtualRun
from flowtrain.sim.costs import CostModel, Shape
from flowtrain.sim.machine import load_machine
from flowtrain.sim.predict import predict_shape


def by_label(records):
    return {r.task.label: r for r in records}


def test_fences_and_slots_give_exact_times():
    """One layer, one micro-batch, sequential policy (one weight slot), every task 1 s::

        fetch embed ==> embed -> forward L0 -> loss -> backward L0 -> embed_backward
        fetch L0 (fwd) ==> forward L0     fetch head ==> loss     fetch L0 (bwd) ==> backward L0

    embed is launched with fetch embed (a fence, not a host wait) and frees the only weight
    slot at launch; fetch L0 (fwd) then waits on its lane for embed to end (t=2) and runs
    [2, 3); forward L0 waits for it: [3, 4). The head's fetch waits for forward L0: [4, 5), and
    the loss for it: [5, 6).
    """
    graph = compile_step(StepSpec(layers=1, micro_batches=1))
    recs = by_label(VirtualRun(lambda t: 1.0, "sequential", sync_us=0).run(graph))
    spans = {k: (recs[k].start, recs[k].end) for k in
             ("fetch embed (forward)", "embed m0", "fetch L0 (forward)", "forward L0 m0", "fetch head (forward)", "loss head m0")}
    assert spans == {"fetch embed (forward)": (0, 1), "embed m0": (1, 2), "fetch L0 (forward)": (2, 3),
                     "forward L0 m0": (3, 4), "fetch head (forward)": (4, 5), "loss head m0": (5, 6)}
    assert {r.slot for r in recs.values() if r.task.kind == "fetch"} == {0}


def test_a_host_completion_costs_the_sync_latency():
    """cpu_adam waits for its offload's *completion*, reported sync_us after it ends."""
    graph = compile_step(StepSpec(layers=1, micro_batches=1))
    recs = by_label(VirtualRun(lambda t: 1.0, "double_buffer", sync_us=250_000).run(graph))
    off, adam = recs["offload_grad L0"], recs["cpu_adam L0"]
    assert adam.start == pytest.approx(off.end + 0.25)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_rules_hold_for_random_durations(policy):
    spec = StepSpec(layers=5, micro_batches=3, checkpoint_every=2, resident=("layer.1",), staged=True,
                    grad_chunks={"embed": 2})
    rng = random.Random(policy)
    dur = {}
    sim = VirtualRun(lambda t: dur.setdefault(t, rng.uniform(0.1, 2.0)), policy, cpu_workers=2, sync_us=1000)
    steps = sim.run_steps(spec, steps=3)
    records = [r for recs in steps for r in recs]
    at = {r.task: r for r in records}
    assert len(at) == sum(len(s) for s in steps) == 3 * compile_step(spec).number_of_nodes()
    for r in records:
        assert r.end - r.start == pytest.approx(dur[r.task])
        for d in r.deps:  # every dependency ended first (a fence is waited for on the lane)
            assert at[d].end <= r.start + 1e-12, (d, r.task)
    for lane, width in (("h2d", 1), ("compute", 1), ("d2h", 1), ("cpu", 2)):
        assert _max_overlap([(r.start, r.end) for r in records if r.lane == lane]) <= width
    budgets = sim.budgets
    for pool, n in budgets.items():  # a slot is held from its taker's start to its last reader's end
        spans = []
        for r in records:
            if r.task.takes == pool:
                readers = [x for x in records if r.task in x.deps and pool in x.reads and r.slot in x.reads[pool]]
                spans.append((r.start, max([x.end for x in readers] + [r.end])))
        assert _max_overlap(spans) <= n, pool


class _LinkCosts:
    """Random task times; a copy takes ``alone`` seconds while the other direction is idle and
    twice that while it copies too."""

    def __init__(self, seed):
        self.rng, self.alone, self.other = random.Random(seed), {}, {}

    def seconds(self, task):
        return self.other.setdefault(task, self.rng.uniform(0.1, 2.0))

    def copy_seconds(self, task, other_direction_busy):
        alone = self.alone.setdefault(task, self.rng.uniform(0.5, 3.0))
        return 2 * alone if other_direction_busy else alone


@pytest.mark.parametrize("policy", ["double_buffer", "lookahead"])
def test_a_copy_is_slowed_only_while_the_other_direction_copies(policy):
    """The two directions share the link: over each copy's span, the time it ran beside a copy
    the other way counts at half its progress and the rest at full, and the whole adds up to
    exactly one copy; some copies here are overlapped for part of their time only."""
    spec = StepSpec(layers=5, micro_batches=3, checkpoint_every=2, staged=True)
    costs = _LinkCosts(policy)
    records = [r for recs in VirtualRun(costs, policy, sync_us=100).run_steps(spec, steps=3) for r in recs]
    spans = {lane: [(r.start, r.end) for r in records if r.lane == lane] for lane in ("h2d", "d2h")}
    partly = 0
    for r in (r for r in records if r.lane in spans):
        other = spans["d2h" if r.lane == "h2d" else "h2d"]
        shared = sum(max(0.0, min(r.end, b) - max(r.start, a)) for a, b in other)
        alone = costs.alone[r.task]
        assert shared / (2 * alone) + (r.end - r.start - shared) / alone == pytest.approx(1.0), r.task
        partly += 1e-9 < shared < r.end - r.start - 1e-9
    assert partly >= 5


def _max_overlap(spans):
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


@pytest.mark.parametrize("micro_batches, adam", [(2, 5), (1, 12)], ids=["adam-keeps-up", "adam-falls-behind"])
def test_same_order_and_slots_as_the_engine(micro_batches, adam):
    """The CPU executor, each task sleeping its duration, against the simulator with the same
    durations: every lane runs the same tasks in the same order with the same slots, and what
    the simulator starts clearly earlier than another task the engine starts earlier too. Where
    Adam is slower than backward, gradients queue and both run the waiting ``cpu_adam`` tasks
    bottom layer first, not in arrival order."""
    spec = StepSpec(layers=3, micro_batches=micro_batches, staged=True)
    graph = compile_step(spec)
    unit = 0.02

    def seconds(task):
        return unit * {"forward": 2, "backward": 4, "loss": 3, "fetch": 3, "offload_grad": 2, "cpu_adam": adam}.get(task.kind, 0.5)

    def program(task, ctx):
        time.sleep(seconds(task))

    engine = asyncio.run(run_graph(graph, program, "double_buffer"))
    sim = VirtualRun(seconds, "double_buffer", sync_us=0).run(graph)
    for lane in ("h2d", "compute", "d2h", "cpu"):
        ran = [(r.task, r.slot) for r in sorted(engine, key=lambda r: r.start) if r.lane == lane]
        simulated = [(r.task, r.slot) for r in sorted(sim, key=lambda r: r.start) if r.lane == lane]
        assert ran == simulated, lane
    adams = [r.task for r in sorted(sim, key=lambda r: r.start) if r.task.kind == "cpu_adam"]
    arrivals = [r.task for r in sorted(sim, key=lambda r: r.end) if r.task.kind == "offload_grad"]
    assert ([(a.unit, a.layer) for a in adams] == [(o.unit, o.layer) for o in arrivals]) == (adam < 4 * micro_batches)
    s_at, e_at = {r.task: r.start for r in sim}, {r.task: r.start for r in engine}
    for a in s_at:  # across lanes: what the simulator starts clearly earlier, the engine did too
        for b in s_at:
            if s_at[b] - s_at[a] > 2 * unit:
                assert e_at[a] < e_at[b], (a, b)


def test_hundred_layers_sixteen_micro_batches_jump_from_event_to_event(monkeypatch):
    """Three steps of 100 layers x 16 micro-batches (11,000 tasks; 0.6-0.9 s on a 2-core
    machine, docs/simulate.md). Counted instead of timed: the clock jumps from one event to
    the next, so the scheduler is asked at most once per event (a task's end, its completion
    report, a step added), never once per tick of time."""
    from flowtrain.runtime.scheduler import Scheduler

    polls = []
    real_poll = Scheduler.poll
    monkeypatch.setattr(Scheduler, "poll", lambda self: polls.append(1) or real_poll(self))
    machine = load_machine("h200")
    shape = Shape(hidden=8192, intermediate=28672, layers=100, heads=64, kv_heads=8, head_dim=128, vocab=128256,
                  seq_len=4096, micro_batch_size=1, layer_numel=855_654_400,
                  numel={"embed": 1_050_673_152, "head": 1_050_681_344})
    spec = StepSpec(layers=100, micro_batches=16, staged=True, grad_chunks={"embed": 3, "head": 3})
    policy = resolve_policy("double_buffer")
    plan = SimpleNamespace(spec=spec, budgets=policy.propose(compile_step(spec)).budgets)
    pred = predict_shape(shape, plan, machine, batch_size=16, steps=3)
    tasks = sum(len(r) for r in pred.records)
    assert tasks > 3 * 100 * 16 * 2
    assert 0 < len(polls) <= 2 * tasks + 3, (len(polls), tasks)
    assert pred.summary.step_seconds > 0 and 0 < pred.summary.busy_fraction["compute"] <= 1.0


def test_predicted_step_is_the_slowest_lanes_work_when_it_is_saturated():
    """With copies free and CPU Adam instant, a long step is its compute work (no idle)."""
    spec = StepSpec(layers=4, micro_batches=4)
    sim = VirtualRun(lambda t: 1.0 if t.lane == "compute" else 1e-6, "double_buffer", sync_us=0)
    steps = sim.run_steps(spec, steps=4)
    compute = sum(1 for r in steps[2] if r.lane == "compute")
    ends = [max(r.end for r in s) for s in steps]
    assert ends[3] - ends[2] == pytest.approx(compute, rel=0.02)
    assert CostModel  # the cost model is a separate module; see test_costs.py
