"""One self-contained HTML report for any number of traces and graphs.

Traces are drawn as Gantt charts on one shared time scale (zoom and pan move them together),
with slot occupancy rows and compute-idle markers; graphs as a layered DAG or a table. The file
needs no network: data, styles and scripts are inline, and a Content-Security-Policy forbids
anything else::

    write_report("report.html", [load_input("seq.json"), load_input("db.json")])
"""

from __future__ import annotations

import html as _html
import json
from pathlib import Path
from typing import Sequence

from .analysis import (
    Gap,
    SlotUse,
    Summary,
    Wait,
    blockers,
    compute_gaps,
    critical_chain,
    default_min_gap,
    describe_wait,
    mean_durations,
    slot_uses,
    summarize,
)
from .assets import CSS, GANTT_JS, GUARD_JS
from .graphview import KIND_COLORS, REASON_COLORS, color, graph_section
from .load import GraphInput, Trace

_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'")


def _esc(s: object) -> str:
    return _html.escape(str(s), quote=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


class TraceView:
    """A trace with everything the report shows about it, computed once."""

    def __init__(self, trace: Trace, min_gap: float | None = None) -> None:
        self.trace = trace
        self.uses: list[SlotUse] = slot_uses(trace)
        self.waits: list[Wait | None] = blockers(trace, self.uses)
        self.min_gap = default_min_gap(trace) if min_gap is None else min_gap
        self.gaps: list[Gap] = compute_gaps(trace, min_gap=self.min_gap, waits=self.waits)
        self.summary: Summary = summarize(trace, self.min_gap, self.gaps, self.uses)
        self.chain: list[int] = critical_chain(trace, self.waits)


def _why(view: TraceView, i: int) -> str:
    w = view.waits[i]
    if w is None:
        return ""
    delay = view.trace.tasks[i].start - w.end
    return describe_wait(view.trace, w) + (f" (then {delay * 1e3:.3f} ms until it started)" if delay > 1e-6 else "")


def trace_payload(view: TraceView, kinds: list[str]) -> dict:
    """The trace as columns of plain numbers and strings for the page's script (times in us)."""
    tr = view.trace
    lanes = tr.lanes
    lane_index = {lane: i for i, lane in enumerate(lanes)}
    tasks = tr.tasks
    cols: dict[str, list] = {k: [] for k in ("s", "e", "k", "l", "name", "layer", "mb", "step", "bytes",
                                             "slot", "reads", "deps", "why")}
    for t in tasks:
        cols["s"].append(_us(t.start))
        cols["e"].append(_us(t.end))
        cols["k"].append(kinds.index(t.kind))
        cols["l"].append(lane_index[t.lane_name])
        cols["name"].append(t.name)
        cols["layer"].append(t.layer)
        cols["mb"].append(t.micro_batch)
        cols["step"].append(t.step)
        cols["bytes"].append(t.bytes)
        cols["slot"].append(f"{t.takes} #{t.slot}" if t.takes is not None and t.slot is not None else None)
        cols["reads"].append(", ".join(f"{p} #{s}" for p, ss in t.reads.items() for s in ss) or None)
        cols["deps"].append(list(tr.dep_indices[t.index]))
        cols["why"].append(_why(view, t.index))
    slots: dict[tuple[str, int], list[dict]] = {}
    for u in view.uses:
        slots.setdefault((u.pool, u.slot), []).append({
            "s": _us(u.start), "e": _us(u.end), "c": color(tasks[u.holder].kind), "pool": u.pool,
            "slot": u.slot, "h": u.holder, "n": len(u.readers)})
    gaps = [{"s": _us(g.start), "e": _us(g.end), "c": color(g.reason), "r": g.reason, "text": g.text}
            for g in view.gaps]
    return {
        "label": tr.label,
        "lanes": lanes,
        "t": cols,
        "slots": [{"pool": p, "slot": s, "iv": iv} for (p, s), iv in sorted(slots.items())],
        "gaps": gaps,
        "gapLane": "compute",
        "crit": view.chain,
    }


def _summary_html(view: TraceView) -> str:
    s = view.summary
    rows = "".join(
        f"<tr><td>{_esc(lane)}</td><td>{s.tasks_per_lane[lane]}</td><td>{_ms(s.busy[lane])}</td>"
        f"<td>{_pct(s.busy_fraction[lane])}</td><td>{s.bytes_per_lane.get(lane, 0):,}</td></tr>"
        for lane in view.trace.lanes)
    lanes = ("<table class=lanes><tr><th>lane</th><th>tasks</th><th>busy</th><th>busy %</th><th>bytes</th></tr>"
             f"{rows}</table>")
    o = s.overlap
    steps = len(s.steps)
    facts = [
        f"<b>{s.tasks}</b> tasks, wall <b>{_ms(s.wall)}</b>, {steps} step{'s' if steps != 1 else ''}, "
        f"step time <b>{_ms(s.step_time)}</b>"
        + (" (between consecutive step ends)" if steps > 1 else ""),
        f"overlap: compute hid <b>{_pct(o.copy_hidden)}</b> of copy time ({_ms(o.compute_copy)} of {_ms(o.copy)}) "
        f"and {_pct(o.cpu_hidden)} of CPU time ({_ms(o.compute_cpu)} of {_ms(o.cpu)})",
        f"compute idle {_ms(s.idle_compute)} in all; marked gaps (longer than {_ms(s.min_gap)}): "
        + (", ".join(f"<span class=sw style='background:{color(r)}'></span>{_esc(r)} {_ms(v)}"
                     for r, v in s.idle_by_reason.items()) or "none"),
    ]
    if s.budgets:
        facts.append("slots: " + ", ".join(
            f"{_esc(p)} budget {n}, peak {s.peak_slots.get(p, 0)}, mean {s.mean_slots.get(p, 0.0):.2f}"
            for p, n in s.budgets.items()))
    gap_rows = "".join(
        f"<tr><td>{_ms(g.start)}</td><td>{_ms(g.duration)}</td><td>{_esc(g.reason)}</td>"
        f"<td class=seq>{_esc(g.text)}</td></tr>"
        for g in sorted(view.gaps, key=lambda g: -g.duration)[:100])
    gaps = (f"<details><summary>compute idle gaps ({len(view.gaps)}, longest first)</summary>"
            "<table><tr><th>at</th><th>idle</th><th>reason</th><th>why</th></tr>"
            f"{gap_rows}</table></details>") if view.gaps else ""
    return ("<div class=cols><div>" + lanes + "</div><div>" + "".join(f"<div>{f}</div>" for f in facts)
            + gaps + "</div></div>")


def _comparison_html(views: Sequence[TraceView]) -> str:
    head = "".join(f"<th>{_esc(v.trace.label)}</th>" for v in views)

    def row(name: str, fn) -> str:
        return f"<tr><td>{name}</td>" + "".join(f"<td>{fn(v.summary)}</td>" for v in views) + "</tr>"

    rows = [
        row("tasks", lambda s: s.tasks),
        row("wall", lambda s: _ms(s.wall)),
        row("step time", lambda s: _ms(s.step_time)),
        row("compute busy", lambda s: _pct(s.busy_fraction.get("compute", 0.0))),
        row("copy hidden by compute", lambda s: _pct(s.overlap.copy_hidden)),
        row("compute idle", lambda s: _ms(s.idle_compute)),
        row("largest idle reason", lambda s: next((f"{_esc(r)} {_ms(v)}" for r, v in s.idle_by_reason.items()), "none")),
    ]
    return f"<h2>Comparison</h2><table><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _legend(kinds: Sequence[str], reasons: Sequence[str]) -> str:
    items = "".join(f"<span class=item><span class=sw style='background:{color(k)}'></span>{_esc(k)}</span>"
                    for k in kinds)
    extra = [r for r in reasons if r in REASON_COLORS]
    more = "".join(f"<span class=item><span class=sw style='background:{color(r)}'></span>idle: {_esc(r)}</span>"
                   for r in extra)
    return f"<div class=legend>{items}{more}</div>"


def _json_script(data: object) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    # "<" only occurs inside JSON strings, where \u003c means the same: nothing in the data
    # can end the <script> element or open a comment in it.
    return text.replace("<", "\\u003c")


def render_report(inputs: Sequence[Trace | GraphInput], policy: object = "double_buffer",
                  title: str = "flowtrain schedule report", min_gap: float | None = None) -> str:
    """The report as one HTML string."""
    traces = [x for x in inputs if isinstance(x, Trace)]
    graphs = [x for x in inputs if isinstance(x, GraphInput)]
    views = [TraceView(t, min_gap) for t in traces]
    known = list(KIND_COLORS)  # legend order: the palette's, then unknown kinds by name
    kinds = sorted({t.kind for tr in traces for t in tr.tasks},
                   key=lambda k: (k not in known, known.index(k) if k in known else 0, k))
    reasons = sorted({g.reason for v in views for g in v.gaps})
    payload = {
        "maxWall": max((_us(t.wall) for t in traces), default=1.0),
        "kinds": kinds,
        "colors": [color(k) for k in kinds],
        "traces": [trace_payload(v, kinds) for v in views],
    }
    parts = [f"<h1>{_esc(title)}</h1>",
             "<p class=small>inputs: " + ", ".join(_esc(x.path or x.name) for x in inputs) + "</p>"]
    if views:
        parts.append(
            '<div class=toolbar id="ft-toolbar"><button data-act=reset>reset</button>'
            '<button data-act=in>zoom in</button><button data-act=out>zoom out</button> '
            '<label><input type=checkbox data-act=crit> critical chain</label> '
            '<span class=small>wheel: zoom &middot; drag or shift+wheel: pan &middot; double-click: reset '
            '&middot; click a task for its dependencies &middot; view <span id="ft-span"></span></span>'
            + _legend(kinds, reasons) + "</div>")
        if len(views) > 1:
            parts.append(_comparison_html(views))
        for n, v in enumerate(views):
            parts.append(
                f'<section class=panel id="panel-{n}" data-trace="{_esc(v.trace.label)}" '
                f'data-tasks="{len(v.trace.tasks)}"><h2>Trace: {_esc(v.trace.label)}</h2>'
                f'<canvas class=gantt aria-label="Gantt chart of {_esc(v.trace.label)}"></canvas>'
                '<div class=info>click a task for details; wheel zooms, drag pans, double-click resets</div>'
                f"{_summary_html(v)}</section>")
    cost = mean_durations(traces) if traces else None
    for g in graphs:
        gcost = cost if cost and all(t.kind in cost for t in g.graph) else None
        parts.append(graph_section(g.graph, policy, title=g.name, cost=gcost))
    scripts = ""
    if views:
        scripts = (f'<script type="application/json" id="ft-data">{_json_script(payload)}</script>'
                   f"<script>{GANTT_JS}</script>")
    else:
        scripts = ("<script>document.documentElement.setAttribute('data-ft-render-ms', performance.now().toFixed(1));"
                   "document.documentElement.setAttribute('data-ft-lanes', '[]');"
                   "document.documentElement.setAttribute('data-ft-ready', '1');</script>")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{_esc(title)}</title><style>{CSS}</style><script>{GUARD_JS}</script></head>"
            f'<body><div id="ft-tip"></div>{"".join(parts)}{scripts}</body></html>\n')


def write_report(path: str | Path, inputs: Sequence[Trace | GraphInput], **options) -> Path:
    """Write :func:`render_report` to ``path``; returns the path."""
    p = Path(path)
    p.write_text(render_report(inputs, **options), encoding="utf-8")
    return p
