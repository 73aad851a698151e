"""A trace file that Perfetto reads whole, checked against the Trace Event Format's rules.

Perfetto drops a complete event that overlaps its neighbour on a thread, leaves a flow arrow
with one end unbound, and draws a counter from its events in time order. :func:`tef_problems`
checks a document for exactly those faults, reading times the way Perfetto does (``ts`` and
``dur`` in microseconds, each rounded to a whole nanosecond); the tests run it on a real
training run's trace and prove that it catches each fault.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from viz_helpers import engine_records

from flowtrain.runtime import TraceRecorder, chrome_trace
from flowtrain.viz.analysis import occupancy
from flowtrain.viz.load import load_input, trace_from_json


def _ns(us: float) -> int:
    return round(us * 1000)


def tef_problems(data: dict) -> list[str]:
    """Every rule of the format this file breaks, in words (empty: Perfetto reads it whole)."""
    problems = []
    events = data["traceEvents"]
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    lanes: dict[tuple, list[tuple[int, int, str]]] = defaultdict(list)
    for e in events:
        if e["ph"] not in ("X", "M", "s", "f", "C"):
            problems.append(f"unexpected phase {e['ph']!r}")
        if e["ph"] == "X":
            if (e["pid"], e["tid"]) not in named:
                problems.append(f"{e['name']}: thread {e['tid']} has no thread_name")
            if e["dur"] < 0:
                problems.append(f"{e['name']}: negative dur")
            start = _ns(e["ts"])
            lanes[(e["pid"], e["tid"])].append((start, start + _ns(e["dur"]), e["name"]))
    for key, spans in lanes.items():
        spans.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                problems.append(f"thread {key[1]}: {n1} starts {e0 - s1} ns before {n0} ends")

    def bound(key: tuple, ts: int) -> bool:
        return any(s <= ts <= e for s, e, _ in lanes.get(key, []))

    flows: dict[tuple, list[str]] = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[(e["cat"], e["id"])].append(e["ph"])
            if not bound((e["pid"], e["tid"]), _ns(e["ts"])):
                problems.append(f"flow {e['id']}: its {e['ph']!r} end lies in no slice of thread {e['tid']}")
            if e["ph"] == "f" and e.get("bp") != "e":
                problems.append(f"flow {e['id']}: 'f' without \"bp\": \"e\" binds to the next slice")
    problems += [f"flow {k[1]}: ends {v}, not one 's' then one 'f'" for k, v in flows.items() if v != ["s", "f"]]
    last: dict[tuple, int] = {}
    for e in events:
        if e["ph"] == "C":
            key = (e["pid"], e["name"])
            if not all(isinstance(v, (int, float)) for v in e["args"].values()):
                problems.append(f"counter {e['name']}: non-numeric value")
            if key in last and _ns(e["ts"]) <= last[key]:
                problems.append(f"counter {e['name']}: ts {e['ts']} is not after the previous value's")
            last[key] = _ns(e["ts"])
    return problems


@pytest.fixture(scope="module")
def train_trace(tmp_path_factory) -> Path:
    """A real training run on CPU: ``flowtrain train --model tiny --steps 3 --trace FILE``."""
    path = tmp_path_factory.mktemp("train") / "trace.json"
    subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--model", "tiny", "--steps", "3",
                    "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "64", "--no-progress",
                    "--trace", str(path)], check=True, capture_output=True, text=True, timeout=300)
    return path


def test_a_training_trace_follows_the_format(train_trace):
    data = json.loads(train_trace.read_text())
    assert tef_problems(data) == []
    kinds = {e["ph"] for e in data["traceEvents"]}
    assert {"X", "s", "f", "C"} <= kinds  # tasks, dependency arrows and counters are all there
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["id"] for e in xs) == list(range(len(xs)))  # compact ids
    assert all(e["args"].get("deps") is None for e in xs)  # dependencies are flows, not strings


def test_a_training_trace_loads_in_viz_with_its_arrows(train_trace):
    data = json.loads(train_trace.read_text())
    tr = load_input(train_trace)
    arrows = sum(e["ph"] == "f" for e in data["traceEvents"])
    assert sum(map(len, tr.dep_indices)) == arrows > 0
    assert len(tr.tasks) == sum(e["ph"] == "X" for e in data["traceEvents"])


def test_the_checker_catches_each_fault():
    data = chrome_trace(engine_records(layers=2, micro_batches=1, steps=1)[1])
    assert tef_problems(data) == []
    xs = [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    a, b = xs[0], xs[1]
    a["dur"] = b["ts"] - a["ts"] + 0.001  # one nanosecond into the next task
    assert any("starts 1 ns before" in p for p in tef_problems(data))
    a["dur"] = b["ts"] - a["ts"]
    data["traceEvents"] = [e for e in data["traceEvents"] if not (e["ph"] == "f" and e["id"] == 1)]
    assert any("flow 1: ends ['s']" in p for p in tef_problems(data))
    cs = [e for e in data["traceEvents"] if e["ph"] == "C"]
    cs[2]["ts"] = cs[0]["ts"]
    assert any("is not after" in p for p in tef_problems(data))


def test_rounding_never_makes_back_to_back_tasks_overlap():
    """A task from 1.0006 to 2.0004 us and the next from 2.0004 us touch. Rounding ts and dur
    separately would end the first at 1.001 + 1.000 = 2.001 us, 1 ns into the second; both
    come from the same nanosecond ends instead."""
    from flowtrain.graph import StepSpec, compile_step
    from flowtrain.runtime import TaskRecord

    assert round(1.0006, 3) + round(2.0004 - 1.0006, 3) > round(2.0004, 3)  # the old way overlaps
    a, b = [t for t in compile_step(StepSpec(layers=1)) if t.lane == "compute"][:2]
    records = [TaskRecord(task=a, lane="compute", start=1.0006e-6, end=2.0004e-6),
               TaskRecord(task=b, lane="compute", start=2.0004e-6, end=3.0006e-6)]
    data = chrome_trace(records)
    assert tef_problems(data) == []
    x = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in x] == [(1.001, 0.999), (2.0, 1.001)]


def test_counters_are_the_slot_occupancy_viz_computes():
    _, records = engine_records(layers=3, micro_batches=2, steps=2)
    data = chrome_trace(records)
    tr = trace_from_json(data)
    t0 = min(_ns(e["ts"]) for e in data["traceEvents"] if e["ph"] == "X")
    occ = occupancy(tr)
    assert set(occ) == {"weights", "grads"}
    for pool, steps in occ.items():
        counter = [(_ns(e["ts"]) - t0, e["args"]["in use"]) for e in data["traceEvents"]
                   if e["ph"] == "C" and e["name"] == f"{pool} slots"]
        assert counter == [(round(t * 1e9), n) for t, n in steps if (t, n) != (0.0, 0)]  # viz starts at 0


def test_a_recorder_keeps_the_budgets_the_engine_reports():
    rec = TraceRecorder()
    rec.on_budgets({"weights": 2, "grads": 1})
    assert rec.meta(policy="p") == {"budgets": {"weights": 2, "grads": 1}, "policy": "p"}
    assert TraceRecorder().meta() == {}


def test_kept_activations_load_from_new_and_old_traces():
    """A kept layer's forward and backward carry ``activations``; a trace written before that was
    a field of its own gave them ``phase`` ``keep`` or ``attn``, and still reads the same."""
    from viz_helpers import doc, ev

    def task(kind: str, **args) -> dict:
        e = ev(f"{kind} {args}", "compute", 0, 1, kind=kind)
        e["args"].update(unit="layer", layer=0, micro_batch=0, **args)
        return e

    new = trace_from_json(doc(task("forward", activations="keep"), task("backward", activations="attn"),
                              task("forward", phase="eval")))
    old = trace_from_json(doc(task("forward", phase="keep"), task("backward", phase="attn"),
                              task("forward", phase="eval")))
    for tr in (new, old):
        assert [(t.phase, t.activations) for t in tr.tasks] == [(None, "keep"), (None, "attn"), ("eval", None)]
    w1 = load_input(Path(__file__).parent / "fixtures" / "w1-adam-order-steps0-3.json")  # an old trace
    forwards = [t for t in w1.tasks if t.kind == "forward"]
    assert forwards and all(t.activations == "keep" and t.phase is None for t in forwards)
