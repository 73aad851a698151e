"""The HTML report, the PNG export and ``flowtrain viz`` (no browser here; see test_viz_browser)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from viz_helpers import doc, engine_trace_file, ev, hand_trace

from flowtrain.cli import main
from flowtrain.graph import StepSpec, compile_steps
from flowtrain.graph.export import graph_to_json
from flowtrain.viz.graphview import MAX_DRAWN, color, graph_section
from flowtrain.viz.html import render_report
from flowtrain.viz.load import GraphInput, trace_from_json


def page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="ft-data">(.*?)</script>', page, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))


def test_report_is_self_contained():
    g = GraphInput(compile_steps(StepSpec(layers=2), 1), name="g")
    page = render_report([hand_trace(), g])
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"<link|<iframe|<img|\ssrc\s*=|url\(|@import|fetch\(|XMLHttpRequest", page)
    assert set(re.findall(r"https?://[^\s\"'<>]*", page)) <= {"http://www.w3.org/2000/svg"}  # SVG namespace only


def test_report_holds_every_task_lane_slot_and_gap():
    tr = hand_trace()
    page = render_report([tr], min_gap=0)
    data = page_data(page)
    (t,) = data["traces"]
    assert t["lanes"] == ["compute", "h2d", "d2h", "cpu:0"]
    assert [t["lanes"][i] for i in t["t"]["l"]].count("compute") == 6 and len(t["t"]["s"]) == 11
    assert [(s["pool"], s["slot"], len(s["iv"])) for s in t["slots"]] == [("grads", 0, 2), ("weights", 0, 2), ("weights", 1, 1)]
    gaps = [(g["s"], g["e"], g["r"]) for g in t["gaps"]]
    assert gaps == [(0, 10, "fetch"), (40, 45, "slot"), (47, 50, "host"), (55, 70, "fetch")]
    assert data["maxWall"] == 80
    assert 'id="panel-0"' in page and page.count("<canvas class=gantt") == 1
    # the gaps say why in words, and are grouped by pattern (kinds, not tasks)
    assert "zB waited for a grads slot, freed when oA finished" in page
    assert [p["text"] for p in t["patterns"]] == [  # the most idle time first
        "forward waited for fetch, which waited for cpu_adam", "forward waited for fetch",
        "zero_grad waited for a grads slot", "forward had all it needed (launch overhead)"]
    assert [g["p"] for g in t["gaps"]] == [1, 2, 3, 0]
    # each step's additive numbers, for the page to sum over a window; the default window
    assert [(r["step"], r["s"], r["e"], r["warm"]) for r in t["steps"]] == [(1, 0, 70, True), (2, 70, 80, False)]
    assert t["steps"][0]["busy"]["compute"] == 37 and t["steps"][0]["why"]["fetch"] == 25
    assert t["window"] == {"first": 2, "last": 2, "why": "steady state: leaves out warm-up step 1"}
    # slots in use per pool against the budgets, and bytes held per place
    assert t["budgets"] == {"grads": 1, "weights": 2}
    assert t["occ"]["weights"] == [[0, 1], [10, 2], [30, 1], [40, 0], [60, 1], [80, 0]]
    assert t["mem"] == {"gpu": [[0, 100], [10, 200], [30, 100], [40, 0], [60, 100], [80, 0]]}
    assert t["memUnknown"] == ["grads"]  # zero_grad moves no bytes: the slot size is unknown


def test_steps_choose_the_first_window():
    page = render_report([hand_trace()], steps=":")
    assert page_data(page)["traces"][0]["window"] == {"first": 1, "last": 2, "why": "--steps :"}


def test_several_traces_share_one_scale_and_get_compared():
    a = hand_trace()
    b = trace_from_json(doc(ev("x", "compute", 0, 200, kind="forward")), name="long")
    page = render_report([a, b])
    data = page_data(page)
    assert data["maxWall"] == 200 and len(data["traces"]) == 2
    assert 'id="ft-compare"' in page and page.count("<canvas class=gantt") == 2


def test_task_names_cannot_break_out_of_the_data_block():
    evil = "</script><script>alert(1)</script><!--"
    tr = trace_from_json(doc(ev(evil, "compute", 0, 5, kind="forward")))
    page = render_report([tr])
    assert page_data(page)["traces"][0]["t"]["name"] == [evil]
    assert "<script>alert(1)" not in page and page.count("</script>") == 5


def test_small_graphs_are_drawn_and_large_ones_tabled():
    small = compile_steps(StepSpec(layers=2, micro_batches=2), 1)
    svg = graph_section(small, "double_buffer")
    assert svg.count('<g class="node"') == small.number_of_nodes()
    assert svg.count("<path ") == small.number_of_edges()
    assert 'stroke="#7e22ce"' in svg  # the critical path, violet (red is idle)
    assert "planned issue order per lane (double_buffer)" in svg
    big = compile_steps(StepSpec(layers=32, micro_batches=4), 1)
    assert big.number_of_nodes() > MAX_DRAWN
    table = graph_section(big, "sequential")
    assert "<svg" not in table and table.count("<tr") >= big.number_of_nodes()


def test_cli_writes_html_and_png(tmp_path, capsys):
    seq = engine_trace_file(tmp_path / "seq.json", policy="sequential", layers=2, steps=1)
    dbl = engine_trace_file(tmp_path / "dbl.json", policy="double_buffer", layers=2, steps=1)
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps(graph_to_json(compile_steps(StepSpec(layers=2), 1))))
    out, png = tmp_path / "r.html", tmp_path / "r.png"
    rc = main(["viz", str(seq), str(dbl), str(graph), "--out", str(out), "--png", str(png), "--policy", "lookahead"])
    assert rc == 0
    page = out.read_text()
    assert page.count("<canvas class=gantt") == 2 and "planned issue order per lane (lookahead)" in page
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out
    graph_png = tmp_path / "g.png"
    assert main(["viz", str(graph), "--out", str(tmp_path / "g.html"), "--png", str(graph_png)]) == 0
    assert graph_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["missing.json"], "missing.json: no such file"),
    (["TRACE", "--policy", "sequential"], "--policy applies to graph inputs"),
    (["GRAPH", "--policy", "nope"], "unknown policy 'nope'"),
    (["TRACE", "--min-gap-ms", "-1"], "--min-gap-ms must be at least 0"),
    (["TRACE", "--steps", "3:2"], "--steps 3:2: the window is empty"),
    (["TRACE", "--steps", "4:"], "--steps 4:: no such steps in the trace (it has steps 1\u20131)"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "TRACE").write_text(json.dumps(doc(ev("a", "compute", 0, 1))))
    (tmp_path / "GRAPH").write_text(json.dumps(graph_to_json(compile_steps(StepSpec(layers=1), 1))))
    assert main(["viz", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_says_which_window_its_numbers_cover(tmp_path, capsys):
    """Step times set by hand (an engine's would decide by the machine's load which steps are
    warm-up): step 1 fifty times the others, so the default window leaves it out. The file counts
    steps from 0, viz from 1, as training does: ``--steps 2:2`` is the file's step 1."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(doc(ev("a0", "compute", 0, 1000, step=0), ev("a1", "compute", 1000, 1020, step=1),
                                    ev("a2", "compute", 1020, 1040, step=2))))
    assert main(["viz", str(trace), "--out", str(tmp_path / "r.html"), "--steps", "2:2"]) == 0
    out = capsys.readouterr().out
    assert "step 2 (1 of 3 steps, 20 \u00b5s)" in out and "step time" in out and "compute busy" in out
    assert main(["viz", str(trace), "--out", str(tmp_path / "r.html")]) == 0
    assert "steps 2\u20133 (2 of 3 steps, 40 \u00b5s)" in capsys.readouterr().out  # by default: all but the first


def test_cli_window_of_an_engine_trace_is_the_one_its_steps_give(tmp_path, capsys):
    """On a real engine trace the CLI reports the window the step rule picks from its times."""
    from flowtrain.viz.analysis import compute_gaps, slot_uses
    from flowtrain.viz.load import load_input
    from flowtrain.viz.steps import default_window, step_stats

    trace = engine_trace_file(tmp_path / "t.json", layers=2, steps=3)
    tr = load_input(trace)
    window = default_window(step_stats(tr, compute_gaps(tr), slot_uses(tr)))
    assert main(["viz", str(trace), "--out", str(tmp_path / "r.html")]) == 0
    assert window.label in capsys.readouterr().out and window.first >= 2


def test_png_spans_the_window():
    from flowtrain.viz.html import TraceView
    from flowtrain.viz.png import _trace_figure

    (ax,) = _trace_figure([TraceView(hand_trace(), steps="2:")]).axes
    lo, hi = ax.get_xlim()  # ms from the window's start; step 2 runs from 70 to 80 us
    assert -0.001 < lo < 0 and 0.010 < hi < 0.0102
    assert "step 2 (1 of 2 steps" in ax.get_title(loc="left")
    (wide,) = _trace_figure([TraceView(hand_trace(), steps=":")]).axes
    assert 0.080 < wide.get_xlim()[1] < 0.081  # both steps: 80 us


def steps_trace(n: int, name: str):
    """``n`` steps of one 10 us forward each (the file's steps 0..n-1: viz's 1..n)."""
    return trace_from_json(doc(*(ev(f"f{i}", "compute", 10 * i, 10 * i + 10, kind="forward", step=i)
                                 for i in range(n))), name=name)


def test_steps_apply_to_each_trace_that_has_them(tmp_path, capsys):
    """Two traces of different lengths: --steps 4:5 is the long one's window; the short one,
    which has no step 4, keeps its steady state and says so; no trace with them is an error."""
    from flowtrain.errors import ConfigError
    from flowtrain.viz.html import trace_views

    short, long = steps_trace(3, "short"), steps_trace(6, "long")
    a, b = trace_views([short, long], steps="4:5")
    assert (b.window.first, b.window.last, b.missed) == (4, 5, False)
    assert (a.window.first, a.window.last, a.missed) == (2, 3, True)
    assert a.window.why.startswith("--steps 4:5 is not in this trace (it has steps 1\u20133), so its steady state")
    page = page_data(render_report([short, long], steps="4:5"))
    assert [t["window"]["first"] for t in page["traces"]] == [2, 4] and "not in this trace" in page["traces"][0]["window"]["why"]
    with pytest.raises(ConfigError, match="short: --steps 7:: no such steps in the trace"):
        trace_views([short, long], steps="7:")
    for tr in (short, long):
        (tmp_path / f"{tr.name}.json").write_text(json.dumps(doc(*(ev(f"f{i}", "compute", 10 * i, 10 * i + 10,
                                                                     kind="forward", step=i)
                                                                  for i in range(len(tr.tasks))))))
    assert main(["viz", str(tmp_path / "short.json"), str(tmp_path / "long.json"), "--steps", "4:5",
                 "--out", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "steps 4\u20135 (2 of 6 steps" in out and "(--steps 4:5 is not in this trace (it has steps 1\u20133)" in out


def test_png_draws_a_busy_lane_busy():
    """3,000 back-to-back tasks of 10 us in the window (each well under a pixel) draw the
    compute row solid: no white edges or gaps between thin tasks, every pixel column inked."""
    import numpy as np

    from flowtrain.viz.html import TraceView
    from flowtrain.viz.png import _trace_figure

    kinds = ("forward", "backward")
    events = [ev("w", "compute", 0, 30000, kind="forward", step=0)]  # step 1: warm-up, left out
    events += [ev(f"t{i}", "compute", 30000 + 10 * i, 30010 + 10 * i, kind=kinds[i % 2], step=1) for i in range(3000)]
    fig = _trace_figure([TraceView(trace_from_json(doc(*events)))])
    fig.canvas.draw()
    (ax,) = fig.axes
    img = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)
    to_px = ax.transData.transform
    (x0, y), (x1, _) = to_px((0, 0)), to_px((30.0, 0))  # the window: 0 to 30 ms, the compute row at y = 0
    row = img[img.shape[0] - int(round(y)), int(np.ceil(x0)) + 1:int(np.floor(x1)) - 1]
    colours = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (color("forward"), color("backward"))}
    inked = [tuple(p) in colours for p in row]
    assert sum(inked) == len(inked), f"{len(inked) - sum(inked)} of {len(inked)} columns not a task's colour"


def test_png_of_the_10gb_trace_draws_compute_as_busy_as_the_page_says():
    """llama-8b under a 10 GB card (an H200 trace): the share of the compute row's pixel columns
    the picture inks over the window is the compute-busy share the page states, within 3
    points (a task narrower than a pixel is drawn one pixel wide)."""
    import numpy as np

    from flowtrain.viz.html import TraceView
    from flowtrain.viz.png import _rows, _trace_figure
    path = Path(__file__).parents[2] / "docs" / "bench" / "2026-12-04" / "gate-8b10o-trace.json"
    view = TraceView(trace_from_json(json.loads(path.read_text()), path=str(path)))
    fig = _trace_figure([view])
    fig.canvas.draw()
    (ax,) = fig.axes
    img = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)
    y = [key for _, _, key in _rows(view)].index("compute")
    width_ms = (view.window.end - view.window.start) * 1e3
    (x0, py), (x1, _) = ax.transData.transform((0, y)), ax.transData.transform((width_ms, y))
    row = img[img.shape[0] - int(round(py)), int(np.ceil(x0)) + 1:int(np.floor(x1)) - 1]
    colours = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in map(color, {t.kind for t in view.trace.by_lane["compute"]})}
    inked = sum(tuple(p) in colours for p in row) / len(row)
    assert abs(inked - view.summary.compute_busy) <= 0.03, (inked, view.summary.compute_busy)
