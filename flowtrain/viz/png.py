"""A static picture of the report for docs and issues (matplotlib, imported only here).

Traces become stacked Gantt charts of the window the report opens on (the steady state, or
``--steps``), each counted from its window's start so that the same step of two runs lines up:
the rows of the HTML report (lanes, compute-idle markers, slots) over step bands, and titles
with the window's numbers. With no trace among the inputs, the first graph is drawn as its
layered DAG with the critical path. Uses matplotlib's object API with the Agg canvas,
so it neither needs a display nor changes the global backend::

    write_png("schedule.png", [load_input("seq.json"), load_input("db.json")])
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import ConfigError
from .analysis import critical_path
from .graphview import CRITICAL, KIND_COLORS, MAX_DRAWN, color, positions, short_label
from .html import TraceView, trace_views
from .load import GraphInput, Trace
from .steps import fmt_time


def require_matplotlib() -> None:
    """Raise a :class:`ConfigError` with the install command when matplotlib cannot be imported.

    matplotlib is optional (``flowtrain[viz]``); the command line calls this before it writes
    anything, so a missing picture library is one line, not a traceback after the HTML.
    """
    try:
        import matplotlib  # noqa: F401 - the package first: a stale submodule in sys.modules proves nothing
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install 'flowtrain[viz]'") from None


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _rows(view: TraceView) -> list[tuple[str, str, object]]:
    """(label, type, key) per row, top to bottom, as in the HTML report."""
    rows: list[tuple[str, str, object]] = []
    for lane in view.trace.lanes:
        rows.append((lane, "lane", lane))
        if lane == "compute" and view.gaps:
            rows.append(("compute idle", "gap", None))
    for key in sorted({(u.pool, u.slot) for u in view.uses}):
        rows.append((f"{key[0]} #{key[1]}", "slot", key))
    return rows


#: Horizontal pixels of a trace's axes in the picture, at least: a task is drawn no narrower
#: than the window over this, one pixel.
AXES_PIXELS = 1250


def _draw_trace(ax, view: TraceView, width: float) -> None:
    """One trace's rows, in ms from the start of its window, which spans ``width`` seconds.
    Every task is at least a pixel wide and drawn without an outline or anti-aliased edges, so
    back-to-back thin tasks make a solid bar: a busy lane looks as busy as it was."""
    rows = _rows(view)
    tr = view.trace
    off = view.window.start
    pixel = 1.015 * width * 1e3 / AXES_PIXELS  # ms: the x range is 1.015 windows wide

    def ms(t: float) -> float:
        return (t - off) * 1e3

    for n, r in enumerate(view.rows):  # step bands: warm-up tinted, steps outside the window grey
        inside = view.window.first <= r.step <= view.window.last
        band = "#fff3e0" if r.warmup else ("#f4f6fa" if n % 2 else "#fbfcfe")
        ax.axvspan(ms(r.start), ms(r.end), color=band if inside else "#ececec", zorder=0, linewidth=0)
    for y, (_, kind, key) in enumerate(rows):
        spans: dict[str, list[tuple[float, float]]] = {}
        if kind == "lane" and isinstance(key, str):
            for t in tr.by_lane[key]:
                spans.setdefault(t.kind, []).append((ms(t.start), max(t.duration * 1e3, pixel)))
            height, alpha = 0.8, 1.0
        elif kind == "gap":
            for g in view.gaps:
                spans.setdefault(g.reason, []).append((ms(g.start), max(g.duration * 1e3, pixel)))
            height, alpha = 0.45, 1.0
        else:
            for u in view.uses:
                if (u.pool, u.slot) == key:
                    spans.setdefault(tr.tasks[u.holder].kind, []).append((ms(u.start), max((u.end - u.start) * 1e3, pixel)))
            height, alpha = 0.5, 0.7
        for k, ss in spans.items():
            ax.broken_barh(ss, (y - height / 2, height), facecolors=color(k), edgecolor="none",
                           linewidth=0, alpha=alpha, antialiased=False)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlim(-0.005 * width * 1e3, 1.01 * width * 1e3)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    s = view.summary
    ax.set_title(
        f"{tr.label}, {view.window.label}: step {fmt_time(s.step_time)}, compute busy "
        f"{100 * s.compute_busy:.0f}% of busy + idle, copy hidden {100 * s.overlap.copy_hidden:.0f}%, "
        f"compute idle {fmt_time(s.idle_compute / s.window.steps)} per step", fontsize=9, loc="left")


def _trace_figure(views: Sequence[TraceView]):
    """The traces stacked, each from the start of its window (its steady state by default), so
    that the same step of two runs lines up."""
    from matplotlib.patches import Patch

    heights = [len(_rows(v)) + 1.5 for v in views]
    fig = _figure(13, 0.9 + 0.22 * sum(heights))
    axes = fig.subplots(len(views), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    width = max(v.window.end - v.window.start for v in views)
    for ax, v in zip(axes, views):
        _draw_trace(ax, v, width)
    axes[-1].set_xlabel("time from the start of the window (ms)")
    traces = [v.trace for v in views]
    kinds = [k for k in KIND_COLORS if any(t.kind == k for tr in traces for t in tr.tasks)]
    reasons = sorted({g.reason for v in views for g in v.gaps} - set(kinds))
    handles = [Patch(color=color(k), label=k) for k in kinds]
    handles += [Patch(color=color(r), label=f"idle: {r}") for r in reasons]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    return fig


def _graph_figure(g: GraphInput):
    from matplotlib.collections import LineCollection

    graph = g.graph
    pos = positions(graph)
    path, _ = critical_path(graph)
    crit = set(path)
    ncols = max(c for c, _ in pos.values()) + 1
    nrows = max(r for _, r in pos.values()) + 1
    fig = _figure(min(4 + 0.9 * ncols, 60), min(1.5 + 0.35 * nrows, 30))
    ax = fig.add_subplot()
    xy = {t: (c, -r) for t, (c, r) in pos.items()}
    edges = [(xy[u], xy[v]) for u, v in graph.edges]
    crit_edges = [(xy[u], xy[v]) for u, v in zip(path, path[1:])]
    ax.add_collection(LineCollection(edges, colors="#aaaaaa", linewidths=0.5, zorder=1))
    ax.add_collection(LineCollection(crit_edges, colors=CRITICAL, linewidths=2, zorder=2))
    ts = list(graph.nodes)
    ax.scatter([xy[t][0] for t in ts], [xy[t][1] for t in ts], s=60, marker="s", zorder=3,
               c=[color(t.kind) for t in ts], edgecolors=[CRITICAL if t in crit else "#333333" for t in ts],
               linewidths=[1.8 if t in crit else 0.4 for t in ts])
    if len(ts) <= MAX_DRAWN:
        for t in ts:
            ax.annotate(short_label(t), xy[t], xytext=(5, 4), textcoords="offset points", fontsize=6)
    ax.set_xlim(-0.5, ncols + 0.5)
    ax.set_ylim(-nrows + 0.5, 0.8)
    ax.axis("off")
    ax.set_title(f"{g.name}: {graph.number_of_nodes()} tasks, critical path {len(path)} tasks (violet)",
                 fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def write_png(path: str | Path, inputs: Sequence[Trace | GraphInput], min_gap: float | None = None,
              steps: str | None = None, views: Sequence[TraceView] | None = None) -> Path:
    """Draw the traces among ``inputs`` (or, with none, the first graph) into a PNG file. The
    time axis spans the window (``steps``, as ``--steps``; the default steady-state window) and
    the titles give the window's numbers, as the HTML report's first view does."""
    require_matplotlib()
    traces = [x for x in inputs if isinstance(x, Trace)]
    graphs = [x for x in inputs if isinstance(x, GraphInput)]
    if not traces and not graphs:
        raise ConfigError("nothing to draw: give at least one trace or graph")
    if traces:
        fig = _trace_figure(list(views) if views is not None else trace_views(traces, min_gap, steps))
    else:
        fig = _graph_figure(graphs[0])
    p = Path(path)
    fig.savefig(p, format="png")
    return p
