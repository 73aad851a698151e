"""The report in a real browser: Debian's headless Chromium, driven from the command line.

The page's first script counts uncaught errors, rejected promises and ``console.error`` calls
into ``<html data-ft-errors>``; the drawing script writes the tasks it drew per lane and
``performance.now()`` at the end of the first render. ``--dump-dom`` hands all of that back
after the load event, so no driver or websocket is needed. Chromium's own console log
(``--enable-logging=stderr``) is checked too, and a planted error proves both catch one.

Skipped only when /usr/bin/chromium is missing *and* CI is unset; in CI a missing browser
fails (``.ci/run`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from viz_helpers import engine_trace_file, lane_counts, simulated_records

from flowtrain.graph import StepSpec, compile_steps
from flowtrain.viz.html import write_report
from flowtrain.viz.load import GraphInput, load_input

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]


@pytest.fixture(scope="module")
def chromium() -> str:
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if os.environ.get("CI"):
        pytest.fail("CI is set but /usr/bin/chromium is missing: .ci/run must 'apt-get install -y chromium'")
    pytest.skip("needs /usr/bin/chromium (apt-get install chromium); never skipped when CI is set")


def browse(chromium: str, tmp_path: Path, page: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


class _HtmlAttrs(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "html" and self.attrs is None:
            self.attrs = {k: v or "" for k, v in attrs}


def page_state(chromium: str, tmp_path: Path, page: Path) -> tuple[dict[str, str], list[str]]:
    """The <html> element's attributes after load, and Chromium's console lines."""
    proc = browse(chromium, tmp_path, page, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    parser = _HtmlAttrs()
    parser.feed(proc.stdout)
    assert parser.attrs is not None, f"no DOM came back: {proc.stdout[:500]!r}"
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return parser.attrs, console


def assert_clean_render(attrs: dict[str, str], console: list[str], traces: list[Path]) -> None:
    assert attrs.get("data-ft-errors") == "0", attrs.get("data-ft-error-text")
    assert attrs.get("data-ft-ready") == "1", "the drawing script did not finish"
    assert not console, console
    drawn = json.loads(attrs["data-ft-lanes"])
    assert [d["lanes"] for d in drawn] == [lane_counts(p) for p in traces]


@pytest.fixture(scope="module")
def cpu_traces(tmp_path_factory) -> list[Path]:
    """Real CPU training runs (``flowtrain train --trace``): the tiny model under two policies."""
    from flowtrain.train.run import TrainConfig, train

    d = tmp_path_factory.mktemp("traces")
    paths = []
    for p in ("sequential", "double_buffer"):
        path = d / f"{p}.json"
        train(TrainConfig(model="tiny", steps=4, batch_size=4, micro_batch_size=2, seq_len=64, policy=p,
                          device="cpu", trace=str(path), progress=False))
        paths.append(path)
    return paths


def test_report_renders_every_lane_without_errors(chromium, tmp_path, cpu_traces):
    graph = GraphInput(compile_steps(StepSpec(layers=4, micro_batches=2), 1), name="step")
    page = write_report(tmp_path / "report.html", [*(load_input(p) for p in cpu_traces), graph])
    attrs, console = page_state(chromium, tmp_path, page)
    assert_clean_render(attrs, console, cpu_traces)
    assert all(c["lanes"]["compute"] > 0 and "cpu:0" in c["lanes"] for c in json.loads(attrs["data-ft-lanes"]))

    shot = tmp_path / "report.png"
    proc = browse(chromium, tmp_path, page, f"--screenshot={shot}", "--window-size=1400,1000", "--hide-scrollbars")
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    from matplotlib.image import imread

    pixels = (imread(shot)[:, :, :3] * 255).round().astype(int)
    for kind_color in ((0x4E, 0x79, 0xA7), (0x59, 0xA1, 0x4F), (0xF2, 0x8E, 0x2B)):  # fetch, forward, backward
        assert (pixels == kind_color).all(axis=2).sum() > 200, f"no {kind_color} bars in the screenshot"
    if os.environ.get("FLOWTRAIN_ARTIFACTS"):
        shutil.copy(shot, Path(os.environ["FLOWTRAIN_ARTIFACTS"]) / "viz-report.png")


def test_a_planted_error_is_caught(chromium, tmp_path, cpu_traces):
    """The harness is not blind: an error thrown after the report's scripts shows up twice."""
    page = write_report(tmp_path / "report.html", [load_input(cpu_traces[0])])
    page.write_text(page.read_text().replace("</body>", "<script>throw new Error('planted')</script></body>"))
    attrs, console = page_state(chromium, tmp_path, page)
    assert attrs["data-ft-errors"] == "1" and "planted" in attrs["data-ft-error-text"]
    assert any("Uncaught Error: planted" in line for line in console)


def test_two_thousand_tasks_render_every_task(chromium, tmp_path):
    """A page of 2,000+ tasks finishes its first render (parsing the page and its data,
    building the rows, drawing): every task of every lane drawn, no error."""
    trace = engine_trace_file(tmp_path / "big.json", layers=30, micro_batches=4, checkpoint_every=3, steps=4)
    assert sum(lane_counts(trace).values()) >= 2000
    page = write_report(tmp_path / "big.html", [load_input(trace)])
    attrs, console = page_state(chromium, tmp_path, page)
    assert_clean_render(attrs, console, [trace])  # data-ft-ready: the first render ran to its end


INTERACT_JS = r"""
window.addEventListener("load", function () {
  window.ftViz.reset(); window.ftViz.redraw();  // the page opens on the window: start from everything
  var root = document.documentElement, p = window.ftViz.panels[0], c = p.canvas, r = c.getBoundingClientRect();
  var lane = p.rows[0], T = p.tr.t, i = lane.idx[Math.floor(lane.idx.length / 2)];
  var full = JSON.parse(c.getAttribute("data-drawn")).compute;
  function at(t) { return { clientX: r.left + p.X(t), clientY: r.top + lane.y + lane.h / 2, bubbles: true, cancelable: true }; }
  var mid = (T.s[i] + T.e[i]) / 2;
  c.dispatchEvent(new WheelEvent("wheel", Object.assign({ deltaY: -1500 }, at(mid))));   // zoom in on task i
  window.ftViz.redraw();
  var zoomed = JSON.parse(c.getAttribute("data-drawn")).compute;
  c.dispatchEvent(new MouseEvent("mousemove", at((T.s[i] + T.e[i]) / 2)));                 // hover: tooltip
  var tip = document.getElementById("ft-tip");
  c.dispatchEvent(new MouseEvent("mousedown", at(mid)));                                  // click: details
  c.dispatchEvent(new MouseEvent("mouseup", at(mid)));
  var x0 = window.ftViz.view.x0;
  c.dispatchEvent(new MouseEvent("mousedown", at(mid)));                                  // drag: pan
  var m = at(mid); m.clientX -= 200; window.dispatchEvent(new MouseEvent("mousemove", m));
  window.dispatchEvent(new MouseEvent("mouseup", m));
  var panned = window.ftViz.view.x0 - x0;
  c.dispatchEvent(new MouseEvent("dblclick", at(mid)));                                    // reset
  window.ftViz.redraw();  // draw now rather than on the next frame, which a loaded machine may not give
  root.setAttribute("data-test", JSON.stringify({
    full: full, zoomed: zoomed, name: T.name[i], tip: tip.textContent, tipShown: tip.style.display,
    info: p.el.querySelector(".info").textContent, selected: p.selected, task: i, panned: panned,
    after: JSON.parse(c.getAttribute("data-drawn")).compute }));
});
"""


def run_script(chromium: str, tmp_path: Path, page: Path, script: str, *extra: str) -> dict:
    """Load ``page`` with ``script`` run after the load event; what it put in ``data-test``."""
    page.write_text(page.read_text().replace("</body>", f"<script>{script}</script></body>"))
    proc = browse(chromium, tmp_path, page, "--virtual-time-budget=10000", "--dump-dom", *extra)
    parser = _HtmlAttrs()
    parser.feed(proc.stdout)
    attrs = parser.attrs or {}
    assert attrs.get("data-ft-errors") == "0", attrs.get("data-ft-error-text")
    return json.loads(attrs["data-test"])


def test_zoom_pan_hover_and_click(chromium, tmp_path, cpu_traces):
    """Synthetic wheel, drag, hover, click and double-click events on the first panel."""
    page = write_report(tmp_path / "report.html", [load_input(cpu_traces[1])])
    got = run_script(chromium, tmp_path, page, INTERACT_JS)
    full = lane_counts(cpu_traces[1])["compute"]
    assert got["full"] == full and 0 < got["zoomed"] < full  # the wheel zoomed in around the task
    assert got["tipShown"] == "block" and got["tip"].startswith(got["name"])  # hover names the task
    assert "duration" in got["tip"] and "bytes" in got["tip"] and "micro-batch" in got["tip"]
    assert got["selected"] == got["task"] and "depends on:" in got["info"]  # click pins the details
    assert got["panned"] > 0  # dragging left moves the view later in time
    assert got["after"] == full  # double-click shows everything again


BRUSH_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz;
  function windows() { return F.panels.map(function (p) { return JSON.parse(p.el.getAttribute("data-window")); }); }
  function drag(k) {  // on trace k's own brush, from step 3 back to step 2
    var b = document.getElementById("ft-brush-" + k), r = b.getBoundingClientRect(), n = F.panels[k].tr.steps.length;
    function at(i) { return { clientX: r.left + (i + 0.5) * r.width / n, clientY: r.top + r.height / 2, bubbles: true }; }
    b.dispatchEvent(new MouseEvent("mousedown", at(2)));
    window.dispatchEvent(new MouseEvent("mousemove", at(1)));
    window.dispatchEvent(new MouseEvent("mouseup", at(1)));
  }
  var before = windows();
  drag(0);
  var one = windows();  // the first trace's window moved; the second kept its own
  drag(1);
  F.redraw();
  document.documentElement.setAttribute("data-test", JSON.stringify({
    before: before, one: one, after: windows(), bars: F.brushBars.map(function (b) { return b.length; }),
    text: F.panels.map(function (p) { return p.el.querySelector(".whichwin").textContent; }),
    view: [F.view.x0, F.view.x1], shift: F.panels.map(function (p) { return p.shift; }) }));
});
"""


def expected(path: Path, steps: str | None) -> dict:
    """The window's numbers as Python computes them (microseconds and fractions)."""
    from flowtrain.viz.html import TraceView

    v = TraceView(load_input(path), steps=steps)
    s = v.summary
    return {"first": v.window.first, "last": v.window.last, "stepTime": s.step_time * 1e6,
            "compute": s.busy_fraction["compute"], "copyHidden": s.overlap.copy_hidden, "idle": s.idle_compute * 1e6,
            "flops": v.compute.model_flops, **{f"share of {r.kind}": r.share for r in v.compute.kinds}}


def numbers(w: dict) -> dict:
    return {"first": w["first"], "last": w["last"], "stepTime": w["stepTime"], "compute": w["busy"]["compute"],
            "copyHidden": w["copyHidden"], "idle": w["idle"], "flops": w["flops"],
            **{f"share of {k['kind']}": k["share"] for k in w["compute"]}}


def test_the_window_brush_recomputes_every_summary(chromium, tmp_path, cpu_traces):
    """Real training traces (4 steps, numbered 1-4 as training numbers them), one brush row
    each: the page opens on the default window (steps 2-4); a drag across the first trace's
    brush from step 3 to step 2 makes steps 2-3 its window and leaves the second's, and the same
    drag on the second's does the same for it; the page's sums match Python's numbers for the
    same windows."""
    page = write_report(tmp_path / "report.html", [load_input(p) for p in cpu_traces])
    got = run_script(chromium, tmp_path, page, BRUSH_JS)
    assert got["bars"] == [4, 4]
    assert (got["one"][0]["first"], got["one"][0]["last"]) == (2, 3) and got["one"][1] == got["before"][1]
    for before, after, text, path in zip(got["before"], got["after"], got["text"], cpu_traces):
        assert numbers(before) == pytest.approx(expected(path, None), rel=1e-6, abs=1e-3)
        assert (before["first"], before["last"]) == (2, 4)
        assert numbers(after) == pytest.approx(expected(path, "2:3"), rel=1e-6, abs=1e-3)
        assert text.startswith("window: steps 2\u20133 (2 of 4, ") and "brushed" in text
    longest = max(w["end"] - w["start"] for w in got["after"])
    for w, shift in zip(got["after"], got["shift"]):  # each trace counted from its own window's start
        assert w["start"] - shift == 0 and got["view"][0] < 0 < w["end"] - shift <= got["view"][1]
    assert got["view"][1] < longest * 1.1  # zoomed to the windows


ALIGN_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz;
  F.align(2);
  F.redraw();
  document.documentElement.setAttribute("data-test", JSON.stringify({
    shift: F.panels.map(function (p) { return +p.el.getAttribute("data-shift"); }),
    x: F.panels.map(function (p) { return p.X(p.shift); }),
    select: document.querySelector("[data-act=align]").value }));
});
"""


def test_align_at_a_step_lines_the_traces_up_at_its_start(chromium, tmp_path, cpu_traces):
    from flowtrain.viz.html import TraceView

    views = [TraceView(load_input(p)) for p in cpu_traces]
    page = write_report(tmp_path / "report.html", [v.trace for v in views])
    got = run_script(chromium, tmp_path, page, ALIGN_JS)
    starts = [round(next(r.start for r in v.rows if r.step == 2) * 1e6, 3) for v in views]
    assert got["shift"] == starts and starts[0] != starts[1]  # the traces' step 2 starts differ...
    assert got["x"][0] == pytest.approx(got["x"][1]) and got["select"] == "2"  # ...and are drawn at one x


OCC_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, out = [];
  F.reset(); F.redraw();
  F.panels.forEach(function (p) {
    var ctx = p.canvas.getContext("2d"), dpr = window.devicePixelRatio || 1;
    p.rows.filter(function (r) { return r.type === "occ" || r.type === "mem"; }).forEach(function (r) {
      var img = ctx.getImageData(140 * dpr, (r.y + 12) * dpr, (p.width - 160) * dpr, (r.h - 12) * dpr).data, inked = 0;
      for (var i = 0; i < img.length; i += 4) if (img[i] + img[i + 1] + img[i + 2] < 600) inked++;
      var peak = r.pts ? Math.max.apply(null, r.pts.map(function (q) { return q[1]; })) : null;
      out.push({ type: r.type, label: r.label, budget: r.budget, peak: peak, inked: inked });
    });
  });
  document.documentElement.setAttribute("data-test", JSON.stringify(out));
});
"""


def test_occupancy_and_bytes_tracks_are_drawn(chromium, tmp_path, cpu_traces):
    """Each pool's slots-in-use track (against the budget the trace records) and the bytes-held
    track are rows of the canvas with ink in them."""
    tr = load_input(cpu_traces[1])
    page = write_report(tmp_path / "report.html", [tr])
    got = run_script(chromium, tmp_path, page, OCC_JS)
    budgets = tr.meta["budgets"]
    occ = [r for r in got if r["type"] == "occ"]
    assert {r["label"] for r in occ} == {f"{pool} in use" for pool in budgets}
    assert all(r["budget"] == budgets[r["label"].split()[0]] and 0 < r["peak"] <= r["budget"] for r in occ)
    assert [r["type"] for r in got].count("mem") == 1
    assert all(r["inked"] > 50 for r in got), got


PATTERN_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, p = F.panels[0], row = p.el.querySelector("tr.pattern"), pat = +row.getAttribute("data-p");
  var w = JSON.parse(p.el.getAttribute("data-window"));
  var gaps = p.tr.gaps.filter(function (g) { return g.p === pat && g.e > w.start && g.s < w.end; });
  row.click();
  var first = [F.view.x0, F.view.x1];
  row.click();
  document.documentElement.setAttribute("data-test", JSON.stringify({
    first: first, second: [F.view.x0, F.view.x1], gaps: gaps.map(function (g) { return [g.s, g.e]; }),
    marked: p.marked === pat, rows: w.patterns }));
});
"""


def test_a_gap_pattern_row_zooms_to_its_gaps_in_turn(chromium, tmp_path):
    """On a trace whose timings are fixed (the sequential policy on ideal lanes: compute waits
    for every fetch), so the window's commonest gap pattern recurs whatever the machine's load."""
    from flowtrain.runtime.trace import write_chrome_trace

    trace = tmp_path / "sequential.json"
    write_chrome_trace(trace, simulated_records(layers=4, micro_batches=2, steps=4, policy="sequential"),
                       meta={"policy": "sequential"})
    page = write_report(tmp_path / "report.html", [load_input(trace)])
    got = run_script(chromium, tmp_path, page, PATTERN_JS)
    assert got["marked"] and len(got["gaps"]) == got["rows"][0][1] >= 2  # the row counts the window's gaps
    for view, (s, e) in zip((got["first"], got["second"]), got["gaps"]):
        assert view[0] < s < e < view[1] and view[1] - view[0] < 20 * (e - s) + 2  # each click: the next gap


# ---- what the page says about real H200 traces (slices in tests/viz/fixtures) ----------------

FIXTURES = Path(__file__).parent / "fixtures"

TRUTH_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, out = { panels: [] };
  F.panels.forEach(function (p) {  // as the page opened: what each chart shows, in its own time
    var w = JSON.parse(p.el.getAttribute("data-window"));
    out.panels.push({ shift: p.shift, v0: p.v0(), v1: p.v1(), start: w.start, end: w.end, window: w,
                      summary: p.el.querySelector(".summary").textContent, aligned: F.state.aligned });
  });
  out.bars = F.brushBars[0]; out.brushH = F.brushH;
  var p = F.panels[0], T = p.tr.t, c = p.canvas;
  var w0 = out.panels[0], gap = p.tr.gaps.filter(function (g) { return g.s >= w0.start && g.e <= w0.end; })
    .sort(function (a, b) { return (b.e - b.s) - (a.e - a.s); })[0];  // the window's longest gap
  F.show(gap.s - p.shift - (gap.e - gap.s), gap.e - p.shift + (gap.e - gap.s)); F.redraw();
  var r = c.getBoundingClientRect(), row = p.rows.filter(function (x) { return x.type === "gap"; })[0];
  var tip = document.getElementById("ft-tip");
  function at(t, rw) { return { clientX: r.left + p.X(t), clientY: r.top + rw.y + rw.h / 2, bubbles: true }; }
  c.dispatchEvent(new MouseEvent("mousemove", at((gap.s + gap.e) / 2, row)));
  out.gapTip = tip.textContent; out.gap = [gap.s, gap.e];
  var lane = p.rows[0], i = lane.idx.filter(function (j) { return T.s[j] > gap.e; })[0];
  c.dispatchEvent(new MouseEvent("mousemove", at((T.s[i] + T.e[i]) / 2, lane)));
  out.taskTip = tip.textContent; out.task = [T.s[i], T.step[i]];
  document.documentElement.setAttribute("data-test", JSON.stringify(out));
});
"""


def test_the_page_tells_the_truth_about_an_h200_run(chromium, tmp_path, cpu_traces):
    """W1 on an H200 (a 12 s warm-up, then 0.7-0.8 s steps) beside a CPU run of a few ms:
    each opens on its own window; the brush shows the steady steps as bars of their own
    heights, labelled with their times; hovered times are offsets into their step with the
    digits to tell a gap's ends apart; budgets the trace does not record say "(inferred)";
    the headline compute busy is Python's and lies among the per-step figures."""
    from flowtrain.viz.html import TraceView
    from flowtrain.viz.steps import fmt_time

    w1 = FIXTURES / "w1-adam-order-steps0-3.json"
    views = [TraceView(load_input(w1)), TraceView(load_input(cpu_traces[1]))]
    page = write_report(tmp_path / "report.html", [v.trace for v in views])
    got = run_script(chromium, tmp_path, page, TRUTH_JS)
    longest = max(p["end"] - p["start"] for p in got["panels"])
    for p, v in zip(got["panels"], views):
        assert p["aligned"] == "window" and p["shift"] == pytest.approx(v.window.start * 1e6, abs=1e-3)
        # each chart shows its own window from its start (one scale: the shorter one has room after it)
        assert p["start"] - 0.03 * longest < p["v0"] < p["start"] < p["end"] <= p["v1"]
        assert p["window"]["computeBusy"] == pytest.approx(v.summary.compute_busy, rel=1e-9)
        assert f"compute busy {100 * v.summary.compute_busy:.1f}% of busy + idle (per step: median" in p["summary"]
    from flowtrain.viz.verdicts import pattern_verdicts

    for p, v in zip(got["panels"], views):  # each stall pattern's verdict, as Python gives it
        want = pattern_verdicts(v.gaps, v.verdicts, v.window.start, v.window.end)
        assert {text: verdict for text, _, verdict in p["window"]["patterns"]} == want and want
    assert "weights budget 6 (inferred)" in got["panels"][0]["summary"]  # W1's file records no budgets
    assert "(inferred)" not in got["panels"][1]["summary"]  # a train trace records them
    bars, rows = got["bars"], views[0].rows
    assert [b["step"] for b in bars] == [1, 2, 3, 4] and bars[0]["cut"] and not any(b["cut"] for b in bars[1:])
    assert all(b["h"] > 0.8 * got["brushH"] for b in bars[1:])  # 0.69-0.81 s of a 0.81 s scale: tall bars, not 3-px lines
    assert [b["label"] for b in bars] == [fmt_time(r.duration).replace("µ", "\u00b5") for r in rows]
    tip = got["gapTip"]
    m = re.search(r"from step (\d+) \+([\d.]+) (\w+) to \+([\d.]+) (\w+)", tip)
    assert m and m.group(2) != m.group(4), tip  # never "from 15.2 s to 15.2 s"
    step = next(r for r in rows if r.start * 1e6 <= got["gap"][0] < r.end * 1e6)
    assert int(m.group(1)) == step.step
    assert float(m.group(2)) * {"s": 1e6, "ms": 1e3}.get(m.group(3), 1) == pytest.approx(got["gap"][0] - step.start * 1e6, rel=0.05)
    assert re.search(rf"start step {got['task'][1]} \+[\d.]+ ", got["taskTip"]), got["taskTip"]


SCROLL_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, bar = document.getElementById("ft-toolbar"), out = {};
  var p = F.panels[F.panels.length - 1], row = p.el.querySelector("tr.pattern"), pat = +row.getAttribute("data-p");
  window.scrollTo(0, document.documentElement.scrollHeight);  // down at the tables, the chart out of view
  out.before = p.canvas.getBoundingClientRect().top;
  row.click();
  var w = JSON.parse(p.el.getAttribute("data-window"));
  var g = p.tr.gaps.filter(function (x) { return x.p === pat && x.e > w.start && x.s < w.end; })[p.cursor];
  out.after = p.canvas.getBoundingClientRect().top; out.bar = bar.getBoundingClientRect().bottom;
  var title = p.el.querySelector("h2").getBoundingClientRect(); out.title = [title.top, title.bottom];
  out.height = window.innerHeight; out.view = [p.v0(), p.v1()]; out.gap = [g.s, g.e];
  F.panels[0].canvas.scrollIntoView();  // any scroll to a chart stops under the toolbar
  out.first = F.panels[0].canvas.getBoundingClientRect().top; out.bar0 = bar.getBoundingClientRect().bottom;
  var t0 = F.panels[0].el.querySelector("h2").getBoundingClientRect(); out.title0 = [t0.top, t0.bottom];
  document.documentElement.setAttribute("data-test", JSON.stringify(out));
});
"""


def test_a_gap_pattern_click_brings_its_chart_into_view_under_the_toolbar(chromium, tmp_path, cpu_traces):
    page = write_report(tmp_path / "report.html", [load_input(p) for p in cpu_traces[::-1]])
    got = run_script(chromium, tmp_path, page, SCROLL_JS, "--window-size=1300,700")
    assert got["before"] < 0 or got["before"] > got["height"]  # the chart was out of view
    # now just under the sticky toolbar and the panel's title, which stays in view
    assert got["bar"] - 1 <= got["title"][0] < got["bar"] + 10 and got["title"][1] - 1 <= got["after"] < got["title"][1] + 30
    assert got["view"][0] < got["gap"][0] < got["gap"][1] < got["view"][1]  # and zoomed to the gap
    assert got["bar0"] - 1 <= got["title0"][0] < got["bar0"] + 10 and got["title0"][1] - 1 <= got["first"] < got["title0"][1] + 30


SEVERAL_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, bar = document.getElementById("ft-toolbar"), out = { titles: [] };
  out.toolbar = bar.getBoundingClientRect().height; out.height = window.innerHeight;
  out.bars = F.brushBars.map(function (b) { return b.map(function (x) { return x.step; }); });
  out.windows = F.panels.map(function (p) { return JSON.parse(p.el.getAttribute("data-window")); });
  out.which = F.panels.map(function (p) { return p.el.querySelector(".whichwin").textContent; });
  F.panels.forEach(function (p) {  // scrolled into the middle of each panel, its title is in view, on top
    var r = p.el.getBoundingClientRect();
    window.scrollTo(0, window.scrollY + r.top + r.height / 2 - window.innerHeight / 2);
    var h = p.el.querySelector("h2"), t = h.getBoundingClientRect();
    var hit = document.elementFromPoint(t.left + 20, (t.top + t.bottom) / 2);
    out.titles.push({ top: t.top, bottom: t.bottom, bar: bar.getBoundingClientRect().bottom, onTop: h.contains(hit),
                      text: h.textContent });
  });
  document.documentElement.setAttribute("data-test", JSON.stringify(out));
});
"""


def test_several_traces_each_get_a_brush_a_window_and_a_title_in_view(chromium, tmp_path, cpu_traces):
    """Three traces, two of them 4 steps long and one of 3 (an engine run), opened with
    --steps 4:4: one brush row per trace with its own steps, the 4-step traces on step 4 and the
    short one on its steady state, saying why; in an 800x600 window the toolbar takes at most a
    fifth of the height, and each panel's title stays in view while its panel is scrolled."""
    from flowtrain.viz.html import trace_views

    short = engine_trace_file(tmp_path / "short.json", layers=2, steps=3)
    paths = [FIXTURES / "w1-adam-order-steps0-3.json", cpu_traces[0], short]
    views = trace_views([load_input(p) for p in paths], steps="4:4")
    page = write_report(tmp_path / "report.html", [v.trace for v in views], views=views)
    got = run_script(chromium, tmp_path, page, SEVERAL_JS, "--window-size=800,600")
    assert got["bars"] == [[r.step for r in v.rows] for v in views] and [len(b) for b in got["bars"]] == [4, 4, 3]
    assert [(w["first"], w["last"]) for w in got["windows"]] == [(4, 4), (4, 4), (views[2].window.first, 3)]
    assert "--steps 4:4 is not in this trace (it has steps 1\u20133)" in got["which"][2]
    assert got["toolbar"] <= 0.2 * 600, got["toolbar"]  # of the window (its viewport is shorter still)
    for t, v in zip(got["titles"], views):
        assert t["bar"] - 1 <= t["top"] and t["bottom"] <= got["height"] and t["onTop"], t
        assert v.trace.label in t["text"]


POLISH_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, p = F.panels[0], T = p.tr.t, out = {};
  F.reset(); F.redraw();
  out.ticks = p.ticks; out.width = p.width;
  var lane = p.rows[0], i = lane.idx[Math.floor(lane.idx.length / 2)];  // a compute task, a few times wider than its name
  F.show(T.s[i] - (T.e[i] - T.s[i]) * 2, T.e[i] + (T.e[i] - T.s[i]) * 2); F.redraw();
  out.labels = p.labels; out.zoomTicks = p.ticks;
  out.sweep = [];  // views of every width from 3 us to 3 s, starting anywhere in a tick's period
  [3, 7.3, 41, 218, 1420, 1444, 1610, 9e3, 7.7e4, 2.2e5, 3.1e6].forEach(function (span) {
    [0, 0.13, 0.37, 0.61, 0.89].forEach(function (phase) {
      var a = 75000 + phase * span; F.show(a, a + span); F.redraw();
      out.sweep.push({ span: span, ticks: p.ticks });
    });
  });
  F.show(23.512e6, 23.518e6); F.redraw();   // deep zoom, 23.5 s into a run
  out.span = document.getElementById("ft-span").textContent;
  document.documentElement.setAttribute("data-test", JSON.stringify(out));
});
"""


def test_labels_fit_with_contrast_ticks_stay_in_the_chart_and_deep_zoom_has_digits(chromium, tmp_path, cpu_traces):
    """Task names are cut to their bar and drawn in whichever of white or near-black contrasts
    more with it (at least 4.5:1); at any zoom at least three ticks are labelled, none on
    another and every one inside the chart, the last one too; the view's span at deep zoom tells its ends apart ("23.512 s - 23.518 s")."""
    page = write_report(tmp_path / "report.html", [load_input(cpu_traces[1])])
    got = run_script(chromium, tmp_path, page, POLISH_JS)
    assert got["labels"], "no task was labelled when zoomed to a few tasks"
    for lab in got["labels"]:
        assert lab["width"] <= lab["x1"] - lab["x0"] - 6 + 0.5, lab  # fits its bar
        assert lab["contrast"] >= 4.5, lab
    assert any(lab["fg"] == "#ffffff" for lab in got["labels"]) or all(lab["contrast"] >= 4.5 for lab in got["labels"])
    for ticks in [got["ticks"], got["zoomTicks"]] + [v["ticks"] for v in got["sweep"]]:
        assert len(ticks) >= 3, ticks
        assert all(128 <= t["left"] and t["right"] <= got["width"] - 12 for t in ticks), ticks
        assert all(a["right"] < b["left"] for a, b in zip(ticks, ticks[1:])), ticks  # no label on another
    m = re.fullmatch(r"view (\S+) – (\S+) s.*", "view " + got["span"])
    assert m and m.group(1) != m.group(2) and float(m.group(1)) == pytest.approx(23.512, abs=2e-3), got["span"]


OUTLIERS_JS = r"""
window.addEventListener("load", function () {
  var F = window.ftViz, p = F.panels[0], out = {};
  out.before = JSON.parse(p.el.getAttribute("data-window"));
  out.table = p.el.querySelector("table.outliers").innerText;
  F.setWindow(3, 3, 0);
  out.after = JSON.parse(p.el.getAttribute("data-window"));
  document.documentElement.setAttribute("data-test", JSON.stringify(out));
});
"""


def test_the_page_lists_late_starts_and_long_tasks_as_python_finds_them(chromium, tmp_path):
    """An H100 run on a 10 GB card whose trace has both: CPU AdamW started up to 135 ms after
    its gradient reached the host, and two forwards of 377 and 412 ms against a 6 ms median.
    The page's lists for its window, and for step 3 alone once brushed, are Python's."""
    from flowtrain.viz.html import TraceView

    path = Path(__file__).parents[2] / "docs/bench/2026-12-07/gate10-h100-8b10o-trace.json"
    trace = load_input(path)
    page = write_report(tmp_path / "report.html", [trace])
    got = run_script(chromium, tmp_path, page, OUTLIERS_JS)

    def python(steps):
        v = TraceView(trace, steps=steps)
        late = [[v.trace.tasks[x.task].name, x.delay * 1e6] for x in v.late]
        long = [[v.trace.tasks[y.task].name, v.trace.tasks[y.task].duration * 1e6, y.median * 1e6] for y in v.long]
        return late, long

    for window, steps in ((got["before"], None), (got["after"], "3")):
        late, long = python(steps)
        assert late and long
        assert [n for n, _ in window["late"]] == [n for n, _ in late]
        assert [d for _, d in window["late"]] == pytest.approx([d for _, d in late], abs=0.01)
        assert sorted(n for n, *_ in window["long"]) == sorted(n for n, *_ in long)
        for a, b in zip(sorted(window["long"]), sorted(long)):
            assert a[1:] == pytest.approx(b[1:], abs=0.01)
    assert (got["after"]["first"], got["after"]["last"]) == (3, 3) and len(got["after"]["late"]) < len(got["before"]["late"])
    assert "late starts on cpu" in got["table"] and "long forward tasks on compute (median 6.1" in got["table"]
