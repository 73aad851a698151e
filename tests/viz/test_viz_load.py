"""Reading traces and graphs: the trace format's contract, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
from viz_helpers import doc, engine_records, ev

from flowtrain.errors import DataError
from flowtrain.graph import StepSpec, compile_steps
from flowtrain.graph.export import graph_to_json
from flowtrain.runtime import chrome_trace, write_chrome_trace
from flowtrain.viz.load import GraphInput, Trace, load_input, trace_from_json


def test_engine_trace_loads_with_every_dependency_resolved(tmp_path):
    graph, records = engine_records(layers=3, micro_batches=2, steps=2)
    path = tmp_path / "t.json"
    write_chrome_trace(path, records, meta={"policy": "double_buffer"})
    tr = load_input(path)
    assert isinstance(tr, Trace) and tr.policy == "double_buffer"
    assert len(tr.tasks) == graph.number_of_nodes()
    assert tr.lanes == ["compute", "h2d", "d2h", "cpu:0", "sync"]  # sync: verify_step
    assert sum(map(len, tr.dep_indices)) == graph.number_of_edges()
    assert tr.tasks[0].start == 0.0 and all(a.start <= b.start for a, b in zip(tr.tasks, tr.tasks[1:]))
    assert {t.kind for t in tr.tasks} == {t.kind for t in graph}
    assert sum(t.bytes for t in tr.tasks) == sum(r.bytes for r in records)


def test_foreign_events_fall_back_to_thread_names_and_categories():
    data = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "cpu:1"}},
        {"ph": "X", "name": "work", "cat": "cpu_adam", "ts": 5, "dur": 2, "pid": 1, "tid": 7},
        {"ph": "i", "name": "marker", "ts": 1, "pid": 1, "tid": 7},
    ]}
    tr = trace_from_json(data)
    (t,) = tr.tasks
    assert (t.kind, t.lane, t.lane_name, t.start, t.end) == ("cpu_adam", "cpu", "cpu:1", 0.0, 2e-6)
    assert trace_from_json(data["traceEvents"]).tasks == tr.tasks  # a bare event array is a trace too


def test_graph_json_loads(tmp_path):
    g = compile_steps(StepSpec(layers=2, micro_batches=2), 1)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph_to_json(g)))
    item = load_input(path)
    assert isinstance(item, GraphInput)
    assert set(item.graph.nodes) == set(g.nodes) and set(item.graph.edges) == set(g.edges)
    links = graph_to_json(g)
    links["links"] = links.pop("edges")  # networkx's older key
    path.write_text(json.dumps(links))
    assert set(load_input(path).graph.edges) == set(g.edges)


BAD = {
    "missing": (None, "no such file"),
    "not json": ("{", "not JSON"),
    "neither": ({"hello": 1}, "neither a trace"),
    "no tasks": (doc(), "no task events"),
    "bad events": ({"traceEvents": {"a": 1}}, "'traceEvents' must be a list"),
    "bad ts": (doc({**ev("a", "compute", 0, 1), "ts": "soon"}), "'ts' must be a finite number"),
    "negative dur": (doc({**ev("a", "compute", 0, 1), "dur": -3}), "negative duration"),
    "bad layer": (doc({**ev("a", "compute", 0, 1), "args": {"layer": 1.5}}), "args.layer must be an integer"),
    "bad reads": (doc({**ev("a", "compute", 0, 1), "args": {"reads": [0]}}), "args.reads must map a pool"),
    "bad deps": (doc({**ev("a", "compute", 0, 1), "args": {"deps": "x"}}), "args.deps must be a list"),
    "unknown kind": ({"nodes": [{"id": "x", "kind": "teleport"}], "edges": []}, "unknown kind 'teleport'"),
    "graph without edges": ({"nodes": []}, "needs 'nodes' and 'edges'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_raise_data_errors_naming_the_file(tmp_path, case):
    content, message = BAD[case]
    path = tmp_path / "in.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(DataError, match=message) as info:
        load_input(path)
    assert str(path) in str(info.value)


def test_cyclic_graph_is_rejected(tmp_path):
    g = compile_steps(StepSpec(layers=1), 1)
    data = graph_to_json(g)
    first, last = data["nodes"][0]["id"], data["nodes"][-1]["id"]
    data["edges"].append({"source": last, "target": first, "reads": False})
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match="cycle"):
        load_input(path)


def test_ids_reused_across_runs_resolve_to_the_latest_earlier_task():
    """Two traces glued together: each consumer's dependency is the occurrence before it."""
    one = chrome_trace(engine_records(layers=1, steps=1)[1])["traceEvents"]
    xs = [e for e in one if e["ph"] == "X"]
    shift = max(e["ts"] + e["dur"] for e in xs) + 10
    tr = trace_from_json(one + [{**e, "ts": e["ts"] + shift} for e in xs])
    half = len(xs)
    for t in tr.tasks:
        for d in tr.dep_indices[t.index]:
            assert (d < half) == (t.index < half) and tr.tasks[d].start <= t.start


def test_steps_and_step_suffixes_count_from_one():
    """A trace's ``args.step`` counts from 0, training's progress lines from 1: viz follows
    training, in the step and in a name's step suffix (and leaves other names alone)."""
    tr = trace_from_json(doc(ev("forward L3 m1 s0", "compute", 0, 5, kind="forward", step=0),
                             ev("fetch L3 s1", "h2d", 5, 6, kind="fetch", step=1),
                             ev("s1", "compute", 6, 8, kind="forward", step=1)))
    assert [(t.name, t.step) for t in tr.tasks] == [("forward L3 m1 s1", 1), ("fetch L3 s2", 2), ("s1", 2)]
