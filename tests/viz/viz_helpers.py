"""Helpers for the visualizer tests: hand-made traces and real ones from the engine."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from flowtrain.graph import StepSpec, compile_steps
from flowtrain.runtime import TraceRecorder, run_graph, write_chrome_trace
from flowtrain.viz.load import Trace, trace_from_json

LANE_TID = {"compute": 0, "h2d": 100, "d2h": 200, "cpu:0": 300, "cpu:1": 301}


def ev(name: str, lane: str, start: float, end: float, *, kind: str | None = None, takes: str | None = None,
       slot: int | None = None, reads: dict | None = None, deps: tuple[str, ...] = (), step: int = 0,
       nbytes: int = 0) -> dict:
    """One task as a Chrome "X" event, in microseconds; its id is its name."""
    return {
        "name": name, "cat": kind or name, "ph": "X", "ts": start, "dur": end - start, "pid": 0,
        "tid": LANE_TID.get(lane, 999),
        "args": {"kind": kind or name, "lane": lane.partition(":")[0], "lane_name": lane, "takes": takes,
                 "slot": slot, "reads": reads or {}, "deps": list(deps), "id": name, "step": step,
                 "bytes": nbytes, "layer": None, "micro_batch": None, "unit": None, "phase": None},
    }


def doc(*events: dict, **meta) -> dict:
    return {"traceEvents": list(events), "otherData": {"flowtrain": {"version": 1, **meta}}}


def hand_trace() -> Trace:
    """A small trace with one idle gap of each kind on the compute lane (times in us)::

        h2d      fA 0-10 (w0)  fB 10-20 (w1)                       fD 60-70 (w0, after adamA)
        compute            uA 10-30  zA 30-32 (g0)  uB 32-40  .. zB 45-47 (g0) .. uC 50-55 .. uD 70-80
        d2h                                         oA 40-45 (reads g0)
        cpu:0                                             adamA 45-60

    compute idle: 0-10 waits for fA (a fetch); 40-45 zB waits for the grads slot that oA holds;
    47-50 uC had everything (host); 55-70 uD waits for fD, which waited for adamA.
    """
    return trace_from_json(doc(
        ev("fA", "h2d", 0, 10, kind="fetch", takes="weights", slot=0, nbytes=100),
        ev("fB", "h2d", 10, 20, kind="fetch", takes="weights", slot=1, nbytes=100),
        ev("uA", "compute", 10, 30, kind="forward", reads={"weights": [0]}, deps=("fA",)),
        ev("zA", "compute", 30, 32, kind="zero_grad", takes="grads", slot=0),
        ev("uB", "compute", 32, 40, kind="backward", reads={"weights": [1], "grads": [0]}, deps=("fB", "zA")),
        ev("oA", "d2h", 40, 45, kind="offload_grad", reads={"grads": [0]}, deps=("uB",), nbytes=50),
        ev("zB", "compute", 45, 47, kind="zero_grad", takes="grads", slot=0),
        ev("adamA", "cpu:0", 45, 60, kind="cpu_adam", deps=("oA",)),
        ev("uC", "compute", 50, 55, kind="forward", deps=("uB",)),
        ev("fD", "h2d", 60, 70, kind="fetch", takes="weights", slot=0, deps=("adamA",), step=1, nbytes=100),
        ev("uD", "compute", 70, 80, kind="forward", reads={"weights": [0]}, deps=("fD",), step=1),
        policy="hand", budgets={"weights": 2, "grads": 1},
    ), name="hand")


def engine_records(layers: int = 4, micro_batches: int = 2, steps: int = 2, policy: str = "double_buffer",
                   sleep: float = 0.0, checkpoint_every: int = 1):
    """Run the real engine on CPU lanes with a toy program; returns (graph, records)."""
    graph = compile_steps(StepSpec(layers=layers, micro_batches=micro_batches, checkpoint_every=checkpoint_every), steps)
    rec = TraceRecorder()

    def program(task, ctx):
        if sleep:
            time.sleep(sleep if task.lane == "compute" else sleep / 2)
        return 1000 if task.kind in ("fetch", "offload_grad") else 0

    asyncio.run(run_graph(graph, program, policy, instruments=[rec]))
    return graph, rec.records


def engine_trace_file(path: Path, policy: str = "double_buffer", **kw) -> Path:
    """A real trace file from the engine, written the way producers write it."""
    graph, records = engine_records(policy=policy, **kw)
    write_chrome_trace(path, records, meta={"policy": policy})
    return path


def lane_counts(path: Path) -> dict[str, int]:
    """Tasks per lane, read straight from the trace JSON (not through flowtrain.viz)."""
    counts: dict[str, int] = {}
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e["ph"] == "X":
            counts[e["args"]["lane_name"]] = counts.get(e["args"]["lane_name"], 0) + 1
    return counts


def simulated_records(layers: int, micro_batches: int, steps: int, policy: str = "double_buffer"):
    """Records of compiled steps as the engine would run them on ideal lanes, without running
    anything: tasks in the policy's planned order, each lane one at a time (compute 100 us,
    copies 60 us, Adam 80 us), a task taking the pool's slot that is free first, once its last
    reader has finished. Steps are compiled one at a time and linked by ``cross_step_edges``,
    so 100,000 tasks take seconds. For traces too big to run."""
    from flowtrain.graph import compile_step, cross_step_edges
    from flowtrain.policy import resolve_policy
    from flowtrain.runtime import TaskRecord

    spec = StepSpec(layers=layers, micro_batches=micro_batches)
    cost = {"compute": 100e-6, "h2d": 60e-6, "d2h": 60e-6, "cpu": 80e-6, "io": 80e-6}
    lane_free: dict[str, float] = {}
    free_at: dict[str, list[float]] = {}  # pool -> when each slot's last reader finished
    done: dict = {}
    held: dict = {}  # slot taker -> (pool, slot)
    prev: list = []
    for step in range(steps):
        graph = compile_step(spec, step)
        proposal = resolve_policy(policy).propose(graph)
        extra: dict = {}
        for u, v in (cross_step_edges(prev, graph, spec) if prev else []):
            extra.setdefault(v, []).append(u)
        for task in proposal.order:
            preds = list(graph.predecessors(task)) + extra.get(task, [])
            start = max([lane_free.get(task.lane, 0.0), *(done[p].end for p in preds)])
            slot = None
            if task.takes is not None:
                slots = free_at.setdefault(task.takes, [0.0] * proposal.budgets[task.takes])
                slot = min(range(len(slots)), key=slots.__getitem__)
                start = max(start, slots[slot])
            end = start + cost.get(task.lane, 50e-6)
            reads: dict[str, list[int]] = {}
            for p in preds:
                if p in held and graph.has_edge(p, task) and graph.edges[p, task].get("reads"):
                    pool, s = held[p]
                    reads.setdefault(pool, []).append(s)
                    free_at[pool][s] = max(free_at[pool][s], end)
            if slot is not None:
                held[task] = (task.takes, slot)
                free_at[task.takes][slot] = end
            done[task] = TaskRecord(task=task, lane=task.lane, start=start, end=end, slot=slot, reads=reads,
                                    bytes=1 << 20 if task.kind in ("fetch", "offload_grad") else 0, deps=preds)
            lane_free[task.lane] = end
        prev = list(graph)
    return sorted(done.values(), key=lambda r: r.start)
