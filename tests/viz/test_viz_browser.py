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
import shutil
import subprocess
from pathlib import Path

import pytest
from viz_helpers import engine_trace_file, lane_counts

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
    from flowtrain.train.trainer import TrainConfig, train

    d = tmp_path_factory.mktemp("traces")
    paths = []
    for p in ("sequential", "double_buffer"):
        path = d / f"{p}.json"
        train(TrainConfig(model="tiny", steps=2, batch_size=4, micro_batch_size=2, seq_len=64, policy=p,
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


def test_two_thousand_tasks_render_in_under_two_seconds(chromium, tmp_path):
    trace = engine_trace_file(tmp_path / "big.json", layers=30, micro_batches=4, checkpoint_every=3, steps=4)
    assert sum(lane_counts(trace).values()) >= 2000
    page = write_report(tmp_path / "big.html", [load_input(trace)])
    attrs, console = page_state(chromium, tmp_path, page)
    assert_clean_render(attrs, console, [trace])
    # performance.now() at the end of the first render counts from navigation start: parsing
    # the page and its data, building the rows and drawing every task
    assert float(attrs["data-ft-render-ms"]) < 2000


INTERACT_JS = r"""
window.addEventListener("load", function () {
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


def test_zoom_pan_hover_and_click(chromium, tmp_path, cpu_traces):
    """Synthetic wheel, drag, hover, click and double-click events on the first panel."""
    page = write_report(tmp_path / "report.html", [load_input(cpu_traces[1])])
    page.write_text(page.read_text().replace("</body>", f"<script>{INTERACT_JS}</script></body>"))
    proc = browse(chromium, tmp_path, page, "--virtual-time-budget=10000", "--dump-dom")
    parser = _HtmlAttrs()
    parser.feed(proc.stdout)
    attrs = parser.attrs or {}
    assert attrs.get("data-ft-errors") == "0", attrs.get("data-ft-error-text")
    got = json.loads(attrs["data-test"])
    full = lane_counts(cpu_traces[1])["compute"]
    assert got["full"] == full and 0 < got["zoomed"] < full  # the wheel zoomed in around the task
    assert got["tipShown"] == "block" and got["tip"].startswith(got["name"])  # hover names the task
    assert "duration" in got["tip"] and "bytes" in got["tip"] and "micro-batch" in got["tip"]
    assert got["selected"] == got["task"] and "depends on:" in got["info"]  # click pins the details
    assert got["panned"] > 0  # dragging left moves the view later in time
    assert got["after"] == full  # double-click shows everything again
