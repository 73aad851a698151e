"""The engine's memory stays flat over a long run: a step's bookkeeping is released at its end.

A fine-tuning run adds one graph per step for days. Whatever the scheduler and the executor
keep per task must go once the step is waited for, or the process grows by the size of a
step's graph every step. Two views of the same promise:

- the engine, run for 2,000 steps of a one-layer graph with a no-op program, holds no more
  scheduler nodes, fences, launches or records after 2,000 steps than after 200;
- the scheduler, driven by hand, drops a node whose completion arrives *after* the caller
  forgot it (the engine's ``wait`` sees a task's fence set before its completion has reached
  the loop), and a finished node never keeps a later step's nodes alive through its links.

Objects are counted, never timed.
"""

from __future__ import annotations

import asyncio
import gc

from flowtrain.graph import StepSpec, compile_step, cross_step_edges
from flowtrain.policy import natural_order
from flowtrain.runtime import Engine, Scheduler
from flowtrain.runtime.scheduler import _Node

SPEC = StepSpec(layers=1, micro_batches=1)


def _live_nodes() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is _Node)  # type(): isinstance asks __class__, which some lazy objects warn about


def _noop(task, ctx) -> int:
    return 0


def test_the_engine_holds_no_more_state_after_2000_steps_than_after_200():
    counts: dict[int, tuple[int, ...]] = {}

    async def main() -> None:
        engine = Engine(_noop, "double_buffer")
        async with engine:
            prev = None
            for s in range(2001):
                graph = compile_step(SPEC, s)
                engine.add(graph, cross_step_edges(prev, graph, SPEC) if prev is not None else ())
                if prev is not None:
                    await engine.wait(prev)  # two steps in flight, as the trainer runs them
                prev = graph
                if s in (200, 2000):
                    sched = engine.scheduler
                    counts[s] = (len(sched.nodes), _live_nodes(), len(engine._fences),
                                 len(engine._launches), len(engine._graph_preds))
            await engine.wait(prev)

    asyncio.run(main())
    # Lane threads finish tasks while we count, so a count may differ by a task or two between
    # two moments; what can never be exceeded is two steps in flight. Before the fix the
    # scheduler alone held ~0.5 node per step run (about 1,000 here) and pinned every step's.
    in_flight = 2 * compile_step(SPEC, 0).number_of_nodes()
    names = ("scheduler nodes", "live _Node objects", "fences", "launches", "graph preds")
    for name, early, late in zip(names, counts[200], counts[2000]):
        assert late <= max(early, in_flight), f"{name}: {early} after 200 steps, {late} after 2,000"


def _drive(steps: int) -> Scheduler:
    """Run ``steps`` steps through a bare scheduler, two in flight as in the trainer, and let
    each step's last completion arrive only after the step was forgotten: the order in which
    the engine may see them (a fence set, ``wait`` returns and forgets, then the completion)."""
    sched = Scheduler({"weights": 2, "grads": 2, "host_grads": 2}, workers={"cpu": 1})
    pending: list = []  # launched tasks whose completion the host reports, in launch order
    prev = None
    for s in range(steps):
        graph = compile_step(SPEC, s)
        sched.add(natural_order(graph), graph, cross_step_edges(prev, graph, SPEC) if prev is not None else ())
        if prev is None:
            prev = graph
            continue
        host = [t for t in prev if sched.needs_completion(t)]  # final once the next step is added
        while True:
            pending += [launch.task for launch in sched.poll() if sched.needs_completion(launch.task)]
            left = [t for t in host if not sched.nodes[t].done]
            if len(left) == 1 and sched.nodes[left[0]].launched:
                break  # hold this one back
            task = next(t for t in pending if t not in left or len(left) > 1)
            sched.complete(task)
            pending.remove(task)
        sched.forget(prev)
        sched.complete(left[0])  # the completion that was on its way
        pending.remove(left[0])
        prev = graph
    return sched


def test_a_completion_after_forget_still_drops_the_node():
    step = compile_step(SPEC, 0).number_of_nodes()
    sched = _drive(300)
    assert len(sched.nodes) <= 2 * step


def test_finished_nodes_do_not_keep_later_steps_alive():
    step = compile_step(SPEC, 0).number_of_nodes()
    sched = _drive(300)
    # At most the two steps in flight exist; a forgotten node must not be reachable any more.
    assert _live_nodes() <= len(sched.nodes) <= 2 * step
